"""Time the blockwise-FP8 experts against the bf16 ones on one GPU.

The same command as `mok bench fp8`; the code is mok_plugin/bench/fp8.py.
"""

from mok_plugin.bench.fp8 import main

if __name__ == "__main__":
    raise SystemExit(main())
