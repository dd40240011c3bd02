"""Megatron options around the MoE layer, on the CPU, against the stock MoELayer where it runs there:

- --moe-shared-expert-gate: outputs and every gradient (the gate weight's too) against stock;
  checkpoints under the stock keys both ways (state_dict, sharded_state_dict);
- --moe-shared-expert-overlap: the shared experts on a side stream (in sequence on the CPU, through
  the same autograd nodes): outputs and gradients bitwise those without;
- --recompute-modules moe / shared_experts: gradients bitwise those without recompute, the forward
  run again in the backward, the expert-bias counts and the aux loss taken once, fewer saved bytes
  (measured with saved-tensor hooks and printed); moe_act: no activation-sized tensor is saved;
- --moe-router-enable-expert-bias: the same checkpoint keys as stock, strict loads both ways, and
  the counts taken when gradients are on, as TopKRouter takes them;
- --moe-router-padding-for-quantization: accepted (a padding of zero-weight rows);
- CUDA graphs: the partial MoE capture (moe_router / moe_preprocess) and captures that MoK would
  break with a host read are refused at build time, naming the flag.
"""

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e .[megatron])")

from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec  # noqa: E402
from test_megatron import (  # noqa: E402, F401
    E,
    H,
    _config,
    _fwd_bwd,
    _stock_and_mok,
    assert_same_sharded_layout,
    megatron_world,
)

from mok_plugin.compare.stock_cpu import make_stock_router_cpu_safe  # noqa: E402
from mok_plugin.config import MoKConfigError  # noqa: E402
from mok_plugin.megatron import MoKMoELayer, mok_config_from_megatron, use_mok  # noqa: E402
from mok_plugin.testing import assert_close, make_layer_inputs  # noqa: E402

pytestmark = pytest.mark.megatron

SHARED = dict(moe_shared_expert_intermediate_size=24)
GATED = dict(SHARED, moe_shared_expert_gate=True)
NO_AUX = dict(moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
EXPERT_BIAS = dict(NO_AUX, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)


def _spec():
    return get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)


def _mok(cfg, like: MoKMoELayer | None = None) -> MoKMoELayer:
    """A MoK layer of `cfg`, holding `like`'s weights when given."""
    layer = use_mok(_spec())(config=cfg)
    if like is not None:
        layer.load_state_dict(like.state_dict())
    return layer


