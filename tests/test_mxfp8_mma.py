"""The mxfp8 recipe's GEMMs by block-scaled MMA (kernels/mxfp8.py, issue 25): the kernel against the
float64 product of the dequantised operands (formats, ragged K, M and N, strided operands, the sum
into an existing output), the same bits twice; the experts with it against MoK's mxfp8 oracle (the
same products summed in another order: within fp32's rounding of it, for every family, with a glu
whose halves' blocks restart inside a 32-block); where it is chosen (MOK_MXFP8_MMA); and compiled
for Blackwell (sm_100) on the CPU, Triton's block-scaled tcgen05 MMA in its PTX. Runs under Triton's
interpreter on the CPU and compiled on a GPU (Hopper emulates the block-scaled MMA)."""

import re

import pytest
import torch

pytest.importorskip("triton", reason="the block-scaled MMA kernel needs triton")

from triton_cases import outside_the_interpreter  # noqa: E402

from mok_plugin.fp8.experts import MXFP8_MMA_SETTING, block_scaled_mma_chosen  # noqa: E402
from mok_plugin.fp8.quantize import dequantize_mxfp8, quantize_mxfp8  # noqa: E402
from mok_plugin.fp8.recipe import E4M3, E5M2, BlockwiseFP8Recipe, MXFP8Recipe  # noqa: E402
from mok_plugin.fp8.reference import moe_experts_fp8_reference  # noqa: E402
from mok_plugin.kernels.mxfp8 import mx_matmul  # noqa: E402
from mok_plugin.schedule import build_schedule  # noqa: E402
from mok_plugin.testing import EXPERT_FAMILIES  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # (the CPU: Triton's interpreter, tests/conftest.py)


def _quantised(shape, fmt, generator, scale=1.0, transposed=False):
    """(values, E8M0 exponents) of fresh random values quantised along their last dim, on DEVICE; both
    as transposed views of column-major copies where asked (strides that are not row-major)."""
    values = torch.randn(shape, generator=generator) * scale
    data, exponents = quantize_mxfp8(values, fmt, -1)
    if transposed:
        data, exponents = data.t().contiguous().t(), exponents.t().contiguous().t()
    return data.to(DEVICE), exponents.to(DEVICE)


def _float64_product(a, a_e, b, b_e):
    return (
        dequantize_mxfp8(a.cpu(), a_e.cpu(), dtype=torch.float64)
        @ dequantize_mxfp8(b.cpu(), b_e.cpu(), dtype=torch.float64).T
    )


@pytest.mark.parametrize(
    "M, N, K, fa, fb, transposed",
    [
        pytest.param(37, 50, 100, E4M3, E4M3, False, id="ragged_K_M_N"),
        pytest.param(16, 24, 16, E4M3, E4M3, False, id="K_under_a_block"),
        pytest.param(70, 33, 300, E5M2, E4M3, True, id="e5m2_by_e4m3_strided"),
        pytest.param(20, 40, 256, E4M3, E5M2, False, id="K_whole_tiles"),
        pytest.param(150, 130, 96, E4M3, E4M3, True, id="several_tiles_each_way_strided"),
    ],
)
def test_mx_matmul_is_the_product_of_the_dequantised_operands(M, N, K, fa, fb, transposed):
    g = torch.Generator().manual_seed(M + N + K)
    a, a_e = _quantised((M, K), fa, g, scale=30.0, transposed=transposed)
    b, b_e = _quantised((N, K), fb, g, scale=0.01, transposed=transposed)  # far apart: the exponents carry it
    got = mx_matmul(a, a_e, fa, b, b_e, fb)
    want = _float64_product(a, a_e, b, b_e)
    assert got.dtype == torch.float32 and got.shape == (M, N)
    # each product exact in fp32, the sums rounded in fp32
    assert ((got.cpu().double() - want).norm() / want.norm()).item() < 1e-6
    assert torch.equal(mx_matmul(a, a_e, fa, b, b_e, fb), got)


