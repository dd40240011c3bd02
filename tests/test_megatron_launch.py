"""The Megatron launch paths on the CPU: the --mok* flags (parsed by Megatron's own parser), the
--mok-config file (its accepted keys, the removed `deterministic`, fields that must agree with
Megatron's flags, unreadable files), the launcher running an unmodified Megatron script, the
determinism report, a stock checkpoint with a wrongly shaped expert, and the source patch (applied
to a copy of the installed megatron-core, a layer built through `--moe-token-dispatcher-type mok`,
then reverted)."""

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e .[megatron])")

from megatron.core.transformer import TransformerConfig  # noqa: E402

from mok_plugin.config import MoKConfig, MoKConfigError  # noqa: E402
from mok_plugin.layer import MoKMoE  # noqa: E402
from mok_plugin.megatron import launcher  # noqa: E402
from mok_plugin.megatron.checkpoint import _from_stock  # noqa: E402
from mok_plugin.megatron.config_map import (  # noqa: E402
    MEGATRON_SET,
    MOK_KNOBS,
    mok_config_from_megatron,
)
from mok_plugin.megatron.layer import _DEFAULT_OVERRIDES, set_default_mok_overrides  # noqa: E402

pytestmark = pytest.mark.megatron
ROOT = Path(__file__).resolve().parents[1]
MODEL_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
              "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "2",
              "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32", "--ffn-hidden-size", "64",
              "--swiglu", "--disable-bias-linear", "--train-iters", "2", "--lr", "1e-4", "--mock-data",
              "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--transformer-impl", "local",
              "--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--moe-layer-freq", "[0,1]",
              "--mtp-num-layers", "1", "--position-embedding-type", "rope", "--no-rope-fusion",
              "--no-persist-layer-norm", "--moe-router-load-balancing-type", "none"]  # fmt: skip


@pytest.fixture(autouse=True)
def _no_leftover_knobs():
    """apply_mok_args sets the knobs of every MoKMoELayer built later in this process: reset them
    after each test, so that layers other test files build do not inherit (say) the megakernel."""
    yield
    set_default_mok_overrides({})


def _parse(argv):
    from megatron.training.arguments import parse_args

    old = sys.argv
    sys.argv = ["pretrain", *argv]
    try:
        return parse_args(launcher.add_mok_args)
    finally:
        sys.argv = old


def test_flags_parse_and_set_the_spec_and_knobs(tmp_path):
    knobs = tmp_path / "mok.yaml"
    knobs.write_text("mok:\n  kernel_variant: megakernel\n  ep_exchange: capacity\n  ep_capacity_factor: 3.0\n")
    args = _parse(["--mok", "--mok-config", str(knobs), "--mok-backend", "reference", "--mok-deterministic",
                   *MODEL_ARGS])  # fmt: skip
    # --mok-deterministic sets no knob: MoK's layers are always deterministic; it asks for the report.
    assert launcher.apply_mok_args(args) == {"kernel_variant": "megakernel", "ep_exchange": "capacity",
                                             "ep_capacity_factor": 3.0, "backend": "reference"}  # fmt: skip
    assert args.spec == ["mok_plugin.megatron", "moe_block_spec"]
    assert _DEFAULT_OVERRIDES["backend"] == "reference"
    report = launcher.determinism_report(args)
    assert any("--deterministic-mode" in line for line in report)


def test_flag_errors(tmp_path):
    with pytest.raises(MoKConfigError, match="--mok-backend given without --mok"):
        launcher.apply_mok_args(_parse(["--mok-backend", "triton", *MODEL_ARGS]))
    with pytest.raises(MoKConfigError, match="cannot be combined with --spec"):
        launcher.apply_mok_args(_parse(["--mok", "--spec", "my.module", "my_spec", *MODEL_ARGS]))
    bad = tmp_path / "bad.yaml"
    bad.write_text("kernel_varient: megakernel\n")
    with pytest.raises(MoKConfigError, match="unknown MoK fields \\['kernel_varient'\\]"):
        launcher.apply_mok_args(_parse(["--mok", "--mok-config", str(bad), *MODEL_ARGS]))
    with pytest.raises(SystemExit):  # argparse: a backend that does not exist
        _parse(["--mok", "--mok-backend", "cuda", *MODEL_ARGS])