def _inputs(T: int = 24):
    x = make_layer_inputs(T, H, seed=1).view(T // 2, 2, H)
    probe = make_layer_inputs(T, H, seed=2).view(T // 2, 2, H)
    return x, probe


def _assert_bitwise(got, want) -> None:
    """Two _fwd_bwd results hold the same bits: output, d_x, every gradient."""
    assert torch.equal(got[0], want[0]), "output"
    assert torch.equal(got[1], want[1]), "d_x"
    assert set(got[2]) == set(want[2])
    for name in want[2]:
        assert torch.equal(got[2][name], want[2][name]), f"grad of {name}"


# --- --moe-shared-expert-gate ----------------------------------------------------------------------


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("fields", [GATED, dict(GATED, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                                                 gated_linear_unit=False, activation_func=torch.nn.functional.gelu,
                                                 bias_activation_fusion=False)],
                         ids=["swiglu", "gelu_mlp"])  # fmt: skip
def test_shared_expert_gate_matches_stock(fields):
    stock, mok = _stock_and_mok(_config(**fields))
    assert mok.mok.shared_experts.gate_weight.shape == (1, H)
    x, probe = _inputs()
    want, got = _fwd_bwd(stock, x, probe), _fwd_bwd(mok, x, probe)
    assert_close(got[0], want[0], torch.float32, "output")
    assert_close(got[1], want[1], torch.float32, "d_x")
    assert set(got[2]) == set(want[2]) and "shared_experts.gate_weight" in want[2]
    for name in want[2]:
        assert_close(got[2][name], want[2][name], torch.float32, f"grad of {name}", n_reduce=24)


@pytest.mark.usefixtures("megatron_world")
def test_shared_expert_gate_checkpoints_use_the_stock_keys():
    cfg = _config(**GATED)
    stock, mok = _stock_and_mok(cfg)
    assert set(mok.state_dict()) == set(stock.state_dict())
    assert torch.equal(mok.mok.shared_experts.gate_weight, stock.shared_experts.gate_weight)
    fresh = _spec()(config=cfg)
    fresh.load_state_dict(mok.state_dict())  # strict: MoK -> stock
    assert torch.equal(fresh.shared_experts.gate_weight, stock.shared_experts.gate_weight)
    assert_same_sharded_layout(stock, mok)
    # Megatron's optimizer maps its states to the sharded tensors by parameter identity.
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    params = list(mok.parameters())
    assert len(get_param_id_to_sharded_param_map(mok.sharded_state_dict("mlp."), params)) == len(params)


def test_shared_expert_switches_need_shared_experts():
    from mok_plugin.config import MoKConfig

    for name in ("shared_expert_gate", "shared_expert_overlap", "shared_expert_recompute"):
        with pytest.raises(MoKConfigError, match=rf"mok\.{name}=True needs shared experts"):
            MoKConfig(hidden_size=H, ffn_hidden_size=16, num_experts=E, top_k=2, **{name: True})


# --- --moe-shared-expert-overlap ------------------------------------------------------------------


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("fields", [SHARED, GATED], ids=["plain", "gated"])
def test_shared_expert_overlap_is_bitwise_the_same(fields):
    # Megatron takes the overlap with the alltoall or flex dispatcher only; MoK replaces both.
    base = _mok(_config(**fields, moe_token_dispatcher_type="alltoall"))
    overlapped = _mok(_config(**fields, moe_token_dispatcher_type="alltoall", moe_shared_expert_overlap=True), base)
    assert overlapped.mok_config.shared_expert_overlap and not base.mok_config.shared_expert_overlap
    x, probe = _inputs()
    # On the CPU the overlap runs in sequence but through the same fork/join autograd nodes as on CUDA.
    _assert_bitwise(_fwd_bwd(overlapped, x, probe), _fwd_bwd(base, x, probe))


class _FakeStream:
    """Stands for a CUDA stream on the CPU: records the waits between the two streams."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other) -> None:
        self.log.append(f"{self.name} waits for {other.name}")


def test_shared_expert_overlap_stream_protocol(monkeypatch):
    # What the CUDA path does, seen on the CPU with stand-in streams: the side stream starts after
    # the current one has x, the routed experts are issued while the shared experts run on the side
    # stream, and the current stream waits for the side one before using the result; in the
    # backward, the side stream waits for d_out and the current one for the shared experts' d_x.
    import contextlib

    import mok_plugin.layer as layer_module
    from mok_plugin import MoKConfig, MoKMoE

    log: list[str] = []
    side, current = _FakeStream("side", log), _FakeStream("current", log)

    @contextlib.contextmanager
    def on(stream):
        log.append(f"enter {stream.name}")
        yield
        log.append(f"leave {stream.name}")

    monkeypatch.setattr(layer_module, "_side_stream", lambda device: side)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: log.append(f"record {stream.name}"))
    config = MoKConfig(hidden_size=H, ffn_hidden_size=16, num_experts=E, top_k=2, num_shared_experts=1,
                       shared_expert_gate=True, shared_expert_overlap=True, backend="reference")  # fmt: skip
    layer = MoKMoE(config, seed=0)
    routed = layer._experts_fn
    layer._experts_fn = lambda *a, **k: log.append("routed experts") or routed(*a, **k)
    x = make_layer_inputs(12, H, seed=1).requires_grad_()
    out, _ = layer(x)
    assert log == ["side waits for current", "record side", "enter side", "leave side", "routed experts",
                   "current waits for side", "record current"]  # fmt: skip
    log.clear()
    out.sum().backward()
    assert log == ["side waits for current", "record side", "current waits for side", "record current"]


# --- recompute --------------------------------------------------------------------------------------


def _recompute(*modules: str) -> dict:
    return dict(recompute_granularity="selective", recompute_modules=list(modules))


def _count_forwards(layer: MoKMoELayer) -> list:
    calls = []
    layer.mok.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize(
    "fields",
    [
        dict(GATED),
        dict(EXPERT_BIAS, **SHARED),
        dict(SHARED, gradient_accumulation_fusion=True),
        # the stock layer takes this loss in its recomputation, from the counts of the micro-batches
        # before it (its no-grad forward counts nothing): the same counts as at MoK's forward
        dict(moe_router_load_balancing_type=["aux_loss", "global_aux_loss"], moe_aux_loss_coeff=[0.01, 0.02]),
    ],
    ids=["aux_loss_gated", "expert_bias", "main_grad", "global_aux_loss"],
)
def test_moe_recompute_gives_the_same_gradients(fields):
    base = _mok(_config(**fields))
    recomputed = _mok(_config(**fields, **_recompute("moe")), base)
    assert recomputed.moe_layer_recompute and not base.moe_layer_recompute
    main_grad = fields.get("gradient_accumulation_fusion", False)
    for layer in (base, recomputed):
        layer.train()
        if main_grad:
            for p in layer.mok.experts.parameters():
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    calls = _count_forwards(recomputed)
    x, probe = _inputs()
    want, got = _fwd_bwd(base, x, probe), _fwd_bwd(recomputed, x, probe)
    assert len(calls) == 2, "the backward runs the MoE forward again"
    _assert_bitwise(got, want)
    if main_grad:
        for a, b in zip(base.mok.experts.parameters(), recomputed.mok.experts.parameters(), strict=True):
            assert torch.equal(a.main_grad, b.main_grad)
    if recomputed.mok_config.expert_bias:
        # Counted once (in the forward), not again in the recomputation.
        assert torch.equal(recomputed.mok.local_tokens_per_expert, base.mok.local_tokens_per_expert)
        assert recomputed.mok.local_tokens_per_expert.sum() == x.shape[0] * x.shape[1] * 2
    # The recomputation puts back the state it found: per-step statistics, running counts.
    for (name, a), (_, b) in zip(base.mok.named_buffers(), recomputed.mok.named_buffers(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.usefixtures("megatron_world")
def test_moe_recompute_with_a_padding_mask_gives_the_same_gradients():
    # The mask goes through the checkpoint with the input: the recomputation leaves the same
    # tokens out of the losses, and the expert-bias counts (taken once) leave them out too.
    fields = dict(EXPERT_BIAS, moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
                  moe_aux_loss_coeff=[0.01, 0.02, 0.005], moe_z_loss_coeff=1e-3)  # fmt: skip
    base = _mok(_config(**fields))
    recomputed = _mok(_config(**fields, **_recompute("moe")), base)
    for layer in (base, recomputed):
        layer.train()
    x, probe = _inputs()
    padding_mask = torch.rand(x.shape[1], x.shape[0], generator=torch.Generator().manual_seed(3)) < 0.4  # [B, S]
    want = _fwd_bwd(base, x, probe, padding_mask=padding_mask)
    got = _fwd_bwd(recomputed, x, probe, padding_mask=padding_mask)
    _assert_bitwise(got, want)
    counts = recomputed.mok.local_tokens_per_expert
    assert torch.equal(counts, base.mok.local_tokens_per_expert)
    assert counts.sum() == int((~padding_mask).sum()) * recomputed.config.moe_router_topk


@pytest.mark.usefixtures("megatron_world")
def test_moe_recompute_logs_the_losses_once(monkeypatch):
    # The losses ride on the routing weights, inside the recomputed region: the recomputation
    # attaches them again to a graph the backward does not use (so their gradient counts once:
    # test_moe_recompute_gives_the_same_gradients), but the tracker records them once.
    layer = _mok(_config(**_recompute("moe")))
    logged = []
    original = layer._log_router_losses
    monkeypatch.setattr(layer, "_log_router_losses", lambda *a: logged.append(1) or original(*a))
    x, probe = _inputs()
    _fwd_bwd(layer, x, probe)
    assert logged == [1]  # in the forward only, not again in the recomputation


@pytest.mark.usefixtures("megatron_world")
def test_moe_recompute_off_in_eval_and_under_local_cuda_graphs():
    layer = _mok(_config(**_recompute("moe")))
    calls = _count_forwards(layer)
    layer.eval()
    x, probe = _inputs()
    _fwd_bwd(layer, x, probe)
    assert len(calls) == 1  # MoELayer recomputes only while training
    # With --cuda-graph-impl local the stock MoELayer leaves recompute to the transformer layer's
    # partial graphs (refused by MoK); the whole-layer capture recomputes nothing there either.
    graphed = _config(**_recompute("moe"), cuda_graph_impl="local", hidden_dropout=0.0)  # Megatron asks for no dropout
    assert not _mok(graphed).moe_layer_recompute


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("fields", [SHARED, GATED], ids=["plain", "gated"])
def test_shared_experts_recompute_gives_the_same_gradients(fields):
    base = _mok(_config(**fields))
    recomputed = _mok(_config(**fields, **_recompute("shared_experts")), base)
    assert recomputed.mok_config.shared_expert_recompute and recomputed.mok.shared_experts.recompute
    x, probe = _inputs()
    _assert_bitwise(_fwd_bwd(recomputed, x, probe), _fwd_bwd(base, x, probe))


def saved_tensor_bytes(layer: MoKMoELayer, x: torch.Tensor) -> tuple[int, list[tuple[int, ...]]]:
    """Bytes of the distinct storages autograd keeps for the backward of one forward of `layer`
    (parameters excluded: they are held anyway), and the shapes of the saved tensors. A
    non-reentrant checkpoint keeps nothing of its own region (only its input, which the caller
    holds either way)."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages: dict[int, int] = {}
    shapes = []

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
            shapes.append(tuple(t.shape))
        return t

    x = x.detach().clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = layer(x)
    del out
    return sum(storages.values()), shapes


def measure_moe_recompute_saving(T: int = 256, **fields) -> dict[str, int]:
    """Saved-tensor bytes of one MoE layer forward (the test config with a gated shared expert, or
    `fields` over it; T tokens) without and with --recompute-modules moe, and the input's bytes."""
    fields = {**GATED, **fields}
    base = _mok(_config(**fields))
    recomputed = _mok(_config(**fields, **_recompute("moe")), base)
    hidden = base.config.hidden_size
    x = make_layer_inputs(T, hidden, seed=1).view(T // 2, 2, hidden)
    without, _ = saved_tensor_bytes(base, x)
    with_recompute, _ = saved_tensor_bytes(recomputed, x)
    return {"without": without, "with": with_recompute, "input": x.numel() * x.element_size()}


@pytest.mark.usefixtures("megatron_world")
def test_moe_recompute_saves_memory():
    sizes = measure_moe_recompute_saving()
    print(f"\nsaved-tensor bytes of one MoE layer forward (T=256, H={H}): without recompute {sizes['without']}, "
          f"with --recompute-modules moe {sizes['with']} (the input, {sizes['input']}, which the checkpoint keeps "
          "for the recomputation, and the aux loss)")  # fmt: skip
    assert sizes["with"] < sizes["without"] / 4


@pytest.mark.usefixtures("megatron_world")
def test_moe_act_is_mok_default_no_activation_is_saved():
    # Stock needs --moe-grouped-gemm for moe_act; MoK replaces the grouped GEMM and always saves
    # only the pre-activation h [R, 2I] of its routed experts, recomputing A [R, I] in the backward.
    I = 16
    cfg = _config(**NO_AUX, **_recompute("moe_act"), moe_grouped_gemm=True, moe_ffn_hidden_size=I)
    layer = _mok(cfg)
    T, K = 24, cfg.moe_router_topk
    _, shapes = saved_tensor_bytes(layer, make_layer_inputs(T, H, seed=1).view(T // 2, 2, H))
    # h [R_pad, 2I]: the routed rows, each expert's segment padded to the row tile.
    assert [s for s in shapes if len(s) == 2 and s[0] >= T * K and s[1] == 2 * I], f"h is not saved: {shapes}"
    assert not [s for s in shapes if len(s) == 2 and s[-1] == I], f"an activation-sized tensor is saved: {shapes}"


# --- expert bias: checkpoint keys and counts -------------------------------------------------------


@pytest.fixture()
def stock_buffers_on_cpu(monkeypatch):
    # TopKRouter creates its expert-bias buffers on torch.cuda.current_device().
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


@pytest.mark.usefixtures("megatron_world")
def test_expert_bias_checkpoints_match_stock_both_ways(stock_buffers_on_cpu):
    cfg = _config(**EXPERT_BIAS)
    stock = _spec()(config=cfg)
    make_stock_router_cpu_safe(stock)
    with torch.no_grad():
        stock.router.expert_bias.normal_()
    mok = _mok(cfg)
    assert set(mok.state_dict()) == set(stock.state_dict())
    mok.load_state_dict(stock.state_dict())  # strict: stock -> MoK
    assert torch.equal(mok.mok.expert_bias, stock.router.expert_bias)
    fresh = _spec()(config=cfg)
    fresh.load_state_dict(mok.state_dict())  # strict: MoK -> stock
    assert torch.equal(fresh.router.expert_bias, stock.router.expert_bias)
    assert_same_sharded_layout(stock, mok)
    # A checkpoint written before the counts were non-persistent still loads strictly.
    mok.load_state_dict({**stock.state_dict(), "router.local_tokens_per_expert": torch.ones(E)})


@pytest.mark.usefixtures("megatron_world")
def test_expert_bias_counts_when_gradients_are_on():
    layer = _mok(_config(**EXPERT_BIAS))
    x, _ = _inputs()
    layer.train()
    with torch.no_grad():
        layer(x)
    assert layer.mok.local_tokens_per_expert.sum() == 0  # as TopKRouter: not without gradients
    layer.eval()
    layer(x)
    assert layer.mok.local_tokens_per_expert.sum() == x.shape[0] * x.shape[1] * 2  # with them, in any mode


@pytest.mark.usefixtures("megatron_world")
def test_expert_bias_stays_fp32_under_float16_module():
    # Float16Module casts the model with .bfloat16(); TopKRouter keeps its bias in fp32.
    layer = _mok(_config(**EXPERT_BIAS)).bfloat16()
    assert layer.mok.router.weight.dtype == torch.bfloat16
    assert layer.mok.expert_bias.dtype == layer.mok.local_tokens_per_expert.dtype == torch.float32
    x, _ = _inputs()
    layer(x.bfloat16())
    assert layer.mok.local_tokens_per_expert.sum() == x.shape[0] * x.shape[1] * 2


# --- options accepted or refused at build time ----------------------------------------------------


def test_router_padding_for_quantization_is_accepted():
    # Megatron's config takes the flag only with fp8/fp4 (refused by MoK, and not constructible
    # without Transformer Engine): set after validation to see its own verdict.
    cfg = _config()
    cfg.moe_router_padding_for_quantization = cfg.moe_router_padding_for_fp8 = True
    assert mok_config_from_megatron(cfg) == mok_config_from_megatron(_config())


def test_shared_expert_options_map():
    overlap = dict(moe_token_dispatcher_type="alltoall", moe_shared_expert_overlap=True)
    cfg = mok_config_from_megatron(_config(**GATED, **overlap))
    assert (cfg.shared_expert_gate, cfg.shared_expert_overlap, cfg.shared_expert_recompute) == (True, True, False)
    # (Megatron refuses shared_experts recompute with the overlap.)
    assert mok_config_from_megatron(_config(**SHARED, **_recompute("shared_experts"))).shared_expert_recompute
    # Without a shared expert Megatron ignores the gate; so does the mapping.
    assert not mok_config_from_megatron(_config(moe_shared_expert_gate=True)).shared_expert_gate
    with pytest.raises(MoKConfigError, match=r"mok\.shared_expert_gate=False conflicts.*--moe-shared-expert-gate"):
        mok_config_from_megatron(_config(**GATED), {"shared_expert_gate": False})


REFUSED_GRAPHS = {
    # The partial MoE scopes' own refusals: tests/test_megatron_graph_stages.py.
    "te_moe_router_preprocess_debug": (
        dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=["moe_router", "moe_preprocess"]),
        r"--cuda-graph-modules moe_preprocess moe_router with --cuda-graph-impl transformer_engine.*debug checks",
        {"debug_checks": True},
    ),
    # The deprecated --cuda-graph-scope, migrated by TransformerConfig to cuda_graph_modules.
    "local_scope_moe_router_debug": (
        dict(cuda_graph_impl="local", cuda_graph_scope=["moe_router"]),
        r"--cuda-graph-modules moe_preprocess moe_router with --cuda-graph-impl local.*debug checks",
        {"debug_checks": True},
    ),
    # A whole-layer capture with the exact EP exchange, which reads counts on the host.
    "local_layer_ep_exact": (
        dict(cuda_graph_impl="local", expert_model_parallel_size=2),
        r"--cuda-graph-impl \(local, capturing the MoE layer\).*exact expert-parallel exchange",
        None,
    ),
    "full_iteration_reference_backend": (
        dict(cuda_graph_impl="full_iteration"),
        r"--cuda-graph-impl \(full_iteration.*reference backend",
        {"backend": "reference"},
    ),
}


@pytest.mark.parametrize("case", list(REFUSED_GRAPHS))
def test_cuda_graph_settings_refused_by_name(case):
    fields, match, overrides = REFUSED_GRAPHS[case]
    with pytest.raises(MoKConfigError, match=match):
        mok_config_from_megatron(_config(**fields), overrides)


@pytest.mark.parametrize(
    "fields, overrides",
    [
        (dict(cuda_graph_impl="local"), None),  # the whole layer, EP 1
        (dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=["attn"]), None),  # the MoE layer eager
        (dict(cuda_graph_impl="local", expert_model_parallel_size=2), {"ep_exchange": "capacity"}),
        (dict(cuda_graph_impl="full_iteration"), None),
        (dict(cuda_graph_impl="transformer_engine", cuda_graph_modules=["moe_router", "moe_preprocess"]), None),
        (dict(cuda_graph_impl="local", cuda_graph_scope=["moe_router"], expert_model_parallel_size=2), None),
    ],
    ids=["local_layer", "te_attn_only", "local_ep_capacity", "full_iteration", "te_partial", "local_partial_ep_exact"],
)
def test_cuda_graph_settings_accepted(fields, overrides):
    mok_config_from_megatron(_config(**fields), overrides)


# --- recompute under expert parallelism: EP = 2 in two gloo processes -----------------------------


def _ep_recompute_worker(rank: int, world: int, port: int, out: str) -> None:
    # Each rank recomputes its layer in the backward, with the exchange's collectives (and the
    # exact exchange's host reads) again: the same calls in the same order on every rank.
    import torch.distributed as dist
    from megatron.core import parallel_state
    from test_megatron import _init

    _init(rank, world, port, ep=world)
    try:
        fields = dict(GATED, **NO_AUX, expert_model_parallel_size=world, moe_shared_expert_overlap=True,
                      moe_token_dispatcher_type="alltoall", **_recompute("moe"))  # fmt: skip
        layer = _mok(_config(**fields))
        full = torch.load(out + ".weights.pt")
        E_l = E // world
        with torch.no_grad():
            for name, param in layer.mok.named_parameters():
                param.copy_(full[name][rank * E_l : (rank + 1) * E_l] if name.startswith("experts.") else full[name])
        rows = slice(6 * rank, 6 * rank + 6)  # rank-major global batch of the [12, 2] sequence
        x, probe = (t[rows] for t in _inputs())
        result = _fwd_bwd(layer, x, probe)
        torch.save({"out": result[0], "d_x": result[1], "grads": result[2]}, f"{out}.{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.usefixtures("megatron_world")
def test_moe_recompute_under_expert_parallelism_matches_one_process(tmp_path):
    from mok_plugin.testing import run_ranks

    layer = _mok(_config(**GATED, **NO_AUX))
    torch.save({name: p.detach() for name, p in layer.mok.named_parameters()}, str(tmp_path / "ep") + ".weights.pt")
    want = _fwd_bwd(layer, *_inputs())
    run_ranks(_ep_recompute_worker, 2, (str(tmp_path / "ep"),))
    parts = [torch.load(tmp_path / f"ep.{rank}.pt") for rank in range(2)]
    assert torch.equal(torch.cat([p["out"] for p in parts]), want[0])
    assert torch.equal(torch.cat([p["d_x"] for p in parts]), want[1])
    E_l = E // 2
    for rank, part in enumerate(parts):
        experts = {k: v for k, v in part["grads"].items() if ".local_experts." in k}
        assert len(experts) == 2 * E_l
        for key, grad in experts.items():
            head, rest = key.split(".local_experts.")
            local, tail = rest.split(".", 1)
            assert torch.equal(grad, want[2][f"{head}.local_experts.{rank * E_l + int(local)}.{tail}"]), (rank, key)


@pytest.mark.usefixtures("megatron_world")
@pytest.mark.parametrize("modules", [["expert_fc1"], ["moe_act", "core_attn"], ["core_attn"]])
def test_moe_activation_offloading_keeps_saved_tensors_in_host_memory(monkeypatch, modules):
    # --fine-grained-activation-offloading --offload-modules expert_fc1 / moe_act (Kimi-K2's recipe):
    # every tensor the MoK layer saves for its backward goes through torch's save_on_cpu hooks (host
    # memory, pinned on a GPU); the same values. Modules outside the MoE layer leave it alone.
    entered = []
    original = torch.autograd.graph.save_on_cpu

    def counting(*args, **kwargs):
        entered.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", counting)
    base = _mok(_config(**SHARED))
    offloaded = _mok(_config(**SHARED, fine_grained_activation_offloading=True, offload_modules=modules), base)
    x, probe = _inputs()
    _assert_bitwise(_fwd_bwd(offloaded, x, probe), _fwd_bwd(base, x, probe))
    moe_modules = {"expert_fc1", "moe_act"} & set(modules)
    assert offloaded.offload_activations == bool(moe_modules)
    assert entered == ([{"pin_memory": False}] if moe_modules else [])
