"""MoKConfig and load_config: defaults, YAML loading, and every rejection naming its field; values
that would validate but not run (non-finite or huge floats, sizes past int64 buffers) and the
removed `deterministic` key are errors; a torch.dtype is a params_dtype; every way a file can fail
to read is an error naming the file; a run config is refused, pointing to load_topology; no error
echoes a huge input whole."""

import math
from pathlib import Path

import pytest
import torch
import yaml

from mok_plugin import MoKConfig, MoKConfigError, load_config

BASE = dict(hidden_size=64, ffn_hidden_size=32, num_experts=8, top_k=2)


def test_defaults_are_dropless_auto():
    cfg = MoKConfig(**BASE)
    assert cfg.capacity_factor is None
    assert "deterministic" not in MoKConfig.model_fields  # MoK is always deterministic: no switch
    assert cfg.backend == "auto"
    assert cfg.shared_intermediate_size == 0
    assert cfg.num_local_experts == 8


def test_shared_size_defaults_to_count_times_ffn():
    assert MoKConfig(**BASE, num_shared_experts=2).shared_intermediate_size == 64
    assert MoKConfig(**BASE, num_shared_experts=1, shared_ffn_hidden_size=40).shared_intermediate_size == 40


def test_config_is_frozen():
    cfg = MoKConfig(**BASE)
    with pytest.raises(Exception, match="frozen"):
        cfg.top_k = 3


@pytest.mark.parametrize(
    "changes, match",
    [
        pytest.param(dict(top_k=9), r"mok\.top_k=9 exceeds num_experts=8", id="k_gt_E"),
        pytest.param(
            dict(n_group=3, topk_group=1), r"mok\.n_group=3 does not divide num_experts=8", id="group_not_dividing"
        ),
        pytest.param(dict(n_group=4), r"mok\.n_group=4 and mok\.topk_group=None", id="group_half_set"),
        pytest.param(dict(n_group=4, topk_group=5), r"mok\.topk_group=5 exceeds n_group=4", id="topk_group_gt_groups"),
        pytest.param(
            dict(n_group=4, topk_group=1, top_k=3), r"mok\.top_k=3 exceeds the 2 experts", id="k_gt_group_experts"
        ),
        pytest.param(dict(n_group=4, topk_group=3), r"mok\.topk_group=3 exceeds top_k=2", id="topk_group_gt_k"),
        pytest.param(dict(ep_size=3), r"mok\.ep_size=3 does not divide num_experts=8", id="ep_not_dividing"),
        pytest.param(
            dict(score_function="relu"),
            r"mok\.score_function='relu'.*'softmax', 'sigmoid' or 'sqrtsoftplus'",
            id="bad_literal",
        ),
        pytest.param(dict(backend="cuda"), r"mok\.backend='cuda'.*'auto', 'triton' or 'reference'", id="bad_backend"),
        pytest.param(dict(top_k="2"), r"mok\.top_k='2'.*valid integer", id="wrong_type"),
        pytest.param(dict(top_k=0), r"mok\.top_k=0.*greater than 0", id="zero_k"),
        pytest.param(dict(capacity_factor=-1.0), r"mok\.capacity_factor=-1\.0", id="negative_capacity"),
        pytest.param(dict(topk=2), r"mok\.topk: unknown key; allowed keys: .*top_k", id="unknown_key"),
        pytest.param(
            dict(shared_ffn_hidden_size=16),
            r"mok\.shared_ffn_hidden_size=16 is set but num_shared_experts=0",
            id="shared_size_without_shared",
        ),
        pytest.param(
            dict(params_dtype="fp8"), r"mok\.params_dtype='fp8'.*'float32', 'bfloat16' or 'float16'", id="bad_dtype"
        ),
    ],
)
def test_invalid_values_name_the_field(changes, match):
    with pytest.raises(MoKConfigError, match=match):
        MoKConfig(**{**BASE, **changes})


def test_all_cross_field_problems_reported_together():
    with pytest.raises(MoKConfigError) as info:
        MoKConfig(**{**BASE, "top_k": 9, "ep_size": 3})
    assert "mok.top_k=9" in str(info.value) and "mok.ep_size=3" in str(info.value)


