"""The expert modules DeepSpeed users pass, each against deepspeed.moe.layer.MoE with the same
(random, biases included) weights: output, l_aux, counts, input gradient, router gradient, and every
expert weight and bias gradient under the stock names; which MoK family each is recognised as (or
that it runs as itself); checkpoints both ways. The modules: Hugging Face gate/up/down (SiLU, with
mlp_bias, Gemma's GeLU and tanh GeLU), Mixtral w1/w3/w2, Qwen-1 w1/w2/c_proj, Phi fc1/fc2 with
NewGELU, Megatron-DeepSpeed's ParallelMLP (emulated: fused bias-GeLU, F.gelu, erf_gelu, openai_gelu,
squared ReLU, --swiglu), Sequential(Linear, activation, Linear), a fused [up; gate] GeGLU,
nn.Linear(H, H), and modules no family computes (two linears, a residual block with a LayerNorm, a
GPT-OSS-style clamped GLU, dropout), which run as themselves: bitwise repeatable, warned once."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("deepspeed", reason="needs deepspeed (pip install -e .[deepspeed])")

from deepspeed.moe.layer import MoE as StockMoE  # noqa: E402
from test_deepspeed import one_rank_world  # noqa: E402

import mok_plugin.deepspeed as mds  # noqa: E402
from mok_plugin.deepspeed.experts import expert_layout  # noqa: E402
from mok_plugin.testing import assert_close, make_layer_inputs  # noqa: E402

pytestmark = pytest.mark.deepspeed
H, I, E = 16, 24, 4


@pytest.fixture(scope="module", name="ds_world")
def _ds_world():
    yield from one_rank_world()


# --- the expert modules, written as their sources write them ----------------------------------


class GateUpDown(nn.Module):
    """Hugging Face's LlamaMLP / Qwen2MLP / MistralMLP / GemmaMLP (mlp_bias for the biases)."""

    def __init__(self, act_fn: nn.Module, bias: bool = False):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(H, I, bias=bias), nn.Linear(H, I, bias=bias)
        self.down_proj = nn.Linear(I, H, bias=bias)
        self.act_fn = act_fn

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MixtralExpert(nn.Module):
    """Hugging Face's MixtralBlockSparseTop2MLP."""

    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class QWenMLP(nn.Module):
    """Qwen-1's MLP: w2 is the gated half (silu), w1 the linear one."""

    def __init__(self, bias: bool):
        super().__init__()
        self.w1, self.w2 = nn.Linear(H, I, bias=bias), nn.Linear(H, I, bias=bias)
        self.c_proj = nn.Linear(I, H, bias=bias)

    def forward(self, hidden_states):
        a1 = self.w1(hidden_states)
        a2 = self.w2(hidden_states)
        return self.c_proj(a1 * F.silu(a2))


class NewGELU(nn.Module):
    """Hugging Face's NewGELUActivation (gelu_new): the tanh approximation, written out."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class PhiMLP(nn.Module):
    """Hugging Face's PhiMLP (Phi-2: gelu_new, biased)."""

    def __init__(self):
        super().__init__()
        self.activation_fn = NewGELU()
        self.fc1, self.fc2 = nn.Linear(H, I), nn.Linear(I, H)

    def forward(self, hidden_states):
        return self.fc2(self.activation_fn(self.fc1(hidden_states)))


