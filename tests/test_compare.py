"""The comparison harness (`mok_plugin.compare`, scripts/compare.py, scripts/main.sh's job) on the tiny
CPU config, and scripts/pretrain_gpt.py's CUDA check.

Covers: the synthetic language is seeded and has the structure it claims; end to end through
Megatron's and DeepSpeed's MoE layers, the JSON holds every field the report promises, the loss falls
over a few steps, the stock and MoK losses agree (DeepSpeed's top-2 l_aux included: MoK computes
DeepSpeed's gate), MoK's two runs are bitwise equal, the memory column names its
source, the output folder defaults to out/compare/<framework>, the frameworks' warnings go to
compare.log and not the console; the report says how far apart the losses are; configs for
other machines are refused on the CPU; pretrain_gpt.py without CUDA stops in one line.
The stock side: which stock path is chosen (Transformer Engine importable on a GPU or not, through
monkeypatched checks, since TE is not installed here), that the TE path asks Megatron's own TE spec
for grouped GEMM, that TEGroupedMLP's state-dict keys load into every variant, that the report
states the stock path and why, and that the grouped_mm stand-in computes Megatron's experts and
shows its row with numbers or with the reason it could not run.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from mok_plugin.compare import stock_path as sp
from mok_plugin.compare.data import SUCCESSORS, BigramLanguage, make_batches
from mok_plugin.compare.report import agreement_note, format_table

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "topologies" / "tiny_cpu.yaml"


def test_synthetic_language_is_seeded_and_follows_its_grammar():
    a, b = make_batches(512, 3, 2, 65), make_batches(512, 3, 2, 65)
    assert len(a) == 3 and all(t.shape == (2, 65) and t.dtype == torch.int64 for t in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))  # same seed, same tokens
    assert not torch.equal(make_batches(512, 1, 2, 65, seed=7)[0], a[0])
    language = BigramLanguage.make(512)
    position = {int(w): i for i, w in enumerate(language.words)}
    tokens = torch.cat(a).flatten(0)
    assert set(tokens.tolist()) <= set(position)  # only the language's words
    for row in torch.cat(a):  # every transition is one the grammar allows
        for current, following in zip(row[:-1].tolist(), row[1:].tolist(), strict=True):
            assert position[following] in language.successors[position[current]].tolist()
    assert 0 < language.entropy <= torch.log(torch.tensor(float(SUCCESSORS))).item()


def _compare(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """scripts/compare.py run from tmp_path (so the default output folder lands there)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compare.py"), "--device", "cpu", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["megatron", "deepspeed"])
def test_compare_tiny_config(tmp_path, framework):
    pytest.importorskip({"megatron": "megatron.core", "deepspeed": "deepspeed"}[framework])
    run = _compare(tmp_path, "--config", str(TINY), "--framework", framework, "--steps", "4")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = tmp_path / "out" / "compare" / framework  # the default folder, one per framework
    assert "MoK / stock tokens/s" in run.stdout and str(Path("out/compare") / framework / "comparison.md") in run.stdout
    # The console has the table and the progress bar; the frameworks' warnings are in the log.
    assert "UserWarning:" not in run.stdout + run.stderr and "compare.log" in run.stdout
    assert (out / "compare.log").exists()
    result = json.loads((out / "comparison.json").read_text())
    assert [(r["variant"], r["repeat"]) for r in result["runs"]] == [("stock", 1), ("stock", 2), ("mok", 1), ("mok", 2)]
    for r in result["runs"]:
        assert len(r["losses"]) == 4 and r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["peak_memory_mib"] > 0
        assert r["losses"][-1] < r["losses"][0] - 0.1, r["losses"]  # the synthetic language is being learnt
    assert result["bitwise"] == {"stock": True, "mok": True}  # on the CPU both paths repeat exactly
    assert set(result["summary"]["stock"]) == {"step_ms", "tokens_per_s", "peak_memory_mib", "first_loss", "final_loss"}
    # Same weights and tokens, no drop, no noise: the two layers train the same model, step by step.
    for a, b in zip(result["runs"][0]["losses"], result["runs"][2]["losses"], strict=True):
        assert abs(a - b) < 1e-4, (result["runs"][0]["losses"], result["runs"][2]["losses"])
    assert "CPU" in result["meta"]["mode"] and result["meta"]["framework"] == framework
    assert "MemTracker" in result["meta"]["memory_kind"] and "MemTracker" in run.stdout  # names its source
    assert "peak bytes held by tensors" in (out / "comparison.md").read_text()
    assert (out / "comparison.md").read_text().startswith("# MoK vs stock")
    assert (out / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    # The stock path that ran, and why; the grouped_mm stand-in's row with its numbers or its reason.
    stock_line = run.stdout.split("stock: ", 1)[1].splitlines()[0]
    assert stock_line == result["stock_path"]["description"]
    assert f"- stock: {stock_line}" in (out / "comparison.md").read_text()
    stand_in = result["stand_in"]
    if framework == "deepspeed":
        assert stock_line.startswith("DeepSpeed deepspeed.moe.layer.MoE") and not stand_in["ran"]
        assert f"grouped_mm* not run: {stand_in['reason']}" in run.stdout
        return
    assert stock_line.startswith("Megatron SequentialMLP (local spec) — Transformer Engine ")
    assert "so TEGroupedMLP/grouped GEMM cannot run" in stock_line
    assert "* grouped_mm: stand-in for a grouped stock path" in run.stdout
    if not stand_in["ran"]:  # a torch without a CPU grouped_mm: the row says why
        assert f"grouped_mm* not run: {stand_in['reason']}" in run.stdout and "grouped_mm" in stand_in["reason"]
        return
    row = next(line for line in run.stdout.splitlines() if line.startswith("grouped_mm* "))
    # The console prints tokens/s with no decimals: the same number, rounded to the unit.
    assert float(row.split()[2]) == pytest.approx(stand_in["summary"]["tokens_per_s"], abs=0.5)
    assert "| grouped_mm\\* |" in (out / "comparison.md").read_text()
    assert [(r["variant"], r["repeat"]) for r in stand_in["runs"]] == [("grouped_mm", 1), ("grouped_mm", 2)]
    assert stand_in["bitwise"] is True and "MoK / grouped_mm tokens/s" in run.stdout
    for a, b in zip(result["runs"][0]["losses"], stand_in["runs"][0]["losses"], strict=True):
        assert abs(a - b) < 1e-4  # the same model: only the expert GEMMs differ


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["megatron", "deepspeed"])
def test_compare_trains_the_config_expert_family(tmp_path, framework):
    # A GPT-OSS-like expert (clamped quick-GeGLU with offset and both biases; the clamp small enough
    # to bind): the stock and MoK layers compute that MLP, not SwiGLU, so their losses agree.
    pytest.importorskip({"megatron": "megatron.core", "deepspeed": "deepspeed"}[framework])
    data = yaml.safe_load(TINY.read_text())
    data["model"].update(expert_activation="quick_gelu", activation_clamp=0.1, glu_linear_offset=1.0,
                         expert_fc1_bias=True, expert_fc2_bias=True)  # fmt: skip
    config = tmp_path / "tiny_gpt_oss.yaml"
    config.write_text(yaml.safe_dump(data))
    run = _compare(tmp_path, "--config", str(config), "--framework", framework, "--steps", "3")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "compare" / framework / "comparison.json").read_text())
    assert "glu(quick_gelu, clamp 0.1, offset 1.0) + fc1 and fc2 bias" in result["meta"]["model"]
    for a, b in zip(result["runs"][0]["losses"], result["runs"][2]["losses"], strict=True):
        assert abs(a - b) < 1e-4, (result["runs"][0]["losses"], result["runs"][2]["losses"])
    if result["stand_in"]["ran"]:  # the grouped_mm stand-in computes the same family (clamps, offset, biases)
        for a, b in zip(result["runs"][0]["losses"], result["stand_in"]["runs"][0]["losses"], strict=True):
            assert abs(a - b) < 1e-4, (result["runs"][0]["losses"], result["stand_in"]["runs"][0]["losses"])


