"""The ds_config's "mok" block is as strict as the layer (issue 22): its knobs are MoKConfig's MOK_KNOBS
with MoKConfig's types, bounds and strictness (no "yes", 1 or "2.0" for a bool or a float); its YAML
file is read and checked with the block, naming `mok.config` and the file; and deepspeed.initialize
(wrapped once mok_plugin.deepspeed is imported) warns when the block enables MoK but the model's MoE
layers are DeepSpeed's stock ones, and only then."""

import re
import warnings

import pytest
from pydantic import ValidationError

deepspeed = pytest.importorskip("deepspeed", reason="needs deepspeed (pip install -e .[deepspeed])")

from deepspeed.moe.layer import MoE as StockMoE  # noqa: E402
from test_deepspeed import one_rank_world  # noqa: E402
from torch import nn  # noqa: E402

import mok_plugin.deepspeed as mds  # noqa: E402
from mok_plugin.config import MOK_KNOBS, MoKConfig, MoKConfigError  # noqa: E402

pytestmark = pytest.mark.deepspeed
H, I, E = 16, 24, 4
SHAPE = dict(hidden_size=H, ffn_hidden_size=I, num_experts=E, top_k=1)
NOT_STRICT = ["yes", "on", 1, "2.0", 0, "true"]


def _read(block: dict):
    return mds.read_mok_settings({"train_batch_size": 2, "mok": block})


@pytest.fixture(scope="module")
def ds_world():
    yield from one_rank_world()


# --- strict values ------------------------------------------------------------------------------


def test_the_block_has_exactly_the_knobs_with_mokconfigs_fields():
    fields = mds.DeepSpeedMoKSettings.model_fields
    assert set(fields) == {"enabled", "config", *MOK_KNOBS, "fp8", "fp8_scaling"}
    assert {"random_seed", "debug_checks"} <= set(fields) and mds.DEEPSPEED_KNOBS == (*MOK_KNOBS, "fp8", "fp8_scaling")
    for knob in mds.DEEPSPEED_KNOBS:
        assert fields[knob].annotation == MoKConfig.model_fields[knob].annotation, knob
        assert fields[knob].metadata == MoKConfig.model_fields[knob].metadata, knob


@pytest.mark.parametrize("value", NOT_STRICT, ids=repr)
@pytest.mark.parametrize("key", ["enabled", "debug_checks"])
def test_a_bool_is_only_true_or_false(key, value):
    with pytest.raises(MoKConfigError, match=rf"mok\.{key}={re.escape(repr(value))}: Input should be a valid boolean"):
        _read({"enabled": True, key: value} if key != "enabled" else {key: value})


@pytest.mark.parametrize("value", ["yes", "on", "2.0", "true"])
@pytest.mark.parametrize("key", ["ep_capacity_factor", "random_seed"])
def test_a_number_is_not_read_from_a_string(key, value):
    with pytest.raises(MoKConfigError, match=rf"mok\.{key}={re.escape(repr(value))}: Input should be a valid"):
        _read({"enabled": True, key: value})


@pytest.mark.parametrize("value", [*NOT_STRICT, None, True, 2.0, 1.5], ids=repr)
@pytest.mark.parametrize("key", mds.DEEPSPEED_KNOBS)
def test_the_block_refuses_what_mokconfig_refuses(key, value):
    """Parity: a knob value is accepted by the block exactly when MoKConfig accepts it."""
    try:
        MoKConfig(**SHAPE, **{key: value})
        layer_accepts = True
    except MoKConfigError:
        layer_accepts = False
    if layer_accepts:  # (fp8's null is its default, off: the block leaves it unset)
        knobs = _read({"enabled": True, key: value}).knobs()
        assert knobs.get(key, MoKConfig.model_fields[key].default) == value
    else:
        with pytest.raises(MoKConfigError, match=rf"mok\.{key}="):
            _read({"enabled": True, key: value})


