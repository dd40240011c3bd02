"""Time one MoE layer on the GPU against its peers.

The same command as `mok bench layer`; the code is mok_plugin/bench/layer.py. `--expert NAME ...`
picks the expert families (mok_plugin/bench/families.py: swiglu, gpt-oss, nemotron, glu-gelu,
mlp-squared-relu, ...).
"""

from mok_plugin.bench.layer import main

if __name__ == "__main__":
    raise SystemExit(main())
