"""Pipeline parallelism 2 in MoKMoELayer, on the CPU over gloo (two processes, one stage each).

A 4-layer GPT (every layer MoE: Megatron's local layer spec, SequentialMLP experts, the allgather
dispatcher, fp32, aux loss and z-loss on) is split over two pipeline stages, layers 1-2 and 3-4;
the MoK model is the same spec with its MoE layers swapped by `use_mok`, loaded from the stock
model's state_dict on each stage. The stages run by hand, two micro-batches: stage 0's hidden
states go to stage 1 with dist.send / recv, the gradient of stage 1's summed token losses comes
back the same way (Megatron's pipeline schedules assume CUDA). Against stock, per stage:
  - stage 0's hidden states and stage 1's per-token losses;
  - the gradient of the hidden states crossing the stage boundary, and every parameter's
    gradient (word and position embeddings, attention, norms, router, experts, output layer);
  - the router losses Megatron's MoE metrics tracker logs: each stage writes its own layers'
    slots of the [num_layers] tensor (layer number - 1, the global number), no others; summed
    over the pipeline group (the tracker's first reduction) every layer has its value;
  - the MoE layers' layer numbers are the global ones (3 and 4 on stage 1), as stock's are, and
    so is MoK's random-stream layer number."""

import contextlib

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e .[megatron])")

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.moe import moe_logging  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from test_megatron import E, H, _config, _init  # noqa: E402

from mok_plugin.compare.stock_cpu import make_stock_router_cpu_safe  # noqa: E402
from mok_plugin.megatron import MoKMoELayer, use_mok  # noqa: E402
from mok_plugin.megatron.checkpoint import _to_stock as to_stock  # noqa: E402
from mok_plugin.testing import assert_close, run_ranks  # noqa: E402

pytestmark = pytest.mark.megatron

LAYERS, PP = 4, 2
S, B, VOCAB = 8, 2, 64  # [B, S] token micro-batches; hidden states [S, B, H]
MICRO_BATCHES = 2  # gradients and logged losses accumulate over them, as in one training step
# Causal, passed explicitly: Megatron's default causal mask is made on CUDA (True: masked out).
CAUSAL = torch.ones(S, S, dtype=torch.bool).triu(diagonal=1).view(1, 1, S, S)
LOSSES = dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3)


def _gpt(spec, rank: int) -> GPTModel:
    cfg = _config(num_layers=LAYERS, pipeline_model_parallel_size=PP, pipeline_dtype=torch.float32,
                  hidden_dropout=0.0, attention_dropout=0.0, **LOSSES)  # fmt: skip
    # Untied output layer: a tied one would need Megatron's embedding-group all-reduce across stages.
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=S,
                    pre_process=rank == 0, post_process=rank == PP - 1,
                    share_embeddings_and_output_weights=False)  # fmt: skip


def _spec():
    return get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)