def test_valid_values_are_accepted(tmp_path):
    knobs_file = tmp_path / "knobs.yaml"
    knobs_file.write_text("mok:\n  kernel_variant: megakernel\n  random_seed: 3\n  top_k: 2\n")
    block = {
        "enabled": True,
        "config": str(knobs_file),
        "backend": "reference",
        "ep_exchange": "capacity",
        "ep_capacity_factor": 1.5,
        "ep_transport": "symmetric_memory",
        "debug_checks": True,
        "random_seed": 2**63 - 1,
    }
    settings = _read(block)
    assert settings.enabled is True
    assert settings.knobs() == {
        "kernel_variant": "megakernel",
        "top_k": 2,  # a non-knob MoKConfig field: checked here, must agree with the layer's arguments
        "backend": "reference",
        "ep_exchange": "capacity",
        "ep_capacity_factor": 1.5,
        "ep_transport": "symmetric_memory",
        "debug_checks": True,
        "random_seed": 2**63 - 1,  # the block's value wins over the file's
    }
    assert _read({"enabled": True, "ep_capacity_factor": 2}).knobs() == {"ep_capacity_factor": 2.0}  # as MoKConfig
    assert _read({"enabled": False}).enabled is False
    assert _read({}).knobs() == {} and mds.read_mok_settings(None).enabled is False


def test_validate_without_init_is_still_strict():
    with pytest.raises(ValidationError, match="enabled"):
        mds.DeepSpeedMoKSettings.model_validate({"enabled": "on"})


# --- the YAML file, read with the block ---------------------------------------------------------


@pytest.mark.parametrize(
    "text, problem",
    [
        ("backend: cuda\n", r"mok\.backend='cuda': Input should be 'auto', 'triton' or 'reference'"),
        ("mok:\n  ep_capacity_factor: '2.0'\n", r"mok\.ep_capacity_factor='2\.0': Input should be a valid number"),
        ("debug_checks: 'on'\n", r"mok\.debug_checks='on': Input should be a valid boolean"),
        ("random_seed: 1.5\n", r"mok\.random_seed=1\.5: Input should be a valid integer"),
        ("top_k: '2'\n", r"mok\.top_k='2': Input should be a valid integer"),
        ("ep_capacity_factor: 0\n", r"mok\.ep_capacity_factor=0: Input should be greater than 0"),
    ],
)
def test_a_bad_yaml_knob_is_reported_when_the_block_is_read(tmp_path, text, problem):
    path = tmp_path / "knobs.yaml"
    path.write_text(text)
    where = rf"mok\.config='{re.escape(str(path))}': invalid MoK knobs:\n +"
    for enabled in (True, False):  # read and checked either way, before any layer is built
        with pytest.raises(MoKConfigError, match=where + problem):
            _read({"enabled": enabled, "config": str(path)})
    with pytest.raises(MoKConfigError, match=where + problem):
        mds.apply({"mok": {"enabled": True, "config": str(path)}})


def test_a_missing_yaml_file_is_reported_when_the_block_is_read(tmp_path):
    path = tmp_path / "missing.yaml"
    with pytest.raises(MoKConfigError, match=rf"mok\.config='{re.escape(str(path))}': no such file"):
        _read({"enabled": True, "config": str(path)})
    with pytest.raises(MoKConfigError, match=r"mok\.config=1: Input is not a valid path"):
        _read({"enabled": True, "config": 1})
    deep = tmp_path / ("a-directory-whose-name-is-long-" * 4) / "knobs.yaml"  # the whole path named, not its start
    deep.parent.mkdir()
    deep.write_text("backend: cuda\n")
    with pytest.raises(MoKConfigError, match=rf"mok\.config='{re.escape(str(deep))}': invalid MoK knobs"):
        _read({"enabled": True, "config": str(deep)})


