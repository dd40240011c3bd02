"""Time DeepSpeed's MoE layer, stock against the MoK option, on one GPU (or tiny on the CPU).

The same command as `mok bench generic`; the code is mok_plugin/bench/generic.py. `--expert NAME ...`
picks the expert modules: residual (a LayerNorm residual block, MoK's generic path), gelu-mlp and
swiglu (MoK families, fused).
"""

from mok_plugin.bench.generic import main

if __name__ == "__main__":
    raise SystemExit(main())