def _micro_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, position_ids, labels) [B, S], the same on both stages."""
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(VOCAB, (B, S), generator=generator)
    labels = torch.randint(VOCAB, (B, S), generator=generator)
    return tokens, torch.arange(S).expand(B, S), labels


def _stock_grads(model: GPTModel) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under the stock names (a MoK layer's in its stock layout)."""
    grads = {name: p.grad for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        if isinstance(module, MoKMoELayer):
            to_stock(module, grads, name + ".", None)
    return {name: g.clone() for name, g in grads.items() if g is not None}


def _run_stage(model: GPTModel, rank: int) -> dict:
    """MICRO_BATCHES forward + backward passes through this rank's stage, its neighbour running the
    other; returns what the test compares."""
    moe_logging.destroy_moe_metrics_tracker()
    outs, d_hidden = [], []
    for step in range(MICRO_BATCHES):
        tokens, positions, labels = _micro_batch(step)
        if rank == 0:
            hidden = model(tokens, positions, CAUSAL)  # [S, B, H]
            dist.send(hidden.detach().contiguous(), 1)
            grad = torch.empty_like(hidden)
            dist.recv(grad, 1)
            hidden.backward(grad)
            outs.append(hidden.detach())
            d_hidden.append(grad)
        else:
            hidden = torch.empty(S, B, H)
            dist.recv(hidden, 0)
            hidden.requires_grad_()
            model.set_input_tensor(hidden)
            token_losses = model(None, None, CAUSAL, labels=labels)  # [B, S]
            token_losses.sum().backward()
            dist.send(hidden.grad.contiguous(), 0)
            outs.append(token_losses.detach())
            d_hidden.append(hidden.grad)
    logged = {name: entry.values.clone() for name, entry in moe_logging.get_moe_metrics_tracker().metrics.items()}
    whole = {}  # the tracker's first reduction in report(): a sum over the pipeline group
    for name in sorted(logged):
        whole[name] = logged[name].clone()
        dist.all_reduce(whole[name], group=parallel_state.get_pipeline_model_parallel_group())
    moe_layers = [layer.mlp for layer in model.decoder.layers]
    return {
        "outs": outs, "d_hidden": d_hidden, "grads": _stock_grads(model), "logged": logged, "whole": whole,
        "transformer_layer_numbers": [layer.layer_number for layer in model.decoder.layers],
        "moe_layer_numbers": [mlp.layer_number for mlp in moe_layers],
        "moe_classes": [type(mlp).__name__ for mlp in moe_layers],
        "random_stream_layers": [mlp.mok.random_stream_layer for mlp in moe_layers if isinstance(mlp, MoKMoELayer)],
    }  # fmt: skip


def _pipeline_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _init(rank, world, port)
    parallel_state.destroy_model_parallel()
    torch.cuda.current_device = lambda: "cpu"  # the stock router's buffers (test_megatron_routing.cpu_buffers)
    # Attention forks Megatron's CUDA RNG state around its dropout; dropout is off here (nothing drawn).
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=PP)
        assert parallel_state.get_pipeline_model_parallel_rank() == rank
        torch.manual_seed(rank)
        stock = _gpt(_spec(), rank)
        for module in stock.modules():
            if type(module) is MoELayer:
                make_stock_router_cpu_safe(module)
        mok = _gpt(use_mok(_spec()), rank)
        mok.load_state_dict(stock.state_dict())  # MoK's state_dict speaks the stock keys
        results = {"stock": _run_stage(stock, rank), "mok": _run_stage(mok, rank)}
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_pipeline_parallel_matches_stock(tmp_path):
    run_ranks(_pipeline_worker, PP, args=(str(tmp_path),), timeout_s=300)
    per_stage = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(PP)]
    per_stage_layers = LAYERS // PP
    for rank, result in enumerate(per_stage):
        want, got = result["stock"], result["mok"]
        where = f"stage {rank}"
        mine = list(range(rank * per_stage_layers + 1, (rank + 1) * per_stage_layers + 1))  # global, 1-based
        assert want["moe_classes"] == ["MoELayer"] * per_stage_layers, where
        assert got["moe_classes"] == ["MoKMoELayer"] * per_stage_layers, where
        # Layer numbers: the global ones on every stage (TransformerLayer adds the stage's offset
        # and passes it on with set_layer_number), for stock and MoK alike.
        assert want["transformer_layer_numbers"] == got["transformer_layer_numbers"] == mine, where
        assert want["moe_layer_numbers"] == got["moe_layer_numbers"] == mine, where
        assert got["random_stream_layers"] == mine, where
        for step in range(MICRO_BATCHES):
            what = "hidden states" if rank == 0 else "per-token losses"
            assert_close(got["outs"][step], want["outs"][step], torch.float32, f"{where}: {what}, micro-batch {step}")
            assert_close(got["d_hidden"][step], want["d_hidden"][step], torch.float32,
                         f"{where}: boundary hidden-state gradient, micro-batch {step}")  # fmt: skip
        assert set(got["grads"]) == set(want["grads"]), where
        assert any("word_embeddings" in n for n in want["grads"]) == (rank == 0), where
        assert any("output_layer" in n for n in want["grads"]) == (rank == PP - 1), where
        for name, grad in want["grads"].items():
            assert_close(got["grads"][name], grad, torch.float32, f"{where}: gradient of {name}")
        assert set(got["logged"]) == set(want["logged"]) == {"load_balancing_loss", "z_loss"}, where
        for name, values in want["logged"].items():
            assert values.shape == (LAYERS,), f"{where}: logged {name}"
            # Each stage writes its own layers' slots only (the global layer number's).
            written = [i + 1 for i in values.nonzero().flatten().tolist()]
            assert written == mine, f"{where}: logged {name} written at layers {written}"
            assert [i + 1 for i in got["logged"][name].nonzero().flatten().tolist()] == mine, f"{where}: {name}"
            assert_close(got["logged"][name], values, torch.float32, f"{where}: logged {name}")
            whole = want["whole"][name]
            assert bool((whole != 0).all()), f"{where}: {name} summed over the pipeline"
            assert_close(got["whole"][name], whole, torch.float32, f"{where}: {name} summed over the pipeline")
