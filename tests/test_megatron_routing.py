"""Megatron-Core 0.19 routing semantics in MoKMoELayer against the stock MoELayer on the CPU (fp32,
the same weights): the per-sequence and global-batch load-balancing losses, lists of loss types with
their coefficients (0 included), the aux loss beside expert bias and group-limited routing (counted
from the plain top-K), the sqrtsoftplus score function (with expert bias), --calculate-per-token-loss,
each logged loss (name, value, groups), over two micro-batches (the global loss's running counts),
their reset by finalize_model_grads and its expert-bias update; evaluation attaches nothing.
Padding masks (the layer's and GPTModel's padding_mask): the losses, the per-token-loss scales and
the expert-bias counts leave padding tokens out. Context parallelism 2 and data parallelism 2 in two
gloo processes (the TP x CP and TP x DP x CP reductions), with and without a padding mask. The
flags that map to these fields, and those still refused. Helpers come from test_megatron.py."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e .[megatron])")

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed.finalize_model_grads import (  # noqa: E402
    _update_router_expert_bias,
    reset_model_temporary_tensors,
)
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec  # noqa: E402
from megatron.core.transformer.moe import moe_logging  # noqa: E402
from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402
from test_megatron import (  # noqa: E402, F401
    E,
    H,
    _config,
    _fwd_bwd,
    _gpt,
    _gpt_inputs,
    _init,
    cpu_gpt_model,
    megatron_world,
)

from mok_plugin import random_stream  # noqa: E402
from mok_plugin.compare.stock_cpu import make_stock_router_cpu_safe  # noqa: E402
from mok_plugin.config import MoKConfigError  # noqa: E402
from mok_plugin.megatron import mok_config_from_megatron, use_mok  # noqa: E402
from mok_plugin.testing import free_port, make_layer_inputs  # noqa: E402

pytestmark = pytest.mark.megatron

S, B = 6, 2  # the [S, B, H] micro-batches: 12 tokens
MICRO_BATCHES = 2  # the global loss averages its counts over the micro-batches of a step


@pytest.fixture()
def cpu_buffers(monkeypatch):
    """The stock TopKRouter creates its expert-bias and global-loss buffers on
    torch.cuda.current_device(); here they go to the CPU. Its torch.compile'd helpers then run
    eagerly: on a machine with a GPU, dynamo would look the CPU up among the CUDA devices."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    torch.compiler.set_stance("force_eager")
    yield
    torch.compiler.set_stance("default")


def _close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """fp32 agreement to about 1e-6 of the tensor's scale (MoK's router runs in fp64, the stock one
    in fp32: the last bits differ)."""
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * max(scale, 1e-30), msg=lambda m: f"{name}: {m}")


def _build(cfg, expert_bias: torch.Tensor | None = None):
    spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    stock = spec(config=cfg)
    make_stock_router_cpu_safe(stock)
    if expert_bias is not None:
        stock.router.expert_bias.copy_(expert_bias)
    mok = use_mok(spec)(config=cfg)
    mok.load_state_dict(stock.state_dict())
    for layer in (stock, mok):
        layer.set_layer_number(1)
    return stock, mok


def _padding_mask(b: int, s: int, seed: int) -> torch.Tensor:
    """bool [B, S], True for a padding token (as Megatron's router code reads it): about a third of
    the tokens, the first sequence's last two always among them."""
    mask = torch.rand(b, s, generator=torch.Generator().manual_seed(seed)) < 1 / 3
    mask[0, -2:] = True
    return mask


def _run(layer, steps: int = MICRO_BATCHES, seed: int = 0, s: int = S, b: int = B, padded: bool = False):
    """Forward + backward over `steps` micro-batches (gradients accumulate, as in one training step),
    with a padding mask where `padded`. Returns (outputs, input gradients, parameter gradients under
    the stock names, the logged metrics {name: (values, reduce_group, avg_group, needs_dp_avg)})."""
    moe_logging.destroy_moe_metrics_tracker()
    outs, d_xs = [], []
    for step in range(steps):
        x = make_layer_inputs(s * b, H, seed=seed + 10 * step).view(s, b, H)
        probe = make_layer_inputs(s * b, H, seed=seed + 10 * step + 1).view(s, b, H)
        padding = {"padding_mask": _padding_mask(b, s, seed + 10 * step + 2)} if padded else {}
        out, d_x, grads = _fwd_bwd(layer, x, probe, **padding)
        outs.append(out)
        d_xs.append(d_x)
    logged = {
        name: (entry.values.clone(), entry.reduce_group, entry.avg_group, entry.needs_dp_avg)
        for name, entry in moe_logging.get_moe_metrics_tracker().metrics.items()
    }
    return outs, d_xs, grads, logged


