"""MoKConfig and load_config: defaults, YAML loading, and every rejection naming its field."""

import pytest

from mok_plugin import MoKConfig, MoKConfigError, load_config

BASE = dict(hidden_size=64, ffn_hidden_size=32, num_experts=8, top_k=2)


def test_defaults_are_dropless_deterministic_auto():
    cfg = MoKConfig(**BASE)
    assert cfg.capacity_factor is None
    assert cfg.deterministic is True
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
            dict(score_function="relu"), r"mok\.score_function='relu'.*'softmax' or 'sigmoid'", id="bad_literal"
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


def test_load_config_errors_name_file_and_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("hidden_size: 64\nffn_hidden_size: 32\nnum_experts: 8\ntop_k: 2\nexperts: 8\n")
    with pytest.raises(MoKConfigError, match=r"(?s)bad\.yaml.*mok\.experts: unknown key"):
        load_config(bad)
    not_mapping = tmp_path / "list.yaml"
    not_mapping.write_text("- 1\n- 2\n")
    with pytest.raises(MoKConfigError, match="expected a mapping"):
        load_config(not_mapping)
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "missing.yaml")


def test_replace_revalidates():
    cfg = MoKConfig(**BASE)
    assert cfg.replace(top_k=4).top_k == 4
    with pytest.raises(MoKConfigError, match="mok.top_k=12"):
        cfg.replace(top_k=12)