def _tiny_gpt_moe(tmp_path: Path, random: bool, top_k: int = 1) -> Path:
    """The tiny config with the Megatron-DeepSpeed GPT-MoE gating (configs/topologies/megatron-deepspeed-
    gpt-moe_h200_single.yaml's): GeLU MLP experts with biases, capacity 1.0, min_capacity 4, dropping;
    use_rts and Jitter on, or every random option off."""
    data = yaml.safe_load(TINY.read_text())
    data["model"].update(top_k=top_k, expert_kind="mlp", expert_activation="gelu", expert_fc1_bias=True,
                         expert_fc2_bias=True)  # fmt: skip
    data["mok"].update(norm_topk_prob=top_k > 1, aux_loss_coeff=0.01 if random else 0.0)
    data["deepspeed"] = dict(capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4, drop_tokens=True,
                             use_rts=random, noisy_gate_policy="Jitter" if random else None,
                             top2_2nd_expert_sampling=random)  # fmt: skip
    config = tmp_path / f"tiny_gpt_moe_{'random' if random else 'fixed'}_top{top_k}.yaml"
    config.write_text(yaml.safe_dump(data))
    return config


@pytest.mark.slow
def test_compare_deepspeed_gating_from_the_config(tmp_path):
    # DeepSpeed's gating from the run config's deepspeed section, given to both layers. With dropping
    # and nothing random they route, drop and train alike: top-2, whose keep order DeepSpeed fixes (first
    # choices, then token order); top-1 without RTS keeps an implementation-defined set of tied tokens
    # in DeepSpeed (torch.topk over a 0/1 mask; tests/test_deepspeed_models.py). With use_rts and Jitter
    # each layer draws its own noise (the stock layer torch's, MoK its stream), so only MoK's two runs
    # must be equal.
    pytest.importorskip("deepspeed")
    run = _compare(tmp_path, "--config", str(_tiny_gpt_moe(tmp_path, random=False, top_k=2)), "--framework",
                   "deepspeed", "--steps", "4", "--out", "fixed")  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "fixed" / "comparison.json").read_text())
    assert result["meta"]["deepspeed"]["drop_tokens"] is True and result["meta"]["random_routing"] == []
    assert "capacity factor 1 (eval 1), min_capacity 4, drop_tokens; random routing: none" in result["meta"]["model"]
    assert result["bitwise"]["mok"] is True
    for a, b in zip(result["runs"][0]["losses"], result["runs"][2]["losses"], strict=True):
        assert abs(a - b) < 1e-4, (result["runs"][0]["losses"], result["runs"][2]["losses"])
    assert "the losses agree" in run.stdout
    run = _compare(tmp_path, "--config", str(_tiny_gpt_moe(tmp_path, random=True)), "--framework", "deepspeed",
                   "--steps", "4", "--out", "random")  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "random" / "comparison.json").read_text())
    assert result["meta"]["random_routing"] == ["noisy_gate_policy=Jitter", "use_rts"]
    assert result["bitwise"]["mok"] is True  # MoK's runs repeat bitwise with random routing (the stock's need not)
    mok = [r for r in result["runs"] if r["variant"] == "mok"]
    assert mok[0]["losses"] == mok[1]["losses"] and mok[0]["aux_losses"] == mok[1]["aux_losses"]
    assert "the losses differ by design" in run.stdout