def _assert_same(stock, mok, **run) -> dict:
    want, got = _run(stock, **run), _run(mok, **run)
    for step in range(len(want[0])):
        _close(got[0][step], want[0][step], f"output of micro-batch {step}")
        _close(got[1][step], want[1][step], f"d_x of micro-batch {step}")
    assert set(got[2]) == set(want[2])
    for name in want[2]:  # the router weight's gradient holds every loss's
        _close(got[2][name], want[2][name], f"grad of {name}")
    assert set(got[3]) == set(want[3]), "logged metrics"
    for name, (values, reduce_group, avg_group, needs_dp_avg) in want[3].items():
        _close(got[3][name][0], values, f"logged {name}")
        assert got[3][name][1:] == (reduce_group, avg_group, needs_dp_avg), f"groups of logged {name}"
    return want[3]


LB = "moe_router_load_balancing_type"
SIGMOID_GROUPS = dict(moe_router_score_function="sigmoid", moe_router_num_groups=4, moe_router_group_topk=2,
                      moe_router_topk=4)  # fmt: skip
BALANCING = {
    # DeepSeek-V2/V3's per-sequence loss: B sequences of S tokens in Megatron's [S, B, H] layout.
    "seq_aux_loss": {LB: "seq_aux_loss", "moe_aux_loss_coeff": 0.01},
    # Counts over the global batch: a running mean over the step's two micro-batches.
    "global_aux_loss": {LB: "global_aux_loss", "moe_aux_loss_coeff": 0.01},
    "list_of_three_with_z_loss": {LB: ["aux_loss", "seq_aux_loss", "global_aux_loss"],
                                  "moe_aux_loss_coeff": [0.01, 0.02, 0.005], "moe_z_loss_coeff": 1e-3},
    # A coefficient of 0 switches its loss off (Megatron then neither computes nor logs it).
    "list_with_zero_coeff": {LB: ["aux_loss", "seq_aux_loss"], "moe_aux_loss_coeff": [0.0, 0.01]},
    # Megatron reads a repeated type's first coefficient only.
    "list_repeated_type": {LB: ["aux_loss", "aux_loss"], "moe_aux_loss_coeff": [0.01, 0.5]},
    # DeepSeek's aux-loss-free name (Megatron-Bridge's DeepSeek-V4): no loss, as Megatron 0.19's router.
    "noaux_tc_with_expert_bias": {LB: "noaux_tc", "moe_aux_loss_coeff": 0.01, "moe_router_enable_expert_bias": True,
                                  "moe_router_score_function": "sigmoid"},
    "list_with_noaux_tc": {LB: ["noaux_tc", "seq_aux_loss"], "moe_aux_loss_coeff": [0.5, 0.01]},
    # The aux loss beside group-limited routing counts each token's plain top-K.
    "sigmoid_groups_aux": {**SIGMOID_GROUPS, LB: ["aux_loss", "seq_aux_loss"], "moe_aux_loss_coeff": [0.01, 0.01]},
}  # fmt: skip
SCORE_FUNCTIONS = {
    # DeepSeek-V4's sqrt(softplus(x)): normalised over the K chosen, its own aux-loss scores.
    "sqrtsoftplus": {"moe_router_score_function": "sqrtsoftplus", "moe_router_topk_scaling_factor": 2.0,
                     "moe_z_loss_coeff": 1e-3},
    "sqrtsoftplus_top1": {"moe_router_score_function": "sqrtsoftplus", "moe_router_topk": 1},  # not normalised
}  # fmt: skip
PER_TOKEN_LOSS = {LB: ["aux_loss", "seq_aux_loss", "global_aux_loss"], "moe_aux_loss_coeff": [0.01, 0.02, 0.005],
                  "moe_z_loss_coeff": 1e-3, "calculate_per_token_loss": True}  # fmt: skip
CASES = {**BALANCING, **SCORE_FUNCTIONS, "per_token_loss": PER_TOKEN_LOSS}


