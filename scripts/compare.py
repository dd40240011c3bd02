"""Compare the stock MoE layers with MoK on one run config (the README's main job).

    python scripts/compare.py --config configs/topologies/tiny_cpu.yaml
    python scripts/compare.py --config CONFIG --framework deepspeed --steps 20

A thin wrapper over `mok_plugin.compare.cli.main` (also `mok compare`); `--help` lists the options.
"""

from mok_plugin.compare.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