# --- the warning: the block enables MoK, the layers are stock -----------------------------------


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, H)
        self.moe = StockMoE(H, mds.SwiGLUExpert(H, I), num_experts=E, k=1, drop_tokens=False, use_rts=False)

    def forward(self, x):
        return self.moe(self.proj(x))[0].sum()


def _initialize(model: nn.Module, block: dict) -> list[str]:
    """deepspeed.initialize's messages from mok_plugin (the ones that say the stock layer runs)."""
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000, "mok": block}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = deepspeed.initialize(model=model, config=config)
    assert engine.module is model
    return [str(w.message) for w in caught if "the stock layer runs" in str(w.message)]


def test_initialize_is_wrapped_visibly():
    assert deepspeed.initialize._mok_checks_the_model
    assert deepspeed.initialize.__wrapped__.__module__ == "deepspeed"


def test_initialize_warns_when_the_block_is_enabled_without_apply(ds_world):
    messages = _initialize(_Model(), {"enabled": True, "backend": "reference"})
    assert len(messages) == 1
    assert "1 MoE layer(s) of the model (['moe'])" in messages[0] and "mok_plugin.deepspeed.apply" in messages[0]


def test_initialize_reads_a_config_file_as_deepspeed_does(ds_world, tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1, "mok": {"enabled": true}}')
    with pytest.warns(UserWarning, match="the stock layer runs"):
        deepspeed.initialize(model=_Model(), config=str(path))


def test_initialize_warns_when_the_model_was_built_before_apply(ds_world):
    model = _Model()
    try:
        mds.apply({"mok": {"enabled": True, "backend": "reference"}})
        assert len(_initialize(model, {"enabled": True, "backend": "reference"})) == 1
    finally:
        mds.revert()


def test_initialize_is_silent_when_apply_was_called(ds_world):
    try:
        mds.apply({"mok": {"enabled": True, "backend": "reference"}})
        model = _Model()
        assert isinstance(model.moe, mds.MoE)
        assert _initialize(model, {"enabled": True, "backend": "reference"}) == []
    finally:
        mds.revert()


def test_initialize_is_silent_when_the_block_is_disabled(ds_world):
    assert _initialize(_Model(), {"enabled": False}) == []


def test_initialize_refuses_a_bad_block(ds_world):
    with pytest.raises(MoKConfigError, match=r"mok\.enabled='yes'"):
        deepspeed.initialize(model=_Model(), config={"train_micro_batch_size_per_gpu": 1, "mok": {"enabled": "yes"}})


@pytest.mark.parametrize(
    "key, block, message",
    [("expert_parallel", {"enabled": True}, r"mok\.enabled=True with expert_parallel\.enabled=True"),
     ("compile", {"deepcompile": True}, r"mok\.enabled=True with compile\.deepcompile=True")],
)  # fmt: skip
def test_refused_settings_beside_the_block_name_themselves(ds_world, key, block, message):
    # AutoEP replaces Hugging Face MoE blocks inside deepspeed.initialize with layers MoK does not
    # replace (with both enabled MoK would silently not run); DeepCompile's passes are untested with MoK.
    both = {"train_micro_batch_size_per_gpu": 1, "mok": {"enabled": True}, key: block}
    for call in (mds.read_mok_settings, mds.apply, lambda c: deepspeed.initialize(model=_Model(), config=c)):
        with pytest.raises(MoKConfigError, match=message):
            call(both)
    assert mds.read_mok_settings({**both, key: {}}).enabled
    assert not mds.read_mok_settings({**both, "mok": {"enabled": False}}).enabled


def test_check_model(ds_world):
    model = _Model()
    with pytest.warns(UserWarning, match="the stock layer runs"):
        assert mds.check_model(model, {"mok": {"enabled": True}}) == ["moe"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mds.check_model(model, {"mok": {"enabled": False}}) == []
        assert mds.check_model(model, {"train_batch_size": 2}) == []
        assert mds.check_model(nn.Linear(H, H), {"mok": {"enabled": True}}) == []  # no MoE layer: nothing runs stock