@pytest.mark.parametrize("case", list(BALANCING))
@pytest.mark.usefixtures("megatron_world", "cpu_buffers")
def test_balancing_losses_match_stock(case):
    stock, mok = _build(_config(**BALANCING[case]))
    _assert_same(stock, mok)


@pytest.mark.parametrize("case", list(SCORE_FUNCTIONS))
@pytest.mark.usefixtures("megatron_world", "cpu_buffers")
def test_score_functions_match_stock(case):
    stock, mok = _build(_config(**SCORE_FUNCTIONS[case]))
    _assert_same(stock, mok)


@pytest.mark.usefixtures("megatron_world", "cpu_buffers")
def test_per_token_loss_scaling_matches_stock():
    # Every loss times this rank's tokens x the TP x CP size: the router's gradient changes, the
    # logged values do not.
    cfg = _config(**PER_TOKEN_LOSS)
    stock, mok = _build(cfg)
    _assert_same(stock, mok)
    _, plain = _build(_config(**{**PER_TOKEN_LOSS, "calculate_per_token_loss": False}))
    plain.load_state_dict(mok.state_dict())
    for layer in (plain, mok):
        layer.zero_grad(set_to_none=True)
    reset_model_temporary_tensors(cfg, [mok])
    plain_run, scaled_run = _run(plain), _run(mok)
    for name, entry in plain_run[3].items():
        assert torch.equal(entry[0], scaled_run[3][name][0]), name
    assert torch.equal(plain_run[0][0], scaled_run[0][0])
    assert not torch.equal(plain_run[2]["router.weight"], scaled_run[2]["router.weight"])


@pytest.mark.usefixtures("megatron_world", "cpu_buffers")
def test_losses_are_logged_as_stock():
    stock, mok = _build(_config(**CASES["list_of_three_with_z_loss"]))
    logged = _assert_same(stock, mok)  # values and groups as stock's
    tp_cp = parallel_state.get_tensor_and_context_parallel_group()
    tp_dp_cp = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    assert {name: entry[1:] for name, entry in logged.items()} == {
        "load_balancing_loss": (tp_cp, None, True),
        "seq_load_balancing_loss": (tp_cp, None, True),
        "global_load_balancing_loss": (tp_dp_cp, None, False),
        "z_loss": (None, tp_dp_cp, True),
    }
    assert all(entry[0][0] > 0 and entry[0][1] == 0 for entry in logged.values())  # layer 1 of 2


@pytest.mark.usefixtures("megatron_world", "cpu_buffers")
def test_repeated_mtp_layer():
    # A repeated MTP layer runs mtp_num_layers times: its load-balancing losses are divided by that
    # (in the gradient and the log), its z-loss in the log only; logged after the decoder's layers.
    cfg = _config(mtp_num_layers=2, mtp_use_repeated_layer=True, moe_z_loss_coeff=1e-3,
                  **{LB: ["aux_loss", "seq_aux_loss"], "moe_aux_loss_coeff": [0.01, 0.02]})  # fmt: skip
    spec = get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False)
    stock = spec(config=cfg, is_mtp_layer=True)
    make_stock_router_cpu_safe(stock)
    mok = use_mok(spec)(config=cfg, is_mtp_layer=True)
    mok.load_state_dict(stock.state_dict())
    for layer in (stock, mok):
        layer.set_layer_number(1)
    logged = _assert_same(stock, mok)
    assert all(entry[0].nonzero().flatten().tolist() == [cfg.num_layers] for entry in logged.values())


# The expert bias changes which experts tokens go to, never the aux loss's counts.
BIASED = {
    "sigmoid_bias_aux": dict(moe_router_score_function="sigmoid"),
    "sqrtsoftplus_bias_groups_seq_global": dict(
        moe_router_score_function="sqrtsoftplus", moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk=4,
        **{LB: ["seq_aux_loss", "global_aux_loss"], "moe_aux_loss_coeff": [0.01, 0.01]},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BIASED))
@pytest.mark.usefixtures("megatron_world", "cpu_buffers")
def test_aux_loss_beside_expert_bias_matches_stock(case):
    cfg = _config(moe_router_enable_expert_bias=True, **BIASED[case])
    bias = 0.3 * make_layer_inputs(1, E, seed=5)[0]  # large enough to change choices
    stock, mok = _build(cfg, expert_bias=bias)
    _assert_same(stock, mok)
    # Megatron's finalize_model_grads updates the bias from these: the same counts.
    assert torch.equal(mok.mok.local_tokens_per_expert, stock.router.local_tokens_per_expert)