def test_load_config_reads_top_level_and_mok_section(tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text("hidden_size: 64\nffn_hidden_size: 32\nnum_experts: 8\ntop_k: 2\nscore_function: sigmoid\n")
    nested = tmp_path / "nested.yaml"
    nested.write_text("machine: cpu\nmok:\n  hidden_size: 64\n  ffn_hidden_size: 32\n  num_experts: 8\n  top_k: 2\n")
    assert load_config(flat).score_function == "sigmoid"
    assert load_config(nested) == MoKConfig(**BASE)


def test_load_config_refuses_a_run_config_naming_the_file(tmp_path):
    # config.py knows nothing of run configs, but says where to read one.
    run = {"machine": "cpu", "model": {"name": "tiny"}, "parallel": {"seq_length": 64}, "mok": BASE}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    with pytest.raises(MoKConfigError, match=r"run\.yaml: a run config \(top-level model, parallel\)") as info:
        load_config(path)
    assert "mok_plugin.run.load_topology(path).mok_config()" in str(info.value)
    path.write_text(yaml.safe_dump({"parallel": {"ep": 2}, **BASE}))
    with pytest.raises(MoKConfigError, match=r"run\.yaml: a run config \(top-level parallel\)"):
        load_config(path)


def test_load_config_errors_name_file_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("hidden_size: 64\nffn_hidden_size: 32\nnum_experts: 8\ntop_k: 2\nexperts: 8\n")
    with pytest.raises(MoKConfigError, match=r"(?s)bad\.yaml.*mok\.experts: unknown key"):
        load_config(bad)
    not_mapping = tmp_path / "list.yaml"
    not_mapping.write_text("- 1\n- 2\n")
    with pytest.raises(MoKConfigError, match="expected a mapping"):
        load_config(not_mapping)
    with pytest.raises(MoKConfigError, match=r"missing\.yaml: no such file"):
        load_config(tmp_path / "missing.yaml")


def test_replace_revalidates():
    cfg = MoKConfig(**BASE)
    assert cfg.replace(top_k=4).top_k == 4
    with pytest.raises(MoKConfigError, match="mok.top_k=12"):
        cfg.replace(top_k=12)


@pytest.mark.parametrize(
    "changes, match",
    [
        # Each of these used to validate and fail later: math.ceil(inf) in the schedule or the
        # exchange (OverflowError), an infinite loss, an infinite expert bias or output.
        pytest.param(dict(capacity_factor=math.inf), r"mok\.capacity_factor=inf: .*finite", id="capacity_inf"),
        pytest.param(dict(capacity_factor=math.nan), r"mok\.capacity_factor=nan: .*finite", id="capacity_nan"),
        pytest.param(dict(capacity_factor=1e300), r"mok\.capacity_factor=1e\+300: .*1024", id="capacity_huge"),
        pytest.param(dict(ep_capacity_factor=math.inf), r"mok\.ep_capacity_factor=inf", id="ep_capacity_inf"),
        pytest.param(dict(ep_capacity_factor=1e6), r"mok\.ep_capacity_factor=1000000\.0: .*1024", id="ep_huge"),
        pytest.param(dict(aux_loss_coeff=math.inf), r"mok\.aux_loss_coeff=inf", id="aux_inf"),
        pytest.param(dict(z_loss_coeff=math.nan), r"mok\.z_loss_coeff=nan", id="z_nan"),
        pytest.param(dict(z_loss_coeff=1e39), r"mok\.z_loss_coeff=1e\+39", id="z_huge"),
        pytest.param(dict(routed_scaling_factor=math.inf), r"mok\.routed_scaling_factor=inf", id="scaling_inf"),
        pytest.param(dict(expert_bias_update_rate=math.inf), r"mok\.expert_bias_update_rate=inf", id="rate_inf"),
        pytest.param(dict(hidden_size=2**31), r"mok\.hidden_size=2147483648: .*2147483647", id="H_past_int32"),
        pytest.param(dict(num_shared_experts=2**40), r"mok\.num_shared_experts=", id="shared_count_huge"),
        pytest.param(
            dict(num_experts=2**20, top_k=1, ffn_hidden_size=2**20, hidden_size=2**20),
            r"mok\.num_experts=1048576 x 2 x mok\.ffn_hidden_size=1048576 x mok\.hidden_size=1048576 .*2\*\*60",
            id="expert_weights_past_int64",
        ),
        pytest.param(
            dict(num_shared_experts=4, ffn_hidden_size=2**30),
            r"mok\.num_shared_experts=4 x mok\.ffn_hidden_size=1073741824 = 4294967296 exceeds",
            id="shared_size_past_int32",
        ),
    ],
)
def test_values_that_cannot_run_are_refused(changes, match):
    with pytest.raises(MoKConfigError, match=match):
        MoKConfig(**{**BASE, **changes})


def test_deterministic_was_removed(tmp_path):
    removed = r"mok\.deterministic: this key was removed: MoK is always deterministic"
    for value in (True, False):
        with pytest.raises(MoKConfigError, match=removed):
            MoKConfig(**BASE, deterministic=value)
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"mok": {**BASE, "deterministic": True}}))
    with pytest.raises(MoKConfigError, match=rf"(?s)old\.yaml.*{removed}"):
        load_config(path)
    with pytest.raises(MoKConfigError) as info:  # reported with the other problems, not as an unknown key
        MoKConfig(**BASE, deterministic=True, topk=2)
    assert "mok.topk: unknown key" in str(info.value) and "deterministic, " not in str(info.value)