def test_compare_megatron_refuses_the_deepspeed_section(tmp_path):
    # The section states DeepSpeed's gating; Megatron's layer has none of it: an error naming the section.
    run = _compare(tmp_path, "--config", str(_tiny_gpt_moe(tmp_path, random=False)), "--framework", "megatron",
                   "--steps", "2")  # fmt: skip
    assert run.returncode == 2, run.stdout[-3000:] + run.stderr[-3000:]
    assert "deepspeed: this section states DeepSpeed's MoE gating" in run.stderr
    assert "applies to --framework deepspeed only" in run.stderr


def test_harness_deepspeed_gating_without_the_section():
    # No deepspeed section: the harness's dropless, noise-free gating, as before the section existed;
    # with one, DeepSpeed's defaults for the keys it leaves out.
    from mok_plugin.compare.models import HARNESS_DEEPSPEED, deepspeed_gating, describe_gating, random_options
    from mok_plugin.run.topology import load_topology

    run = load_topology(TINY)
    assert run.deepspeed is None and deepspeed_gating(run) is HARNESS_DEEPSPEED
    assert HARNESS_DEEPSPEED.moe_kwargs() == dict(capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4,
                                                  drop_tokens=False, use_rts=False, noisy_gate_policy=None,
                                                  top2_2nd_expert_sampling=False)  # fmt: skip
    assert describe_gating(HARNESS_DEEPSPEED, 2) == "dropless; random routing: none"
    gpt = load_topology(ROOT / "configs/topologies/megatron-deepspeed-gpt-moe_h200_single.yaml")
    assert deepspeed_gating(gpt) is gpt.deepspeed and random_options(gpt.deepspeed, 1) == ["use_rts"]
    assert random_options(gpt.deepspeed, 2) == ["top2_2nd_expert_sampling"]  # DeepSpeed's default at k = 2


