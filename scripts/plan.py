"""The per-GPU plan of a run config: `python scripts/plan.py CONFIG`, the same as `mok plan CONFIG`."""

from mok_plugin.run.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