def _tc(**fields) -> TransformerConfig:
    """A small Megatron MoE config (dropless, no shared expert unless asked)."""
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=16, moe_ffn_hidden_size=16,
                num_moe_experts=8, moe_router_topk=2, gated_linear_unit=True, activation_func=F.silu,
                add_bias_linear=False, use_cpu_initialization=True, gradient_accumulation_fusion=False,
                moe_router_load_balancing_type="none", params_dtype=torch.float32)  # fmt: skip
    return TransformerConfig(**{**base, **fields})


def _knobs_file(tmp_path, text: str) -> Path:
    path = tmp_path / "mok.yaml"
    path.write_text(text)
    return path


def test_knobs_and_megatron_fields_cover_mokconfig():
    assert set(MOK_KNOBS).isdisjoint(MEGATRON_SET)
    assert set(MOK_KNOBS) | set(MEGATRON_SET) == set(MoKConfig.model_fields) == set(launcher.ACCEPTED_KEYS)


def test_mok_config_error_lists_exactly_the_accepted_keys(tmp_path):
    with pytest.raises(MoKConfigError) as info:
        launcher._read_knobs(_knobs_file(tmp_path, "kernel_varient: megakernel\n"))
    listed = str(info.value).split("allowed: ")[1]
    assert set(ast.literal_eval(listed)) == set(launcher.ACCEPTED_KEYS)
    for key in launcher.ACCEPTED_KEYS:  # and every listed key is accepted
        assert launcher._read_knobs(_knobs_file(tmp_path, f"{key}: null\n")) == {key: None}


def test_megatron_values_out_of_bounds_name_the_flag():
    with pytest.raises(MoKConfigError, match=r"mok\.aux_loss_coeff \(--moe-aux-loss-coeff\)=2000\.0"):
        mok_config_from_megatron(_tc(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=2000.0))


def test_mok_config_deterministic_was_removed(tmp_path):
    path = _knobs_file(tmp_path, "mok:\n  deterministic: true\n  backend: reference\n")
    with pytest.raises(MoKConfigError, match=r"mok\.yaml: mok\.deterministic: this key was removed: MoK is always"):
        launcher.apply_mok_args(_parse(["--mok", "--mok-config", str(path), *MODEL_ARGS]))
    with pytest.raises(MoKConfigError, match=r"mok\.deterministic: this key was removed"):
        mok_config_from_megatron(_tc(), {"deterministic": True})


_MEGATRON_SET_CASES = [
    # Token dropping and shared experts are Megatron's to switch on, not the MoK file's.
    ("capacity_factor: 1.0", r"mok\.capacity_factor=1\.0 conflicts with Megatron's setting None "
                             r"\(--moe-expert-capacity-factor\)"),
    ("num_shared_experts: 1", r"mok\.num_shared_experts=1 conflicts with Megatron's setting 0 "
                              r"\(--moe-shared-expert-intermediate-size\)"),
    ("shared_ffn_hidden_size: 32", r"mok\.shared_ffn_hidden_size=32 conflicts .*--moe-shared-expert"),
    ("top_k: 4", r"mok\.top_k=4 conflicts with Megatron's setting 2 \(--moe-router-topk\)"),
    ("score_function: sigmoid", r"mok\.score_function='sigmoid' conflicts .*--moe-router-score-function"),
    ("params_dtype: bfloat16", r"mok\.params_dtype='bfloat16' conflicts .*--bf16 / --fp16"),
]  # fmt: skip


