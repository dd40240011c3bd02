"""Multi-GPU invariance test, EP benchmark and pretraining on one host.

The same command as `mok bench multi-gpu`; the code is mok_plugin/bench/multi_gpu.py.
"""

from mok_plugin.bench.multi_gpu import main

if __name__ == "__main__":
    raise SystemExit(main())
