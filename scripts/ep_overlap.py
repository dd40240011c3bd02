"""Megatron's EP-overlap schedule on one GPU (two EP ranks sharing it over gloo), stock and MoK.

The same command as `mok bench ep-overlap`; the code is mok_plugin/bench/ep_overlap.py.
"""

from mok_plugin.bench.ep_overlap import main

if __name__ == "__main__":
    raise SystemExit(main())
