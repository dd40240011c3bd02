"""When a DeepSpeed engine changes the weights: the signal that lets MoK's FP8 weight copies be kept
through a step's micro-batches.

MoK quantises the expert weights once per step where the framework says which forward starts one
(Megatron's set_is_first_microbatch sets `is_first_microbatch` True on every module that has it;
mok_plugin/fp8/weight_copies.py). DeepSpeed has no such call, so without it a MoK layer remakes its
FP8 copies in every forward. `mark_weight_updates(engine)` gives the engine that signal: after each
optimizer update (`_take_model_step`, which both `engine.step()` at the accumulation boundary and the
pipeline engine's `train_batch` run) and after `load_checkpoint`, every MoK layer of the model starts
again (`is_first_microbatch = True`); the first forward after it makes the copies, the later ones of
the step reuse them. mok_plugin.deepspeed's wrapped `deepspeed.initialize` calls it on the engine it
returns. Weights changed any other way (a user's own `load_state_dict` between micro-batches) must
set `is_first_microbatch = True` on the layers themselves, as under Megatron.
"""

from __future__ import annotations

import functools
from typing import Any

from mok_plugin.layer import MoKMoE

__all__ = ["mark_weight_updates"]


def mark_weight_updates(engine: Any) -> None:
    """Set `is_first_microbatch` on the engine model's MoK layers whenever the engine changes the
    weights (module docstring). Nothing to do for a model without MoK layers."""
    layers = [module for module in engine.module.modules() if isinstance(module, MoKMoE)]
    if not layers or not hasattr(engine, "_take_model_step"):
        return  # (another DeepSpeed: the layers remake their copies in every forward, as before)

    def weights_changed() -> None:
        for layer in layers:
            layer.is_first_microbatch = True

    def after(method_name: str) -> None:
        method = getattr(engine, method_name)

        @functools.wraps(method)
        def then_mark(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            weights_changed()
            return result

        setattr(engine, method_name, then_mark)

    after("_take_model_step")
    after("load_checkpoint")
    weights_changed()  # the first forward makes the copies
