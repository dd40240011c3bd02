"""Compile the kernels for sm_90 without a GPU and report their pipelining.

The same command as `mok bench inspect`; the code is mok_plugin/bench/inspect.py.
"""

from mok_plugin.bench.inspect import main

if __name__ == "__main__":
    raise SystemExit(main())
