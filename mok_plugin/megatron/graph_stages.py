"""Megatron's partial CUDA graphs of the MoE layer (--cuda-graph-modules moe_router [moe_preprocess]) for
MoKMoELayer: the start of the layer in a CUDA graph, the rest eager, resumed from the graph's outputs.

How Megatron-Core 0.19 runs them (transformer_layer.py, moe/moe_utils.py):
  - transformer_engine: `TransformerLayer._te_cuda_graph_capture` captures the layer's forward while
    `is_graph_capturing()`; the MoE layer returns early with its intermediate tensors as the graph's
    outputs ([hidden_states, probs, routing_map]; with moe_preprocess [hidden_states, probs, *the
    dispatcher's `valid_cudagraph_attrs`]; then the shared experts' output when they are not
    overlapped). At replay `_te_cuda_graph_replay_impl` puts them in `mlp.cudagraph_tensor_store`
    (and the dispatcher's attributes) and calls the layer again, which resumes from them; with
    --overlap-moe-expert-parallel-comm it calls `mlp.route` and `mlp.preprocess` instead and the
    schedule runs the rest stage by stage.
  - local (MoETransformerLayer with partial graphs): the layer is called once per stage, with
    `fwd_execution_map` "route" (graphed; -> hidden_states, probs, shared experts' output, and the
    dispatcher's tensor attributes named in `cudagraph_attrs` as graph outputs), "expert_compute"
    (eager; intermediate_tensors (hidden_states, probs) -> (output, None)) and "postprocess"
    (graphed; (output, shared experts' output) -> output).

MoK's part inside the graph is what reads nothing on the host: its routing (router GEMM, top-k, the
losses attached to the routing weights and logged, the expert-bias and global-aux counts, the
force-balancing draw, whose step is a device counter) and the shared experts when not overlapped.
MoK has no dispatcher preprocessing apart from that: its schedule, exchange and experts run
eagerly after the graph (with moe_preprocess too), so the exact EP exchange's host reads stay
outside. Across the boundary: hidden_states (the MoE input x), probs (the routing weights [T, K],
the losses attached), the experts chosen (topk_ids [T, K]: `routing_map`, or the stand-in
dispatcher's `topk_ids` attribute with moe_preprocess / local graphs) and the shared experts'
output. The same MoK operations run in the same order as in the whole-layer forward, so the results
are bitwise those of the layer called whole (tests/test_megatron_graph_stages.py).
"""

from __future__ import annotations

import types

import torch

from mok_plugin.layer import MoKForwardStep
from mok_plugin.routing import MoKRouting, count_per_expert

_WHOLE_LAYER = ("route", "expert_compute", "postprocess")


class DispatcherStandIn:
    """What Megatron reads of a token dispatcher around MoKMoELayer, which has none (its exchange
    replaces it): the EP-overlap schedule's flex-dispatcher hooks (`_comm_manager.token_probs`,
    `.dispatched_probs`, `.get_number_of_tokens_per_expert()`) and the partial CUDA graphs' tensor
    attributes (`cudagraph_attrs` for local graphs, `valid_cudagraph_attrs` for TE's), which carry
    the experts chosen across the graph's boundary."""

    cudagraph_attrs = ["topk_ids"]

    def __init__(self) -> None:
        self._comm_manager = types.SimpleNamespace(get_number_of_tokens_per_expert=lambda: None)
        self.valid_cudagraph_attrs = list(self.cudagraph_attrs)
        self.topk_ids: torch.Tensor | None = None