def test_compare_refuses_a_family_megatron_cannot_express(tmp_path):
    pytest.importorskip("megatron.core")
    data = yaml.safe_load(TINY.read_text())
    data["model"].update(expert_fc1_bias=True)  # Megatron's --add-bias-linear sets both biases
    config = tmp_path / "one_bias.yaml"
    config.write_text(yaml.safe_dump(data))
    run = _compare(tmp_path, "--config", str(config), "--framework", "megatron", "--steps", "2")
    assert run.returncode == 2 and "model.expert_fc1_bias=True, model.expert_fc2_bias=False" in run.stderr


def _result(framework: str, top_k: int, stock_aux: list[float] | None, mok_aux: list[float] | None) -> dict:
    runs = [{"variant": v, "repeat": r, "losses": [6.2, 5.0] if v == "stock" else [6.2, 5.1],
             "aux_losses": stock_aux if v == "stock" else mok_aux} for v, r in
            (("stock", 1), ("stock", 2), ("mok", 1), ("mok", 2))]  # fmt: skip
    summary = {v: {"step_ms": 1.0, "tokens_per_s": 100.0, "peak_memory_mib": 2.5, "first_loss": 6.2,
                   "final_loss": 5.0} for v in ("stock", "mok")}  # fmt: skip
    meta = {"framework": framework, "top_k": top_k, "aux_loss_coeff": 0.01, "memory_kind": "SOURCE"}
    data = {"kind": "a language", "uniform_loss": 6.24, "entropy": 1.08, "learning_rate": 0.01}
    return {"runs": runs, "summary": summary, "bitwise": {"stock": True, "mok": True}, "meta": meta, "data": data}


def test_report_says_how_far_apart_the_losses_are():
    # 5.0 vs 5.1 is a real difference, not rounding: said so, with the step, under either framework
    # (DeepSpeed's top-2 l_aux is computed by MoK as DeepSpeed does: no difference to explain away).
    for framework, aux in (("deepspeed", [2.0, 1.9]), ("megatron", None)):
        assert "differ by up to 1.0e-01 (step 2" in agreement_note(_result(framework, 2, aux, aux)), framework
    table = format_table(_result("megatron", 2, None, None))
    assert "peak MiB: SOURCE" in table and "first loss" in table


def test_report_says_when_losses_agree_and_when_training_diverged():
    result = _result("megatron", 2, None, None)
    for run in result["runs"]:
        run["losses"] = [6.2, 5.0 + (2e-7 if run["variant"] == "mok" else 0.0)]
    assert agreement_note(result).startswith("the losses agree to 2.0e-07 at every step")
    for run in result["runs"]:  # as on the H200 at too high a learning rate: 6.23 -> 2e4
        run["losses"] = [6.23, 21955.9] if run["variant"] == "stock" else [6.23, 16507.4]
    note = agreement_note(result)
    assert "differ by up to 5.4e+03" in note and "training diverged at this learning rate" in note