def test_mx_matmul_adds_into_out_and_refuses_what_does_not_fit():
    g = torch.Generator().manual_seed(1)
    a, a_e = _quantised((24, 64), E4M3, g)
    b, b_e = _quantised((40, 64), E4M3, g)
    start = torch.randn(24, 40, generator=g).to(DEVICE)
    got = mx_matmul(a, a_e, E4M3, b, b_e, E4M3, out=start.clone())
    want = start.cpu().double() + _float64_product(a, a_e, b, b_e)
    assert ((got.cpu().double() - want).norm() / want.norm()).item() < 1e-6
    with pytest.raises(ValueError, match=r"expected \[M, K\]"):
        mx_matmul(a, a_e, E4M3, b[:, :32], b_e[:, :1], E4M3)
    with pytest.raises(ValueError, match="expected e5m2's"):
        mx_matmul(a, a_e, E5M2, b, b_e, E4M3)
    with pytest.raises(ValueError, match="uint8"):
        mx_matmul(a, a_e.int(), E4M3, b, b_e, E4M3)
    with pytest.raises(ValueError, match="out must be fp32"):
        mx_matmul(a, a_e, E4M3, b, b_e, E4M3, out=start.bfloat16())


def _relative(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30)).item()


def _small_experts(family, I, seed):
    """Fresh random operands of a small experts problem on DEVICE (T = 40, H = 64, E = 3, K = 2); a
    glu's up rows of W13 2^10 times its gate rows: a block that took both halves' values would flush
    the gate's to FP8's subnormals (a power-of-two scale moves no other value's rounding)."""
    g = torch.Generator().manual_seed(seed)
    T, H, E, K = 40, 64, 3, 2
    fc1 = family.fc1_width(I)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    made = {
        "x": torch.randn(T, H, generator=g).bfloat16(),
        "topk_weights": torch.rand(T, K, generator=g).softmax(-1),
        "gate_up_proj": (torch.randn(E, fc1, H, generator=g) / H**0.5 * _up_louder(family, I, fc1)).bfloat16(),
        "down_proj": (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16(),
        "gate_up_bias": (torch.randn(E, fc1, generator=g) * 0.1).bfloat16() if family.fc1_bias else None,
        "down_bias": (torch.randn(E, H, generator=g) * 0.1).bfloat16() if family.fc2_bias else None,
        "d_out": torch.randn(T, H, generator=g).bfloat16(),
    }
    made = {k: None if v is None else v.to(DEVICE) for k, v in made.items()}
    return made, build_schedule(ids.to(DEVICE), E)


def _up_louder(family, I, fc1):
    """[fc1, 1]: 2^10 on a glu's up rows, 1 elsewhere."""
    return torch.where(torch.arange(fc1)[:, None] >= I, 2.0**10 if family.gated else 1.0, 1.0)


def _both_ways(family, I, seed):
    """The mxfp8 experts (hybrid) with their GEMMs by dequantised fp64 products and by the kernel,
    and the kernel's again."""
    inputs, schedule = _small_experts(family, I, seed)

    def experts(mma):
        return moe_experts_fp8_reference(
            inputs["x"], inputs["topk_weights"], inputs["gate_up_proj"], inputs["down_proj"], schedule,
            MXFP8Recipe(E4M3, E5M2), d_out=inputs["d_out"], family=family, gate_up_bias=inputs["gate_up_bias"],
            down_bias=inputs["down_bias"], block_scaled_mma=mma, compute_dtype=torch.float64,
        )  # fmt: skip

    return experts(False), experts(True), experts(True)


# (family, I): I = 48, a glu's gate ending inside a 32-block and its up starting there (dX's GEMM
# over both halves is two products summed, the oracle's blocks per half); 64: whole blocks
@pytest.mark.parametrize("family_name, I", [("swiglu", 48), ("gpt_oss", 64), ("mlp_gelu_bias", 48)])
def test_experts_by_block_scaled_mma_are_the_oracles_numbers(family_name, I):
    # The same quantised operands, their products summed in fp32 by the kernel rather than in fp64:
    # within fp32's rounding of the oracle on every output and gradient (a wrong block, exponent or
    # layout would be off by FP8's margin, ~3e-2), most of them bit for bit after the bf16 rounding.
    want, got, again = _both_ways(EXPERT_FAMILIES[family_name], I, seed=3)
    for name, value in want.items():
        if value is not None:
            assert _relative(got[name], value) < 1e-4, name
    assert all(v is None or torch.equal(again[k], v) for k, v in got.items())


def test_where_the_block_scaled_mma_is_chosen(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(MXFP8_MMA_SETTING, raising=False)
    assert not block_scaled_mma_chosen(MXFP8Recipe(), cpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert not block_scaled_mma_chosen(MXFP8Recipe(), torch.device("cuda", 0))  # opt-in on Blackwell too
    monkeypatch.setenv(MXFP8_MMA_SETTING, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert block_scaled_mma_chosen(MXFP8Recipe(), cpu)
    assert not block_scaled_mma_chosen(BlockwiseFP8Recipe(), cpu)  # mxfp8's only
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not block_scaled_mma_chosen(MXFP8Recipe(), cpu)  # a CPU tensor without the interpreter
    monkeypatch.setenv(MXFP8_MMA_SETTING, "0")
    assert not block_scaled_mma_chosen(MXFP8Recipe(), cpu)
    monkeypatch.setenv(MXFP8_MMA_SETTING, "yes")
    with pytest.raises(ValueError, match=f"{MXFP8_MMA_SETTING}='yes'"):
        block_scaled_mma_chosen(MXFP8Recipe(), cpu)
    monkeypatch.setenv(MXFP8_MMA_SETTING, "1")
    assert block_scaled_mma_chosen(MXFP8Recipe(), torch.device("cuda", 0))  # a CUDA device, asked for


BLACKWELL_MMA = r"tcgen05\.mma\.cta_group::1\.kind::mxf8f6f4\.block_scale"
HOPPER_BF16_MMA = r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16"


@pytest.mark.parametrize("arch, instruction", [(100, BLACKWELL_MMA), (90, HOPPER_BF16_MMA)])
def test_compiles_to_blackwells_block_scaled_mma(arch, instruction):
    # On sm_100 Triton lowers the kernel's dot_scaled to tcgen05's block-scaled MMA (the E8M0 scales
    # handed to the instruction); on Hopper it scales the operands into bf16 for wgmma.
    code = (
        "from triton.backends.compiler import GPUTarget\n"
        "from triton.compiler import ASTSource\n"
        "import triton\n"
        "from mok_plugin.kernels import mxfp8\n"
        "fn = mxfp8._mx_matmul_kernel\n"
        "const = dict(A_FORMAT='e4m3', B_FORMAT='e5m2', ACCUMULATE=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128)\n"
        "ptr = {'a_ptr': '*fp8e4nv', 'b_ptr': '*fp8e5', 'a_scale_ptr': '*u8', 'b_scale_ptr': '*u8',\n"
        "       'out_ptr': '*fp32'}\n"
        "sig = {n: 'constexpr' if n in const else ptr.get(n, 'i32') for n in fn.arg_names}\n"
        "attrs = {(i,): [['tt.divisibility', 16]] for i, n in enumerate(fn.arg_names) if n in ptr}\n"
        "src = ASTSource(fn=fn, signature=sig, attrs=attrs,\n"
        "                constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})\n"
        f"k = triton.compile(src, target=GPUTarget('cuda', {arch}, 32), options={{'num_warps': 8, 'num_stages': 3}})\n"
        "print(k.asm['ptx'])\n"
    )
    ptx = outside_the_interpreter("-c", code)
    assert re.search(instruction, ptx), f"sm_{arch}: no {instruction} in the PTX"


def test_the_layer_takes_it_where_chosen_and_repeats_bitwise(monkeypatch):
    # mok.fp8_scaling=mxfp8 with MOK_MXFP8_MMA=1 (on the CPU: Triton's interpreter; on a GPU without
    # Blackwell: Triton's emulation): one training step within fp32's rounding of the dequantised
    # GEMMs' step, the same bits twice.
    from fp8_cases import train_step

    from mok_plugin.config import MoKConfig
    from mok_plugin.layer import MoKMoE
    from mok_plugin.testing import make_layer_inputs

    cfg = MoKConfig(hidden_size=64, ffn_hidden_size=48, num_experts=3, top_k=2, fp8="hybrid", fp8_scaling="mxfp8",
                    backend="reference")  # fmt: skip
    from mok_plugin.kernels import mxfp8

    x = make_layer_inputs(24, 64, seed=2).to(DEVICE)
    launches = []
    monkeypatch.setattr(mxfp8, "mx_matmul", lambda *a, **k: launches.append(1) or mx_matmul(*a, **k))
    monkeypatch.setenv(MXFP8_MMA_SETTING, "0")
    want = train_step(MoKMoE(cfg, seed=0, device=DEVICE), x)
    assert not launches
    monkeypatch.setenv(MXFP8_MMA_SETTING, "1")
    got = train_step(MoKMoE(cfg, seed=0, device=DEVICE), x)
    assert len(launches) >= 3 * 6  # six GEMMs an expert (dX's two halves: seven)
    for name, value in want.items():
        assert _relative(got[name], value) < 1e-4, name
    again = train_step(MoKMoE(cfg, seed=0, device=DEVICE), x)
    assert all(torch.equal(again[name], value) for name, value in got.items())