# A padding mask (packed or padded sequences; GPTModel.forward's padding_mask): its tokens run
# through the experts and stay out of every router loss (micro-batch, per sequence, global, z) and
# out of the expert-bias counts.
PADDED = {
    "list_of_three_with_z_loss": BALANCING["list_of_three_with_z_loss"],
    "per_token_loss": PER_TOKEN_LOSS,
    "sigmoid_groups_aux": BALANCING["sigmoid_groups_aux"],
    "sqrtsoftplus": SCORE_FUNCTIONS["sqrtsoftplus"],
}  # fmt: skip


@pytest.mark.parametrize("case", list(PADDED))
@pytest.mark.usefixtures("megatron_world", "cpu_buffers")
def test_padding_mask_matches_stock(case):
    stock, mok = _build(_config(**PADDED[case]))
    _assert_same(stock, mok, padded=True)
    # The mask changes the losses (and so the router's gradient), not the experts' outputs.
    _, plain = _build(_config(**PADDED[case]))
    plain.load_state_dict(mok.state_dict())
    padded_run, plain_run = _run(mok, padded=True), _run(plain)
    assert torch.equal(padded_run[0][0], plain_run[0][0])
    assert not torch.equal(padded_run[2]["router.weight"], plain_run[2]["router.weight"])


def _expert_bias_counts_as_fixed_upstream(self, routing_map, padding_mask=None):
    """TopKRouter._apply_expert_bias as Megatron-LM fixed it (commit 723db5a, PR #6114): 0.19's
    `routing_map & ~padding_mask` broadcasts the [T] mask against [T, E] and fails (or, where T = E,
    masks experts instead of tokens). MoK counts as the fix does."""
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & (~padding_mask).unsqueeze(-1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)


@pytest.mark.usefixtures("megatron_world", "cpu_buffers")
def test_padding_mask_leaves_padding_out_of_the_expert_bias_counts(monkeypatch):
    monkeypatch.setattr(TopKRouter, "_apply_expert_bias", _expert_bias_counts_as_fixed_upstream)
    cfg = _config(moe_router_enable_expert_bias=True, **BIASED["sigmoid_bias_aux"])
    stock, mok = _build(cfg, expert_bias=0.3 * make_layer_inputs(1, E, seed=5)[0])
    _assert_same(stock, mok, padded=True)
    assert torch.equal(mok.mok.local_tokens_per_expert, stock.router.local_tokens_per_expert)
    padding = sum(int(_padding_mask(B, S, 10 * step + 2).sum()) for step in range(MICRO_BATCHES))
    assert int(mok.mok.local_tokens_per_expert.sum()) == (MICRO_BATCHES * S * B - padding) * cfg.moe_router_topk


@pytest.mark.usefixtures("megatron_world", "cpu_gpt_model")
def test_gpt_model_hands_its_padding_mask_to_mok():
    # GPTModel.forward(..., padding_mask=) reaches the MoE layers through TransformerLayer: the whole
    # model with MoK's layers against the stock model with the same weights.
    from megatron.core.transformer.moe.moe_layer import MoELayer

    cfg = _config(num_layers=2, transformer_impl="local", moe_layer_freq=[0, 1], attention_dropout=0.0,
                  hidden_dropout=0.0, **BALANCING["list_of_three_with_z_loss"])  # fmt: skip
    stock, mok = _gpt(cfg, S, mok=False), _gpt(cfg, S, mok=True)
    mok.load_state_dict(stock.state_dict())

    def router_grad(model, padding_mask):
        model.zero_grad(set_to_none=True)
        out = model(*_gpt_inputs(B, S), padding_mask=padding_mask)
        out.square().sum().backward()
        layer = model.decoder.layers[1].mlp
        return out.detach(), (layer.router if type(layer) is MoELayer else layer.mok.router).weight.grad

    padding_mask = _padding_mask(B, S, seed=7)
    want, got = router_grad(stock, padding_mask), router_grad(mok, padding_mask)
    _close(got[0], want[0], "logits")
    _close(got[1], want[1], "router gradient")
    assert not torch.equal(router_grad(mok, None)[1], got[1]), "the mask changes the router's losses"


