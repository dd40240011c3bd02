"""Time each Triton kernel alone under candidate tile configs.

The same command as `mok bench tune`; the code is mok_plugin/bench/tune.py.
"""

from mok_plugin.bench.tune import main

if __name__ == "__main__":
    raise SystemExit(main())