@pytest.mark.parametrize("text, match", _MEGATRON_SET_CASES, ids=[t.split(":")[0] for t, _ in _MEGATRON_SET_CASES])
def test_mok_config_cannot_change_what_megatron_sets(tmp_path, text, match):
    knobs = launcher._read_knobs(_knobs_file(tmp_path, text + "\n"))
    with pytest.raises(MoKConfigError, match=match):
        mok_config_from_megatron(_tc(), knobs)


def test_mok_config_may_repeat_what_megatron_sets(tmp_path):
    knobs = launcher._read_knobs(_knobs_file(tmp_path, "top_k: 2\nnum_experts: 8\ncapacity_factor: null\n"
                                                       "params_dtype: float32\nbackend: reference\n"))  # fmt: skip
    cfg = mok_config_from_megatron(_tc(), knobs)
    assert (cfg.top_k, cfg.capacity_factor, cfg.backend) == (2, None, "reference")
    shared = mok_config_from_megatron(_tc(moe_shared_expert_intermediate_size=32), {"num_shared_experts": 1})
    assert shared.shared_intermediate_size == 32


_ACTIVATION_FLAGS = [
    # (the flags instead of --swiglu, MoK's expert family)
    (["--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0"],
     "glu(quick_gelu, clamp 7.0, offset 1.0)"),
    (["--squared-relu"], "mlp(squared_relu)"),
    ([], "mlp(gelu)"),  # Megatron's default activation
    (["--swiglu"], "SwiGLU"),
]  # fmt: skip


@pytest.mark.parametrize("flags, family", _ACTIVATION_FLAGS, ids=[f for _, f in _ACTIVATION_FLAGS])
def test_activation_flags_through_megatrons_parser(flags, family):
    # Megatron derives gated_linear_unit and activation_func from these flags in
    # core_transformer_config_from_args; MoK's family follows.
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import validate_args

    args = _parse([a for a in MODEL_ARGS if a != "--swiglu"] + flags)
    validate_args(args, {"tokenizer_type": "NullTokenizer"})
    assert mok_config_from_megatron(core_transformer_config_from_args(args)).expert_family.describe() == family


def test_gpt_oss_flags_with_biases():
    # Without --disable-bias-linear Megatron turns the bias-GELU fusion on (--quick-geglu is not
    # --swiglu); SequentialMLP experts then clamp before fc1's bias, TEGroupedMLP ones after it.
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import validate_args

    gpt_oss = ["--quick-geglu", "--glu-linear-offset", "1.0", "--activation-func-clamp-value", "7.0"]
    args = _parse([a for a in MODEL_ARGS if a not in ("--swiglu", "--disable-bias-linear")] + gpt_oss)
    validate_args(args, {"tokenizer_type": "NullTokenizer"})
    tc = core_transformer_config_from_args(args)
    assert tc.add_bias_linear and tc.bias_activation_fusion
    with pytest.raises(MoKConfigError, match="clamps fc1's output before adding its bias.*--no-bias-gelu-fusion"):
        mok_config_from_megatron(tc, stock_experts="SequentialMLP")
    family = mok_config_from_megatron(tc, stock_experts="TEGroupedMLP").expert_family
    assert family.describe() == "glu(quick_gelu, clamp 7.0, offset 1.0) + fc1 and fc2 bias"


def test_mok_config_file_read_errors_name_the_file(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"backend: \xff\n")
    with pytest.raises(MoKConfigError, match=r"--mok-config .*binary\.yaml: not UTF-8 text"):
        launcher._read_knobs(binary)
    with pytest.raises(MoKConfigError, match=r"--mok-config .*missing\.yaml: no such file"):
        launcher._read_knobs(tmp_path / "missing.yaml")
    with pytest.raises(MoKConfigError, match=r"--mok-config .*: is a directory"):
        launcher._read_knobs(tmp_path)
    with pytest.raises(MoKConfigError, match=r"broken\.yaml: not valid YAML"):
        launcher._read_knobs(_knobs_file(tmp_path, "backend: [\n").rename(tmp_path / "broken.yaml"))


