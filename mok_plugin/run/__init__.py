"""Whole training runs: run configs (configs/topologies/) and the per-GPU planner.

Modules, each importing only the ones before it (and `mok_plugin.config`, never the reverse):
  sections.py  the parts of a run: Machine and MACHINES (each figure with its public source),
               ModelShape (the MoE shape and the expert MLP), ParallelLayout
  planner.py   per-GPU memory and MoE-layer time estimates of a run
  topology.py  RunConfig (validates a whole run, using the planner's estimates) and load_topology
  plan.py      `main(argv)`: the printed plan of a run config (`mok plan`, scripts/plan.py)

`load_topology(path).mok_config()` is the MoKConfig of one MoE layer of a run.
"""

from mok_plugin.run.sections import MACHINES, Machine, ModelShape, ParallelLayout
from mok_plugin.run.topology import RunConfig, load_topology

__all__ = ["MACHINES", "Machine", "ModelShape", "ParallelLayout", "RunConfig", "load_topology"]