class MegatronLinear(nn.Module):
    """Megatron-DeepSpeed's Column/RowParallelLinear as an expert builds it (moe=True, no expert
    tensor parallelism: no slicing): weight [out, in], bias [out] or None; returns
    (output, bias) with skip_bias_add, else (output + bias, None)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, skip_bias_add: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) * 0.02)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.skip_bias_add = skip_bias_add

    def forward(self, input_):
        output = F.linear(input_, self.weight)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


class BiasGeLU(torch.autograd.Function):
    """megatron/model/fused_bias_gelu.py: tanh GeLU of (bias + y) with sqrt(2/pi) as 0.79788456,
    and its hand-written derivative."""

    @staticmethod
    def forward(ctx, y, bias):
        ctx.save_for_backward(y, bias)
        x = bias + y
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):
        y, bias = ctx.saved_tensors
        x = bias + y
        tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
        return ff * g, ff * g


def openai_gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))


def erf_gelu(x):
    return x * 0.5 * (torch.erf(x / 1.41421).to(dtype=x.dtype) + torch.ones_like(x).to(dtype=x.dtype))


class ParallelMLP(nn.Module):
    """megatron/model/transformer.py ParallelMLP(config, moe=True) of Megatron-DeepSpeed: the
    activation chosen as its arguments choose it (--openai-gelu, --onnx-safe, --swiglu,
    --squared-relu, else F.gelu, fused with the bias unless --no-bias-gelu-fusion)."""

    def __init__(self, activation: str = "gelu", add_bias: bool = True, bias_gelu_fusion: bool = True):
        super().__init__()
        ffn_hidden_size = 2 * I if activation == "swiglu" else I
        self.dense_h_to_4h = MegatronLinear(H, ffn_hidden_size, add_bias, skip_bias_add=True)
        self.bias_gelu_fusion = False
        if activation == "openai_gelu":
            self.activation_func = openai_gelu
        elif activation == "erf_gelu":
            self.activation_func = erf_gelu
        elif activation == "swiglu":

            def swiglu(x):
                x = torch.chunk(x, 2, dim=-1)
                return F.silu(x[0]) * x[1]

            self.activation_func = swiglu
        elif activation == "squared_relu":
            self.activation_func = lambda x: torch.pow(F.relu(x), 2)
        else:
            self.bias_gelu_fusion = bias_gelu_fusion
            self.activation_func = F.gelu
        self.dense_4h_to_h = MegatronLinear(I, H, add_bias, skip_bias_add=False)

    def forward(self, hidden_states):
        intermediate_parallel, bias_parallel = self.dense_h_to_4h(hidden_states)
        if self.bias_gelu_fusion:
            intermediate_parallel = BiasGeLU.apply(intermediate_parallel, bias_parallel)
        else:
            if bias_parallel is not None:
                intermediate_parallel = intermediate_parallel + bias_parallel
            intermediate_parallel = self.activation_func(intermediate_parallel)
        return self.dense_4h_to_h(intermediate_parallel)  # (output, output_bias)


class UpFirstGeGLU(nn.Module):
    """One fused first linear chunked as [up; gate] (diffusers' GEGLU), then a down projection."""

    def __init__(self):
        super().__init__()
        self.proj, self.out = nn.Linear(H, 2 * I), nn.Linear(I, H)

    def forward(self, x):
        hidden_states, gate = self.proj(x).chunk(2, dim=-1)
        return self.out(hidden_states * F.gelu(gate))


class ResidualBlock(nn.Module):
    """No MoK family: x + fc2(gelu(fc1(layer_norm(x))))."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.fc1, self.fc2 = nn.Linear(H, I), nn.Linear(I, H)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ClampedGLU(GateUpDown):
    """GPT-OSS's expert shape (quick-GeGLU, clamp 7, linear offset 1, biases): no family the probe
    tries, so it runs as itself."""

    def __init__(self):
        super().__init__(QuickGELU(), bias=True)

    def forward(self, x):
        gate, up = self.gate_proj(x).clamp(max=7.0), self.up_proj(x).clamp(-7.0, 7.0)
        return self.down_proj(self.act_fn(gate) * (up + 1.0))


def _seq(*layers):
    return lambda: nn.Sequential(*layers)


# (id, factory, what MoK computes: a family's describe(), or "modules" for the module itself)
CASES = [
    ("llama_swiglu", lambda: GateUpDown(nn.SiLU()), "SwiGLU"),
    ("llama_mlp_bias", lambda: GateUpDown(nn.SiLU(), bias=True), "SwiGLU + fc1 and fc2 bias"),
    ("gemma_gelu", lambda: GateUpDown(nn.GELU()), "glu(gelu)"),
    ("gemma_gelu_tanh", lambda: GateUpDown(nn.GELU(approximate="tanh")), "glu(gelu_tanh)"),
    ("gate_up_down_relu_bias", lambda: GateUpDown(nn.ReLU(), bias=True), "glu(relu) + fc1 and fc2 bias"),
    ("mixtral", MixtralExpert, "SwiGLU"),
    ("qwen1", lambda: QWenMLP(bias=False), "SwiGLU"),
    ("qwen1_bias", lambda: QWenMLP(bias=True), "SwiGLU + fc1 and fc2 bias"),
    ("phi2", PhiMLP, "mlp(gelu_tanh) + fc1 and fc2 bias"),
    ("megatron_fused_bias_gelu", ParallelMLP, "mlp(gelu_tanh) + fc1 and fc2 bias"),
    ("megatron_gelu", lambda: ParallelMLP(bias_gelu_fusion=False), "mlp(gelu) + fc1 and fc2 bias"),
    ("megatron_erf_gelu", lambda: ParallelMLP("erf_gelu"), "mlp(gelu) + fc1 and fc2 bias"),
    ("megatron_openai_gelu", lambda: ParallelMLP("openai_gelu"), "mlp(gelu_tanh) + fc1 and fc2 bias"),
    ("megatron_squared_relu", lambda: ParallelMLP("squared_relu"), "mlp(squared_relu) + fc1 and fc2 bias"),
    ("megatron_swiglu", lambda: ParallelMLP("swiglu"), "SwiGLU + fc1 and fc2 bias"),
    ("megatron_swiglu_no_bias", lambda: ParallelMLP("swiglu", add_bias=False), "SwiGLU"),
    ("sequential_relu", _seq(nn.Linear(H, I), nn.ReLU(), nn.Linear(I, H)), "mlp(relu) + fc1 and fc2 bias"),
    (
        "sequential_silu_no_bias",
        _seq(nn.Linear(H, I, bias=False), nn.SiLU(), nn.Linear(I, H, bias=False)),
        "mlp(silu)",
    ),  # fmt: skip
    (
        "sequential_quick_gelu",
        _seq(nn.Linear(H, I), QuickGELU(), nn.Linear(I, H)),
        "mlp(quick_gelu) + fc1 and fc2 bias",
    ),
    ("geglu_up_first", UpFirstGeGLU, "glu(gelu) + fc1 and fc2 bias"),
    ("linear_bias", lambda: nn.Linear(H, H), "linear + fc2 bias"),
    ("linear_no_bias", lambda: nn.Linear(H, H, bias=False), "linear"),
    # DeepSpeed's own tests' expert: no activation between the linears, no MoK family.
    ("two_linears", _seq(nn.Linear(H, H), nn.Linear(H, H)), "modules"),
    ("residual_block", ResidualBlock, "modules"),
    ("gpt_oss_clamped_glu", ClampedGLU, "modules"),
]
IDS = [case[0] for case in CASES]
MODULES = {"two_linears", "residual_block", "gpt_oss_clamped_glu"}


def _computes(layer) -> str:
    return "modules" if layer.expert_layout is None else layer.expert_layout.family.describe()


def _layers(make, k: int = 3):
    torch.manual_seed(0)
    kwargs = dict(num_experts=E, k=k, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
    stock = StockMoE(H, make(), **kwargs)
    with torch.no_grad():  # distinct experts (DeepSpeed starts them as copies of one), random biases
        for p in stock.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the module path's warning: test_module_path_warns_once
        mok = mds.MoE(H, make(), **kwargs, mok_config={"backend": "reference"})
    mok.load_state_dict(stock.state_dict())
    return stock, mok


def _mok_expert_grads(mok) -> dict[str, torch.Tensor]:
    """MoK's expert gradients under the stock names, deepspeed_experts.{i}.<name>."""
    grads = {}
    for i in range(mok.num_local_experts):
        if mok.expert_layout is None:
            named = {n: p.grad for n, p in mok.mok.experts.local_experts[i].named_parameters()}
        else:
            named = mok.expert_layout.to_stock({n: getattr(mok.mok.experts, n).grad[i]
                                                for n in mok.expert_layout.mok_names})  # fmt: skip
        grads.update({f"deepspeed_moe.experts.deepspeed_experts.{i}.{n}": g for n, g in named.items()})
    return grads


def _forward_backward(layer, x, probe):
    xi = x.clone().requires_grad_()
    out, l_aux, counts = layer(xi)
    ((out * probe).sum() + l_aux).backward()
    return out.detach(), l_aux.detach(), counts, xi.grad


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_expert_matches_the_stock_layer(ds_world, case):
    name, make, computes = case
    stock, mok = _layers(make)
    assert _computes(mok) == computes
    x = make_layer_inputs(40, H, seed=1).view(4, 10, H)
    probe = make_layer_inputs(40, H, seed=2).view(4, 10, H)
    want_out, want_aux, want_counts, want_dx = _forward_backward(stock, x, probe)
    out, aux, counts, dx = _forward_backward(mok, x, probe)
    assert_close(out, want_out, torch.float32, "output")
    assert_close(aux, want_aux, torch.float32, "l_aux")
    assert torch.equal(counts.to(want_counts.dtype), want_counts)
    assert_close(dx, want_dx, torch.float32, "d_x", n_reduce=3)
    stock_grads = {n: p.grad for n, p in stock.named_parameters()}
    assert_close(mok.mok.router.weight.grad, stock_grads.pop("deepspeed_moe.gate.wg.weight"), torch.float32, "router")
    mok_grads = _mok_expert_grads(mok)
    assert set(mok_grads) == set(stock_grads)  # every expert weight and bias has a gradient
    for key, want in stock_grads.items():
        assert_close(mok_grads[key], want, torch.float32, key, n_reduce=40 * 3)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_checkpoints_both_ways(ds_world, case):
    name, make, _ = case
    stock, mok = _layers(make)  # stock -> MoK (load_state_dict with the stock keys)
    state = mok.state_dict()
    assert set(state) == set(stock.state_dict())
    for key, value in stock.state_dict().items():
        assert torch.equal(state[key], value), key
    fresh = StockMoE(H, make(), num_experts=E, k=3)  # MoK -> stock
    fresh.load_state_dict(state)
    for key, value in stock.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_module_path_warns_once_and_is_bitwise_repeatable(ds_world):
    kwargs = dict(num_experts=E, k=2, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layer = mds.MoE(H, ResidualBlock(), **kwargs)
        x = make_layer_inputs(40, H, seed=3)
        runs = []
        for _ in range(2):
            layer.zero_grad(set_to_none=True)
            out, _, _, dx = _forward_backward(layer, x, make_layer_inputs(40, H, seed=4))
            runs.append([out, dx, *(p.grad.clone() for p in layer.parameters())])
    ours = [str(w.message) for w in caught if "none of MoK's expert families" in str(w.message)]
    assert len(ours) == 1, ours
    assert "ResidualBlock" in ours[0] and "parameters outside linear layers: norm." in ours[0]
    for first, second in zip(*runs, strict=True):
        assert torch.equal(first, second)


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: nn.Sequential(nn.Linear(H, I), nn.GELU(), nn.Dropout(0.1), nn.Linear(I, H)), "matches no MoK family"),
        (lambda: nn.Sequential(nn.Linear(H, H), nn.Linear(H, H)), "matches no MoK family"),
        (lambda: nn.Sequential(nn.Linear(H, I), nn.GELU(), nn.Linear(I, 2 * H)), r"form no MoK family at hidden"),
        (lambda: nn.Linear(H, H).requires_grad_(False), r"frozen parameters"),
    ],
    ids=["dropout", "two_linears", "wrong_output_size", "frozen"],
)
def test_why_a_module_runs_as_itself(ds_world, make, reason):
    with pytest.warns(UserWarning, match=f"none of MoK's expert families \\(.*{reason}"):
        layer = mds.MoE(H, make(), num_experts=E, k=1, drop_tokens=False, use_rts=False)
    assert layer.expert_layout is None