@pytest.mark.usefixtures("megatron_world")
def test_the_ep_overlap_route_refuses_a_padding_mask():
    # The EP-overlap schedule routes in shared_experts_compute; a mask given to the later route stage
    # could not change that routing, so it is refused rather than ignored.
    _, mok = _build(_config())
    x = make_layer_inputs(S * B, H, seed=0).view(S, B, H)
    with pytest.raises(NotImplementedError, match="padding_mask"):
        mok.route(x, padding_mask=torch.zeros(B, S, dtype=torch.bool))


@pytest.mark.usefixtures("megatron_world")
def test_padding_mask_of_the_wrong_shape_is_an_error():
    _, mok = _build(_config())
    x = make_layer_inputs(S * B, H, seed=0).view(S, B, H)
    with pytest.raises(ValueError, match=r"padding_mask must be \[B=2, S=6\]"):
        mok(x, padding_mask=torch.zeros(S, B, dtype=torch.bool))


@pytest.mark.usefixtures("megatron_world", "cpu_buffers")
def test_finalize_updates_the_expert_bias_as_stock():
    # Megatron's finalize_model_grads updates the bias of every module with `expert_bias` from its
    # `local_tokens_per_expert`, then zeroes the counts.
    cfg = _config(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    stock, mok = _build(cfg)
    _assert_same(stock, mok)
    group = parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
    for layer in (stock, mok):
        _update_router_expert_bias([layer], cfg, tp_dp_cp_group=group)
        reset_model_temporary_tensors(cfg, [layer])
    assert stock.router.expert_bias.abs().sum() > 0
    assert torch.equal(mok.mok.expert_bias, stock.router.expert_bias)
    assert not mok.mok.local_tokens_per_expert.any()


@pytest.mark.usefixtures("megatron_world", "cpu_buffers")
def test_global_counts_reset_by_finalize_and_stay_out_of_checkpoints():
    cfg = _config(**CASES["global_aux_loss"])
    stock, mok = _build(cfg)
    assert set(mok.state_dict()) == set(stock.state_dict())  # the running counts are not persistent
    _assert_same(stock, mok)
    assert int(mok.mok.ga_steps) == MICRO_BATCHES
    assert torch.equal(mok.mok.global_tokens_per_expert.float(), stock.router.global_tokens_per_expert)
    reset_model_temporary_tensors(cfg, [stock, mok])  # what finalize_model_grads calls after each step
    assert int(mok.mok.ga_steps) == 0 and not mok.mok.global_tokens_per_expert.any()
    _assert_same(stock, mok, seed=100)  # the next step starts its own mean


@pytest.mark.usefixtures("megatron_world", "cpu_buffers")
def test_evaluation_attaches_and_logs_nothing():
    cfg = _config(**CASES["list_of_three_with_z_loss"])
    stock, mok = _build(cfg)
    for layer in (stock, mok):
        layer.eval()
    x = make_layer_inputs(S * B, H, seed=1).view(S, B, H)
    for layer in (stock, mok):
        moe_logging.destroy_moe_metrics_tracker()
        with torch.no_grad():
            layer(x)
        assert not moe_logging.get_moe_metrics_tracker().metrics
    assert int(mok.mok.ga_steps) == 0  # and counted nothing into the global batch


@pytest.mark.usefixtures("megatron_world", "cpu_buffers")
def test_bitwise_repeatable_with_every_loss():
    cfg = _config(**CASES["per_token_loss"])
    _, mok = _build(cfg)
    first = _run(mok)
    reset_model_temporary_tensors(cfg, [mok])
    second = _run(mok)
    for a, b in zip(first[0] + first[1], second[0] + second[1], strict=True):
        assert torch.equal(a, b)
    for name in first[3]:
        assert torch.equal(first[3][name][0], second[3][name][0]), name


# --- the flags ------------------------------------------------------------------------------------


def test_flags_map_to_the_loss_coefficients():
    mok = mok_config_from_megatron(_config(**CASES["list_of_three_with_z_loss"]))
    assert (mok.aux_loss_coeff, mok.seq_aux_loss_coeff, mok.global_aux_loss_coeff) == (0.01, 0.02, 0.005)
    assert mok_config_from_megatron(_config(**CASES["list_repeated_type"])).aux_loss_coeff == 0.01
    zero = mok_config_from_megatron(_config(**CASES["list_with_zero_coeff"]))
    assert (zero.aux_loss_coeff, zero.seq_aux_loss_coeff) == (0.0, 0.01)
    sqrt = mok_config_from_megatron(_config(moe_router_score_function="sqrtsoftplus", moe_router_topk=1))
    assert sqrt.score_function == "sqrtsoftplus" and not sqrt.norm_topk_prob  # Megatron normalises K > 1 only
    out_of_bounds = r"mok\.seq_aux_loss_coeff \(--moe-aux-loss-coeff, for seq_aux_loss\)=2000\.0"
    with pytest.raises(MoKConfigError, match=out_of_bounds):
        mok_config_from_megatron(_config(**{LB: "seq_aux_loss", "moe_aux_loss_coeff": 2000.0}))


def _mismatched_coeffs():
    cfg = _config(**{LB: ["aux_loss", "seq_aux_loss"], "moe_aux_loss_coeff": [0.01, 0.01]})
    cfg.moe_aux_loss_coeff = 0.01  # TransformerConfig checks this at construction only
    return cfg


REFUSED = {
    "force_biased": (lambda: _config(moe_router_force_biased=0.1), "--moe-router-force-biased"),
    "sinkhorn": (lambda: _config(**{LB: "sinkhorn", "moe_aux_loss_coeff": 0.0}), "--moe-router-load-balancing-type"),
    "sinkhorn_in_list": (lambda: _config(**{LB: ["aux_loss", "sinkhorn"], "moe_aux_loss_coeff": [0.01, 0.0]}),
                         "ignored by Megatron's router"),
    "mismatched_coeffs": (_mismatched_coeffs, "--moe-aux-loss-coeff"),
    "softmax_groups_by_logits": (
        lambda: _config(moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk=4), "--moe-router-num-groups"
    ),
}  # fmt: skip


def _mok_random_logits(layer_number: int, call: int, num_tokens: int) -> torch.Tensor:
    """The N(0, 1) logits MoK's layer `layer_number` routes by in its `call`-th forward (seed 0)."""
    tokens = random_stream.global_token_index(num_tokens, 0)
    return random_stream.normal(0, call, f"force_balance/layer={layer_number}", tokens, E)


@pytest.mark.usefixtures("megatron_world", "cpu_buffers")
def test_force_load_balancing_under_full_recompute_draws_as_the_forward(monkeypatch):
    # --recompute-granularity full: Megatron's reentrant checkpoint (tensor_parallel.checkpoint) runs
    # the layer without gradients, then again in the backward. The recomputation must route by the
    # first pass's noise, or the gradients belong to another routing. Three micro-batches, each
    # recomputed after all three forwards (the pipeline's order), against the layer without recompute.
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as megatron_random

    monkeypatch.setattr(megatron_random, "_get_cuda_rng_state", lambda *args, **kwargs: None)  # (CPU: no CUDA RNG)
    monkeypatch.setattr(megatron_random, "_set_cuda_rng_state", lambda *args, **kwargs: None)
    cfg = _config(moe_router_force_load_balancing=True, recompute_granularity="full", recompute_method="uniform",
                  recompute_num_layers=1)  # fmt: skip
    layer = use_mok(get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False))(config=cfg)
    layer.set_layer_number(1)
    xs = [make_layer_inputs(S * B, H, seed=10 + i).view(S, B, H) for i in range(3)]

    def train(recompute: bool):
        layer.zero_grad(set_to_none=True)
        layer.mok.random_calls.zero_()
        inputs = [x.clone().requires_grad_() for x in xs]
        run = (lambda h: tensor_parallel.checkpoint(lambda t: layer(t)[0], False, h)) if recompute else (
            lambda h: layer(h)[0])  # fmt: skip
        outs = [run(x) for x in inputs]
        for out in outs:
            (out * out).sum().backward()
        grads = [p.grad.clone() for p in layer.parameters() if p.grad is not None]
        return [o.detach() for o in outs], [x.grad for x in inputs], grads

    want, got = train(False), train(True)
    assert len(layer.mok.recompute_steps) == 0  # every first pass was recomputed
    for part in range(3):
        assert all(torch.equal(a, b) for a, b in zip(got[part], want[part], strict=True)), part