def test_report_measures_fp8_losses_against_the_target_from_step_50():
    result = _result("megatron", 2, None, None)
    result["meta"]["fp8"] = "e4m3"
    bf16 = [6.0 - 0.01 * i for i in range(60)]
    for run in result["runs"]:  # early steps far off (not counted), then 0.3 % off, 0.5 % at step 50
        fp8 = [v * (1.2 if i < 49 else 1.005 if i == 49 else 1.003) for i, v in enumerate(bf16)]
        run["losses"] = bf16 if run["variant"] == "stock" else fp8
    assert agreement_note(result).endswith("from step 50 its losses differ from the stock layer's (unquantised) by at "
                                           "most 0.50% (step 50), within the 1% target")  # fmt: skip
    result["runs"][2]["losses"][54] *= 1.02
    assert "(step 55), OUTSIDE the 1% target" in agreement_note(result)
    # with MoK's own bf16 run (deterministic: FP8 alone differs), the target is taken against it
    result["fp8_reference"] = {"losses": [v * 1.001 for v in bf16]}
    note = agreement_note(result)
    assert "differ from MoK's bf16 run's by at most 2.20% (step 55), OUTSIDE the 1% target, and from the stock" in note
    assert "for scale" not in note  # the stock layer's two runs equal (as on the CPU): nothing to scale by
    result["runs"][1]["losses"] = [v * (1.004 if i == 49 else 1.0) for i, v in enumerate(bf16)]
    note = agreement_note(result)
    assert note.endswith("; for scale, the stock layer's own two runs differ by up to 0.40% (step 50)")


@pytest.mark.slow
@pytest.mark.parametrize("framework, scaling", [("megatron", None), ("deepspeed", None), ("megatron", "mxfp8"),
                                               ("deepspeed", "tensorwise")])  # fmt: skip
def test_compare_fp8_runs_moks_experts_in_fp8(tmp_path, framework, scaling):
    pytest.importorskip({"megatron": "megatron.core", "deepspeed": "deepspeed"}[framework])
    recipe = [] if scaling is None else ["--fp8-scaling", scaling]
    run = _compare(tmp_path, "--config", str(TINY), "--framework", framework, "--steps", "3", "--fp8", "hybrid",
                   *recipe)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "compare" / framework / "comparison.json").read_text())
    assert result["meta"]["fp8"] == "hybrid" and result["bitwise"]["mok"] is True
    assert result["meta"]["fp8_scaling"] == (scaling or "blockwise")
    assert f"MoK's experts run {scaling or 'blockwise'} FP8 (hybrid)" in run.stdout
    assert "from MoK's bf16 run's" in run.stdout
    stock, mok = result["runs"][0]["losses"], result["runs"][2]["losses"]
    bf16 = result["fp8_reference"]["losses"]
    assert result["fp8_reference"]["variant"] == "mok bf16" and len(bf16) == 3
    for reference in (stock, bf16):  # quantised, not the unquantised layer, and close to it
        gaps = [abs(a - b) / b for a, b in zip(mok, reference, strict=True)]
        assert 1e-6 < max(gaps) < 0.01, gaps
    assert max(abs(a - b) for a, b in zip(bf16, stock, strict=True)) < 1e-4  # MoK bf16 = stock on the CPU


def test_compare_micro_batch_sets_the_sequences_a_step(tmp_path):
    pytest.importorskip("megatron.core")
    run = _compare(tmp_path, "--config", str(TINY), "--steps", "2", "--micro-batch", "3")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "compare" / "megatron" / "comparison.json").read_text())
    from mok_plugin.run.topology import load_topology

    seq_length = load_topology(TINY).parallel.seq_length
    assert result["meta"]["tokens_per_step"] == 3 * seq_length
    assert f"2 steps x {3 * seq_length} tokens" in run.stdout
    bad = _compare(tmp_path, "--config", str(TINY), "--micro-batch", "0")
    assert bad.returncode == 2 and "--micro-batch=0: at least 1 sequence a step" in bad.stderr
    # validated as the config's own value is: a batch that cannot fit is refused before any run
    huge = _compare(tmp_path, "--config", str(TINY), "--micro-batch", "100000000")
    assert huge.returncode == 2 and "the layout does not fit CPU memory" in huge.stderr


def test_compare_fp8_scaling_needs_fp8(tmp_path):
    run = _compare(tmp_path, "--config", str(TINY), "--fp8-scaling", "tensorwise")
    assert run.returncode == 2 and "--fp8-scaling tensorwise: needs --fp8" in run.stderr


# ------------------------------------------------------------------------------------------------
# The stock side: which stock path, said in the report; the grouped_mm stand-in
# ------------------------------------------------------------------------------------------------


