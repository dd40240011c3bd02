"""The verdict table (mok_plugin/megatron/verdicts.py) covers every MoE setting of the installed
Megatron-Core, and each verdict holds: refused settings raise naming their flag, replaced settings
leave MoK's config unchanged, honoured settings name tests that exist."""

import ast
import copy
import dataclasses
import re
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e .[megatron])")

import megatron.core.transformer.moe as moe_package  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from test_megatron import _config  # noqa: E402

from mok_plugin.config import MoKConfigError  # noqa: E402
from mok_plugin.megatron import mok_config_from_megatron  # noqa: E402
from mok_plugin.megatron.config_map import megatron_flag  # noqa: E402
from mok_plugin.megatron.verdicts import FORWARD_ARGUMENTS, TRAINING_ARGUMENTS, VERDICTS  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONFIG_FIELDS = {field.name for field in dataclasses.fields(TransformerConfig)}


def _fields_the_moe_layer_reads() -> set[str]:
    """TransformerConfig fields named moe_*, and every `config.<field>` / `self.config.<field>` the
    installed Megatron's MoE package reads."""
    read = {name for name in CONFIG_FIELDS if name.startswith("moe_")}
    for source in Path(moe_package.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in CONFIG_FIELDS
                and (
                    (isinstance(node.value, ast.Name) and node.value.id == "config")
                    or (isinstance(node.value, ast.Attribute) and node.value.attr == "config")
                )
            ):
                read.add(node.attr)
    return read


def test_every_setting_the_moe_layer_reads_has_a_verdict():
    missing = sorted(_fields_the_moe_layer_reads() - set(VERDICTS))
    assert not missing, f"Megatron MoE settings without a verdict in mok_plugin/megatron/verdicts.py: {missing}"


def test_every_verdict_names_a_megatron_setting():
    stale = sorted(set(VERDICTS) - CONFIG_FIELDS)
    assert not stale, f"verdicts for settings this Megatron does not have: {stale}"


def _with(field: str, value) -> TransformerConfig:
    """The base test config with one field set after validation (Megatron's own checks would ask for
    Transformer Engine or a GPU for some of these; the mapping is what is tested here)."""
    tc = copy.copy(_config())
    object.__setattr__(tc, field, value)
    return tc


REFUSED = sorted(name for name, verdict in VERDICTS.items() if verdict.kind == "refused")
REPLACED = sorted(name for name, verdict in VERDICTS.items() if verdict.kind == "replaced")


@pytest.mark.parametrize("field", REFUSED)
def test_refused_settings_raise_naming_their_flag(field):
    with pytest.raises(MoKConfigError, match=re.escape(megatron_flag(field))):
        mok_config_from_megatron(_with(field, VERDICTS[field].example))


@pytest.mark.parametrize("field", REPLACED)
def test_replaced_settings_leave_moks_config_unchanged(field):
    assert VERDICTS[field].example != getattr(_config(), field)
    assert mok_config_from_megatron(_with(field, VERDICTS[field].example)) == mok_config_from_megatron(_config())


def _test_names(path: Path) -> set[str]:
    return {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("field", sorted(name for name, v in VERDICTS.items() if v.kind in ("honoured", "depends")))
def test_honoured_settings_name_existing_tests(field):
    verdict = VERDICTS[field]
    assert verdict.tests, f"{field}: an honoured setting names the tests that compare it with the stock layer"
    for ref in verdict.tests:
        file, _, name = ref.partition("::")
        assert (REPO / file).is_file(), f"{field}: {file} does not exist"
        assert name in _test_names(REPO / file), f"{field}: {ref} does not exist"


def test_other_options_name_megatron_arguments_and_existing_tests():
    # The options outside TransformerConfig: megatron.training's arguments and MoELayer.forward's.
    import argparse
    import inspect

    from megatron.training.arguments import add_megatron_arguments

    dests = {action.dest for action in add_megatron_arguments(argparse.ArgumentParser())._actions}
    assert set(TRAINING_ARGUMENTS) <= dests
    assert set(FORWARD_ARGUMENTS) <= set(inspect.signature(MoELayer.forward).parameters)
    for name, verdict in {**TRAINING_ARGUMENTS, **FORWARD_ARGUMENTS}.items():
        assert verdict.kind in ("honoured", "depends") and verdict.tests, name
        for ref in verdict.tests:
            file, _, test = ref.partition("::")
            assert test in _test_names(REPO / file), f"{name}: {ref} does not exist"


def test_inference_optimized_layer_is_refused():
    with pytest.raises(MoKConfigError, match="--transformer-impl"):
        mok_config_from_megatron(_with("transformer_impl", "inference_optimized"))
    assert mok_config_from_megatron(_with("transformer_impl", "local")) == mok_config_from_megatron(_config())