@pytest.mark.usefixtures("megatron_world", "cpu_buffers")
def test_force_load_balancing(monkeypatch):
    # Megatron's RandomSTE routes by N(0, 1) logits from the CUDA RNG with the gradient straight
    # through; MoK draws them from its counter-based stream. With the stock layer given MoK's draws,
    # everything else (routing on them, the straight-through router gradient, the losses) matches.
    from megatron.core.transformer.moe import moe_utils

    calls = []

    def mok_draws(ctx, logits):
        calls.append(1)
        rows = logits.reshape(-1, E).shape[0]  # [S, B, E]: token s * B + b, as MoK flattens [S, B, H]
        return _mok_random_logits(1, len(calls) - 1, rows).to(logits.dtype).view(logits.shape)

    monkeypatch.setattr(moe_utils.RandomSTE, "forward", staticmethod(mok_draws))
    cfg = _config(moe_router_force_load_balancing=True, moe_z_loss_coeff=1e-3)
    stock, mok = _build(cfg)
    _assert_same(stock, mok)
    assert len(calls) == MICRO_BATCHES and int(mok.mok.random_calls) == MICRO_BATCHES
    # Repeatable: a second layer from the same weights routes its first calls by the same logits.
    again = use_mok(get_moe_module_spec(use_te=False, num_experts=E, moe_grouped_gemm=False))(config=cfg)
    again.load_state_dict(mok.state_dict())
    again.set_layer_number(1)
    x = make_layer_inputs(S * B, H, seed=0).view(S, B, H)
    first = _fwd_bwd(again, x, x)
    again.mok.random_calls.zero_()
    assert all(torch.equal(a, b) for a, b in zip(first[:2], _fwd_bwd(again, x, x)[:2], strict=True))
    # Balanced: over many tokens every expert gets about T * K / E of them.
    counts = torch.zeros(E)
    for token_block in range(4):
        noise = _mok_random_logits(1, token_block, 4096)
        counts += torch.bincount(noise.topk(2, dim=-1).indices.flatten(), minlength=E)
    expected = 4 * 4096 * 2 / E
    assert ((counts - expected).abs() / expected).max() < 0.05, counts


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_routing_settings_name_their_flag(case):
    make, flag = REFUSED[case]
    with pytest.raises(MoKConfigError, match=flag):
        mok_config_from_megatron(make())