def _fake_te(monkeypatch, version: str | None, grouped_linear: bool = True, permute_fusion: bool = True) -> None:
    """Transformer Engine importable (`version`) or not (None), without importing it."""
    status = (version, "") if version else (None, "No module named 'transformer_engine'")
    monkeypatch.setattr(sp, "transformer_engine_status", lambda: status)
    capabilities = {"grouped_linear": grouped_linear, "permute_fusion": permute_fusion}
    monkeypatch.setattr(sp, "transformer_engine_capabilities", lambda: capabilities)


CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def test_stock_path_is_te_grouped_gemm_where_te_imports_on_a_gpu(monkeypatch):
    _fake_te(monkeypatch, "2.8.0")
    path = sp.select_stock_path("megatron", CUDA)
    assert (path.experts, path.transformer_engine) == ("TEGroupedMLP", True)
    assert path.config_options() == {"moe_grouped_gemm": True, "moe_permute_fusion": True}
    assert path.describe() == (
        "Megatron TEGroupedMLP (Transformer Engine spec: moe_grouped_gemm=True, moe_permute_fusion=True) — "
        "Transformer Engine 2.8.0 imports and a GPU is present: Megatron's TE spec with TE's grouped GEMM and "
        "fused permutation"
    )
    _fake_te(monkeypatch, "2.0.0", permute_fusion=False)  # grouped GEMM without fused permutation
    path = sp.select_stock_path("megatron", CUDA)
    assert path.config_options() == {"moe_grouped_gemm": True, "moe_permute_fusion": False}
    assert "no fused permutation" in path.describe()


def test_stock_path_is_sequential_mlp_without_te_and_says_why(monkeypatch):
    _fake_te(monkeypatch, None)
    path = sp.select_stock_path("megatron", CUDA)
    assert (path.experts, path.transformer_engine) == ("SequentialMLP", False)
    assert path.config_options() == {"moe_grouped_gemm": False, "moe_permute_fusion": False}
    assert path.describe() == (
        "Megatron SequentialMLP (local spec) — Transformer Engine not importable (No module named "
        "'transformer_engine'), so TEGroupedMLP/grouped GEMM cannot run"
    )
    assert "and this run is on the CPU, so" in sp.select_stock_path("megatron", CPU).describe()
    _fake_te(monkeypatch, "2.8.0")  # importable, but the run is on the CPU
    path = sp.select_stock_path("megatron", CPU)
    assert path.experts == "SequentialMLP" and "this run is on the CPU" in path.reason
    _fake_te(monkeypatch, "1.6.0", grouped_linear=False)  # too old for Megatron's grouped linear
    path = sp.select_stock_path("megatron", CUDA)
    assert path.experts == "SequentialMLP" and "TEColumnParallelGroupedLinear" in path.reason
    assert sp.select_stock_path("deepspeed", CUDA).describe().startswith("DeepSpeed deepspeed.moe.layer.MoE")