def test_params_dtype_takes_a_torch_dtype_and_keeps_its_name():
    cfg = MoKConfig(**BASE, params_dtype=torch.bfloat16)
    assert cfg.params_dtype == "bfloat16" and cfg == MoKConfig(**BASE, params_dtype="bfloat16")
    assert cfg.model_dump()["params_dtype"] == "bfloat16"
    assert MoKConfig(**yaml.safe_load(yaml.safe_dump(cfg.model_dump()))) == cfg
    assert cfg.replace(params_dtype=torch.float16).params_dtype == "float16"
    assert cfg.replace(top_k=1).params_dtype == "bfloat16"
    with pytest.raises(MoKConfigError, match=r"mok\.params_dtype='float64'.*'float32', 'bfloat16' or 'float16'"):
        MoKConfig(**BASE, params_dtype=torch.float64)


def test_errors_never_echo_a_huge_input():
    cases = [dict(score_function="x" * 100_000), dict(hidden_size=10**5000), dict(top_k=[1] * 100_000),
             {"y" * 100_000: 1}, dict(top_k=[10**5000])]  # fmt: skip
    for changes in cases:
        with pytest.raises(MoKConfigError) as info:
            MoKConfig(**{**BASE, **changes})
        assert len(str(info.value)) < 1500, str(info.value)[:300]


def test_load_config_names_the_file_for_every_read_failure(tmp_path, monkeypatch):
    binary = tmp_path / "latin1.yaml"
    binary.write_bytes("hidden_size: 64 # caf\xe9\n".encode("latin-1"))
    with pytest.raises(MoKConfigError, match=r"latin1\.yaml: not UTF-8 text"):
        load_config(binary)
    with pytest.raises(MoKConfigError, match=rf"{tmp_path.name}: is a directory"):
        load_config(tmp_path)
    broken = tmp_path / "broken.yaml"
    broken.write_text("mok: [1, 2\n")
    with pytest.raises(MoKConfigError, match=r"broken\.yaml: not valid YAML"):
        load_config(broken)
    long_int = tmp_path / "long_int.yaml"
    long_int.write_text("hidden_size: " + "9" * 5000 + "\n")
    with pytest.raises(MoKConfigError, match=r"long_int\.yaml: not valid YAML") as info:
        load_config(long_int)
    assert len(str(info.value)) < 1000
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 100_000)
    with pytest.raises(MoKConfigError, match=r"deep\.yaml: not valid YAML"):
        load_config(deep)

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", denied)  # root reads any file, so simulate the refusal
    with pytest.raises(MoKConfigError, match=r"broken\.yaml: permission denied"):
        load_config(broken)