# --- context parallelism 2 and data parallelism 2, in two gloo processes ------------------------


def _parallel_worker(rank: int, world: int, port: int) -> None:
    """Each layout in turn: every rank checks MoK against the stock layer on its own tokens (the
    losses' token counts summed over the TP x CP group, or TP x DP x CP for the global loss)."""
    _init(rank, world, port)  # TP = CP = EP = 1 first, for the process group
    parallel_state.destroy_model_parallel()
    try:
        torch.cuda.current_device = lambda: "cpu"  # the stock router's buffers (see cpu_buffers)
        torch.compiler.set_stance("force_eager")
        losses = {LB: ["aux_loss", "seq_aux_loss", "global_aux_loss"], "moe_aux_loss_coeff": [0.01, 0.02, 0.005],
                  "moe_z_loss_coeff": 1e-3}  # fmt: skip
        for cp, per_token in ((2, True), (1, False)):  # CP 2 (DP 1), then DP 2 (CP 1)
            parallel_state.initialize_model_parallel(1, 1, context_parallel_size=cp)
            cfg = _config(**losses, context_parallel_size=cp, calculate_per_token_loss=per_token)
            stock, mok = _build(cfg)
            assert dist.get_world_size(mok.mok.sequence_group) == cp
            assert dist.get_world_size(mok.mok.global_batch_group) == world
            _assert_same(stock, mok, seed=1000 * rank)  # each rank its own tokens (sequence shards)
            # With padding: the tokens that are not padding, counted over the same groups.
            stock, mok = _build(cfg)
            _assert_same(stock, mok, seed=1000 * rank, padded=True)
            parallel_state.destroy_model_parallel()
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.distributed
def test_context_parallel_reduces_aux_statistics():
    # CP 2, then DP 2 (where TP x CP is one rank and TP x DP x CP two).
    mp.spawn(_parallel_worker, args=(2, free_port()), nprocs=2, join=True)


def test_sequence_layout_is_required_for_seq_aux_loss():
    from mok_plugin import MoKConfig, MoKMoE

    layer = MoKMoE(MoKConfig(hidden_size=8, ffn_hidden_size=4, num_experts=4, top_k=2, seq_aux_loss_coeff=0.01))
    with pytest.raises(ValueError, match="num_sequences"):
        layer(torch.randn(3, 2, 8))
    out, aux = layer(torch.randn(3, 2, 8), num_sequences=2)
    assert set(layer.last_router_losses) == {"seq_aux_loss"} and aux > 0