class PartialGraphStages:
    """MoKMoELayer's side of Megatron's partial MoE CUDA graphs (mixed into MoKMoELayer; see the
    module docstring). `graph_stage_output` answers a call of the layer made by those graphs."""

    def graph_stage_output(self, hidden_states, intermediate_tensors, padding_mask):
        """This call's output when Megatron runs the layer through partial CUDA graphs (a stage, a
        capture or a resume); None when it calls the layer whole."""
        stage = self.fwd_execution_map
        if isinstance(stage, str):  # local graphs: one stage a call
            if stage == "route":
                return self._route_stage(hidden_states, padding_mask)
            if stage == "expert_compute":
                return self._expert_compute_stage(*intermediate_tensors)
            if stage == "postprocess":
                output, shared_out = intermediate_tensors
                if shared_out is None:
                    return output
                return self.mok.add_shared(output.reshape(shared_out.shape), shared_out).view(output.shape)
            raise ValueError(f"MoKMoELayer: unknown fwd_execution_map {stage!r} (Megatron 0.19 has {_WHOLE_LAYER})")
        if tuple(stage) != _WHOLE_LAYER:
            raise ValueError(f"MoKMoELayer runs fwd_execution_map as one stage or all three, not {stage!r}")
        if intermediate_tensors is not None:
            raise NotImplementedError("MoKMoELayer: intermediate_tensors come with one stage of fwd_execution_map")
        if self._te_capturing():
            x, probs, shared_out = self._route_stage(hidden_states, padding_mask)
            return [x, probs, self.token_dispatcher.topk_ids] + ([] if shared_out is None else [shared_out])
        if not self.cudagraph_tensor_store.is_empty():  # TE's replay resumes the layer
            store = self.cudagraph_tensor_store
            step = self._resumed_step(hidden_states, store.probs, store.shared_expert_output)
            with self._expert_weights_into_main_grad():
                routed = self.mok.run_routed_experts(step)
            output, _ = self.mok.finish(step, routed, step.shared_out)
            return output, None
        return None

    def _te_capturing(self) -> bool:
        # As Megatron's maybe_skip_or_early_return_by_cudagraph decides to return early.
        from megatron.core.transformer.cuda_graphs import is_graph_capturing

        return self.config.cuda_graph_impl == "transformer_engine" and self.training and is_graph_capturing()

    def _shared_in_graph(self) -> bool:
        """The shared experts run inside the graph unless overlapped (as Megatron's stock layer)."""
        return self.mok.shared_experts is not None and not self.mok_config.shared_expert_overlap

    def _route_stage(self, x: torch.Tensor, padding_mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(x, routing weights, shared experts' output or None): the graphed part. The experts
        chosen go to the stand-in dispatcher's `topk_ids`. Nothing here reads the host or the
        host's per-forward state (`MoKMoE.prepare_forward` runs in the eager part, every forward)."""
        self._check_forward(x)
        self.mok.check_input(x)
        padding = self._padding_of(x, padding_mask)
        routing = self.mok.route_step(x, x.shape[1], self._loss_attacher(x, padding), padding)
        self._count_and_log(routing.losses, routing.counted_tokens_per_expert)
        self.token_dispatcher.topk_ids = routing.topk_ids
        shared_out = self.mok.start_shared_experts(x) if self._shared_in_graph() else None
        return x, routing.topk_weights, shared_out

    def _resumed_step(self, x: torch.Tensor, probs: torch.Tensor, shared_out: torch.Tensor | None) -> MoKForwardStep:
        """The forward's step from the graph's outputs; overlapped shared experts are issued here,
        after the routing and before the routed experts, as in the whole-layer forward."""
        self._check_forward(x)
        self._defer_weight_grads_as_configured()
        store = self.cudagraph_tensor_store
        topk_ids = store.routing_map if store.routing_map is not None else self.token_dispatcher.topk_ids
        if topk_ids is None:
            raise RuntimeError("MoKMoELayer: resumed after a partial CUDA graph that did not give the experts chosen")
        mok = self.mok
        # The losses rode into the graph's backward on the weights; aux_loss is not returned by this layer.
        routing = MoKRouting(topk_ids, probs, torch.zeros((), device=probs.device),
                             count_per_expert(topk_ids, mok.config.num_experts), mok.last_router_losses)  # fmt: skip
        if shared_out is None and mok.shared_experts is not None and not self._shared_in_graph():
            shared_out = mok.start_shared_experts(x)
        return mok.resume(x, routing, shared_out)

    def _expert_compute_stage(self, x: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        """Local graphs' eager stage: the routed experts' output shaped like x (plus the overlapped
        shared experts', taken back here: the graphed postprocess cannot wait on a stream it did not
        capture)."""
        step = self._resumed_step(x, probs, None)
        with self._expert_weights_into_main_grad():
            routed = self.mok.run_routed_experts(step)
        output, _ = self.mok.finish(step, routed, None if self._shared_in_graph() else step.shared_out)
        return output, None

    def _resume_overlap_step(self, hidden_states: torch.Tensor) -> None:
        """Under the EP overlap, TE's replay calls `route` without `shared_experts_compute`: the step
        starts from the graph's outputs."""
        store = self.cudagraph_tensor_store
        if self._overlap_step is None and not store.is_empty():
            self._overlap_step = self._resumed_step(hidden_states, store.probs, store.shared_expert_output)
