"""Time the expert-parallel layer per rank and stage (also under torchrun).

The same command as `mok bench ep`; the code is mok_plugin/bench/ep.py.
"""

from mok_plugin.bench.ep import main

if __name__ == "__main__":
    raise SystemExit(main())