def test_transformer_engine_status_without_te(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # an import that fails, installed or not
    version, why = sp.transformer_engine_status()
    assert version is None and "transformer_engine" in why


def test_te_stock_path_builds_from_megatrons_te_spec(monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron.core.models.gpt import gpt_layer_specs

    from mok_plugin.megatron.layer import stock_experts_class

    calls = []

    def te_spec(**kwargs):
        calls.append(kwargs)
        return SimpleNamespace(submodules=SimpleNamespace(mlp="the TE spec's MoE builder"))

    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", te_spec)
    assert sp.stock_moe_spec(8, transformer_engine=True) == "the TE spec's MoE builder"
    assert calls == [{"num_experts": 8, "moe_grouped_gemm": True}]
    local = sp.stock_moe_spec(8, transformer_engine=False)
    assert stock_experts_class(local.keywords["submodules"]) == "SequentialMLP"


def test_stock_path_names_the_class_megatron_built():
    path = sp.StockPath("megatron", "TEGroupedMLP", "Transformer Engine spec", True, True, "TE imports")
    SequentialMLP = type("SequentialMLP", (nn.Module,), {})
    built = sp.confirm_built(path, SequentialMLP())
    assert built.experts == "SequentialMLP" and not built.grouped_gemm
    assert built.describe().startswith("Megatron SequentialMLP (Transformer Engine spec")
    assert "Megatron built SequentialMLP, not TEGroupedMLP" in built.reason
    assert sp.confirm_built(path, type("TEGroupedMLP", (nn.Module,), {})()) is path


class _GroupedLinear(nn.Module):
    """TE's grouped linear as a state dict sees it: weight{i}, and an _extra_state."""

    def __init__(self, n: int, rows: int, cols: int):
        super().__init__()
        for i in range(n):
            self.register_parameter(f"weight{i}", nn.Parameter(torch.randn(rows, cols)))
        self.extra = torch.tensor([7.0])

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state):
        self.extra = state


def _moe_model(grouped: bool) -> nn.Module:
    experts = nn.Module()
    if grouped:
        experts.linear_fc1, experts.linear_fc2 = _GroupedLinear(2, 6, 4), _GroupedLinear(2, 4, 3)
    else:
        experts.local_experts = nn.ModuleList(nn.Module() for _ in range(2))
        for e in experts.local_experts:
            e.linear_fc1, e.linear_fc2 = nn.Linear(4, 6, bias=False), nn.Linear(3, 4, bias=False)
    layer = nn.Module()
    layer.experts = experts
    model = nn.Module()
    model.moes = nn.ModuleList([layer])
    return model


def test_te_grouped_keys_load_into_every_variant():
    from mok_plugin.compare.harness import _load_weights, _portable_state

    te = _moe_model(grouped=True)
    state = _portable_state(te.state_dict())
    assert sorted(state) == [f"moes.0.experts.local_experts.{i}.linear_fc{n}.weight" for i in (0, 1) for n in (1, 2)]
    sequential = _moe_model(grouped=False)
    _load_weights(sequential, state)
    moved = sequential.moes[0].experts.local_experts[1].linear_fc2.weight
    assert torch.equal(moved, te.moes[0].experts.linear_fc2.weight1)
    again = _moe_model(grouped=True)  # and back under TE's keys, its own _extra_state kept
    again.moes[0].experts.linear_fc1.extra = torch.tensor([3.0])
    _load_weights(again, _portable_state(sequential.state_dict()))
    assert torch.equal(again.moes[0].experts.linear_fc1.weight0, te.moes[0].experts.linear_fc1.weight0)
    assert torch.equal(again.moes[0].experts.linear_fc1.extra, torch.tensor([3.0]))


def test_grouped_mm_stand_in_computes_megatrons_experts():
    # Megatron's expert MLP: act(fc1(x) + b1) * prob -> fc2 -> + b2 * prob, one expert at a time.
    try:
        sp.grouped_mm_function()
    except sp.GroupedMMUnavailable as error:
        pytest.skip(str(error))
    from mok_plugin.experts import MoKExpertFamily

    family = MoKExpertFamily(kind="glu", activation="quick_gelu", clamp=0.5, linear_offset=1.0, fc1_bias=True,
                             fc2_bias=True)  # fmt: skip
    E, H, I, counts = 3, 8, 4, [2, 0, 3]
    torch.manual_seed(0)
    layer = nn.Module()
    layer.experts = nn.Module()
    layer.experts.local_experts = nn.ModuleList(nn.Module() for _ in range(E))
    for e in layer.experts.local_experts:
        e.linear_fc1, e.linear_fc2 = nn.Linear(H, 2 * I), nn.Linear(I, H)
    x, probs = torch.randn(sum(counts), H), torch.rand(sum(counts))
    expected, start = [], 0
    for e, n in zip(layer.experts.local_experts, counts, strict=True):
        h = e.linear_fc1(x[start : start + n])
        gate, up = h.chunk(2, dim=-1)
        gate, up = gate.clamp(max=0.5), up.clamp(-0.5, 0.5)
        a = gate * torch.sigmoid(1.702 * gate) * (up + 1.0) * probs[start : start + n, None]
        expected.append(F.linear(a, e.linear_fc2.weight) + e.linear_fc2.bias * probs[start : start + n, None])
        start += n
    sp.use_grouped_mm_experts(layer, family)
    try:
        out, bias = layer.experts(x, torch.tensor(counts), probs)
    except sp.GROUPED_MM_ERRORS as error:  # grouped_mm exists but not for fp32 on this CPU
        pytest.skip(f"grouped_mm cannot run here: {error}")
    assert bias is None
    torch.testing.assert_close(out, torch.cat(expected), rtol=1e-5, atol=1e-5)


def test_grouped_mm_missing_is_said(monkeypatch):
    monkeypatch.delattr(F, "grouped_mm", raising=False)
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    with pytest.raises(sp.GroupedMMUnavailable, match="has no grouped_mm"):
        sp.grouped_mm_function()


def _with_stock_side(result: dict, train) -> dict:
    """`result` with the stock path (no TE) and the stand-in block `train` makes."""
    from mok_plugin.compare.harness import _stand_in

    path = sp.StockPath("megatron", "SequentialMLP", "local spec", False, False,
                        "Transformer Engine not importable (No module named 'transformer_engine'), "
                        "so TEGroupedMLP/grouped GEMM cannot run")  # fmt: skip
    return {**result, "stock_path": path.summary(), "stand_in": _stand_in(train, "megatron", path, 128)}


def test_report_states_the_stock_path_and_the_stand_in_row(tmp_path):
    from mok_plugin.compare.harness import RunResult
    from mok_plugin.compare.report import write_reports

    def train(variant, repeat):
        return RunResult(variant, repeat, [6.2, 5.0], None, 0.5, 256000.0, 3.0), {"w": torch.ones(2)}

    result = _with_stock_side(_result("megatron", 2, None, None), train)
    result["meta"].update(config="tiny.yaml", device="cpu", steps=2, tokens_per_step=128, model="m", mode="x")
    table = format_table(result).splitlines()
    assert table[0] == ("stock: Megatron SequentialMLP (local spec) — Transformer Engine not importable (No module "
                        "named 'transformer_engine'), so TEGroupedMLP/grouped GEMM cannot run")  # fmt: skip
    row = next(line for line in table if line.startswith("grouped_mm*"))
    assert row.split()[1:4] == ["0.50", "256000", "3.00"] and row.endswith("yes")
    note = next(line for line in table if line.startswith("* grouped_mm: stand-in for a grouped stock path"))
    assert "two torch grouped_mm calls" in note and "its losses and the stock layer's agree to 0.0e+00" in note
    assert "MoK / grouped_mm tokens/s: 0.00x" in table
    markdown = (write_reports(result, tmp_path)["markdown"]).read_text()
    assert "- stock: Megatron SequentialMLP (local spec)" in markdown
    assert "| grouped_mm\\* | 0.50 | 256000 |" in markdown
    assert json.loads((tmp_path / "comparison.json").read_text())["stand_in"]["summary"]["tokens_per_s"] == 256000


def test_report_says_why_the_stand_in_did_not_run():
    def train(variant, repeat):
        raise RuntimeError("grouped_mm: no CPU kernel for Float\nmore detail")

    table = format_table(_with_stock_side(_result("megatron", 2, None, None), train))
    line = next(line for line in table.splitlines() if line.startswith("grouped_mm*"))
    reason = f"torch {torch.__version__} cannot run grouped_mm here (grouped_mm: no CPU kernel for Float)"
    assert line == f"grouped_mm* not run: {reason}"
    assert "* grouped_mm: stand-in" in table and "MoK / grouped_mm" not in table


def test_learning_rate_shrinks_with_width():
    from mok_plugin.compare.harness import learning_rate

    assert learning_rate(64) == learning_rate(32) == 1e-2  # the tiny config's, measured to train in 10 steps
    assert learning_rate(2048) == 1e-2 * 64 / 2048


def test_compare_refuses_gpu_configs_on_the_cpu(tmp_path):
    run = _compare(tmp_path, "--config", str(ROOT / "configs/topologies/kimi-k2_gb300-nvl72_ep64.yaml"))
    assert run.returncode == 2 and "targets gb300-nvl72" in run.stderr


def test_pretrain_gpt_without_cuda_stops_in_one_line():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "pretrain_gpt.py"), "--num-layers", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert run.returncode != 0
    assert run.stdout == "" and len(run.stderr.strip().splitlines()) == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "needs a CUDA GPU" in run.stderr