def test_stock_checkpoint_with_a_wrongly_shaped_expert_names_the_key():
    class Holder(torch.nn.Module):  # what _from_stock reads of a MoKMoELayer: its `mok`
        def __init__(self):
            super().__init__()
            self.mok = MoKMoE(MoKConfig(hidden_size=32, ffn_hidden_size=16, num_experts=4, top_k=2))

    module = Holder()
    state = {f"experts.local_experts.{i}.linear_fc1.weight": torch.zeros(32, 32) for i in range(4)}
    state.update({f"experts.local_experts.{i}.linear_fc2.weight": torch.zeros(32, 16) for i in range(4)})
    state["experts.local_experts.2.linear_fc1.weight"] = torch.zeros(30, 32)
    with pytest.raises(RuntimeError, match=r"experts\.local_experts\.2\.linear_fc1\.weight: the checkpoint has "
                                           r"shape \[30, 32\], this layer expects \[32, 32\]"):  # fmt: skip
        _from_stock(module, dict(state), "")
    state["experts.local_experts.2.linear_fc1.weight"] = torch.zeros(32, 32)
    state["experts.linear_fc2.weight3"] = state.pop("experts.local_experts.3.linear_fc2.weight").T  # TEGroupedMLP key
    with pytest.raises(RuntimeError, match=r"experts\.linear_fc2\.weight3: the checkpoint has shape \[16, 32\]"):
        _from_stock(module, dict(state), "")


def _run_entry(command, env=None):
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    line = next(line for line in run.stdout.splitlines() if line.startswith("MLPS="))
    return json.loads(line[len("MLPS=") :]), run.stdout


@pytest.mark.slow
def test_launcher_runs_an_unmodified_megatron_script():
    script = "tests/data/stock_entry.py"
    stock, _ = _run_entry([sys.executable, script, *MODEL_ARGS])
    assert set(stock.values()) == {"MLP", "MoELayer"}
    mok, out = _run_entry([sys.executable, "-m", "mok_plugin.megatron.launcher", script, "--mok",
                           "--mok-deterministic", *MODEL_ARGS])  # fmt: skip
    assert {k: v.replace("MoKMoELayer", "MoELayer") for k, v in mok.items()} == stock
    assert sum(v == "MoKMoELayer" for v in mok.values()) == 2  # decoder layer 2 and the MTP layer
    assert "MoK determinism report" in out


@pytest.mark.slow
def test_source_patch_on_a_copy_of_the_installed_package(tmp_path):
    import megatron.core

    shutil.copytree(Path(megatron.core.__file__).parents[1], tmp_path / "megatron")
    patches = [sys.executable, "scripts/patches.py"]
    check = subprocess.run([*patches, "check", "megatron", "--target", str(tmp_path)], cwd=ROOT)
    assert check.returncode == 1  # not applied yet
    for _ in range(2):  # idempotent
        assert subprocess.run([*patches, "apply", "megatron", "--target", str(tmp_path)], cwd=ROOT).returncode == 0
    assert subprocess.run([*patches, "check", "megatron", "--target", str(tmp_path)], cwd=ROOT).returncode == 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    args = [a for a in MODEL_ARGS if a != "--use-cpu-initialization"] + ["--use-cpu-initialization"]
    mlps, _ = _run_entry([sys.executable, "tests/data/stock_entry.py", "--moe-token-dispatcher-type", "mok", *args],
                         env=env)  # fmt: skip
    assert sorted(mlps.values()) == ["MLP", "MoKMoELayer", "MoKMoELayer"]
    assert subprocess.run([*patches, "revert", "megatron", "--target", str(tmp_path)], cwd=ROOT).returncode == 0
    assert subprocess.run([*patches, "check", "megatron", "--target", str(tmp_path)], cwd=ROOT).returncode == 1