def test_an_expert_the_probe_cannot_run_runs_as_itself_naming_the_failure(ds_world):
    class Picky(GateUpDown):
        def forward(self, x):
            if x.dtype == torch.float64:
                raise TypeError("float32 only")
            return super().forward(x)

    with pytest.warns(UserWarning, match=r"the probe could not run it: TypeError: float32 only"):
        layer = mds.MoE(H, Picky(nn.SiLU()), num_experts=E, k=1, drop_tokens=False, use_rts=False)
    out, _, _ = layer(make_layer_inputs(8, H, seed=5))
    assert out.shape == (8, H)


def test_the_probe_leaves_the_module_and_the_rng_as_they_were(ds_world):
    expert = GateUpDown(nn.GELU(), bias=True).train()
    before = {k: v.clone() for k, v in expert.state_dict().items()}
    state = torch.get_rng_state()
    layout = expert_layout(expert, H)
    assert torch.equal(torch.get_rng_state(), state)
    assert expert.training and all(torch.equal(expert.state_dict()[k], v) for k, v in before.items())
    assert layout.family.describe() == "glu(gelu) + fc1 and fc2 bias"
    # Every local expert starts as the given module's weights, placed in MoK's layout.
    layer = mds.MoE(H, expert, num_experts=E, k=1, drop_tokens=False, use_rts=False)
    gate_up = torch.cat([before["gate_proj.weight"], before["up_proj.weight"]])
    assert torch.equal(layer.mok.experts.gate_up_proj[2], gate_up)
    assert torch.equal(layer.mok.experts.down_bias[3], before["down_proj.bias"])
