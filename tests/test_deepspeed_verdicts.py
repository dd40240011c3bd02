"""The DeepSpeed adapter's option table (mok_plugin/deepspeed/verdicts.py) covers every argument of
the installed DeepSpeed's MoE layer; refused arguments raise naming themselves; honoured ones name
tests that exist."""

import ast
import inspect
from pathlib import Path

import pytest

deepspeed = pytest.importorskip("deepspeed", reason="needs deepspeed (pip install -e .[deepspeed])")

from deepspeed.moe.layer import MoE as StockMoE  # noqa: E402
from test_deepspeed import one_rank_world  # noqa: E402

import mok_plugin.deepspeed as mds  # noqa: E402
from mok_plugin.config import MoKConfigError  # noqa: E402
from mok_plugin.deepspeed.verdicts import CONFIG_VERDICTS, VERDICTS  # noqa: E402

pytestmark = pytest.mark.deepspeed
REPO = Path(__file__).resolve().parent.parent
H, I, E = 16, 24, 4


@pytest.fixture(scope="module")
def ds_world():
    yield from one_rank_world()


def _arguments() -> set[str]:
    init = set(inspect.signature(StockMoE.__init__).parameters) - {"self"}
    forward = set(inspect.signature(StockMoE.forward).parameters) - {"self", "hidden_states"}
    return init | forward


def test_every_argument_of_deepspeeds_moe_has_a_verdict():
    assert not sorted(_arguments() - set(VERDICTS)), "arguments without a verdict in deepspeed/verdicts.py"
    assert not sorted(set(VERDICTS) - _arguments()), "verdicts for arguments this DeepSpeed does not have"


@pytest.mark.parametrize("argument", sorted(k for k, v in VERDICTS.items() if v.kind == "refused"))
def test_refused_arguments_raise_naming_themselves(ds_world, argument):
    with pytest.raises(MoKConfigError, match=argument):
        mds.MoE(H, mds.SwiGLUExpert(H, I), num_experts=E, **{argument: VERDICTS[argument].example})


@pytest.mark.parametrize("argument", sorted(k for k, v in VERDICTS.items() if v.kind in ("honoured", "depends")))
def test_honoured_arguments_name_existing_tests(argument):
    _names_existing_tests(argument, VERDICTS[argument])


def _names_existing_tests(option: str, verdict) -> None:
    assert verdict.tests, option
    for ref in verdict.tests:
        file, _, name = ref.partition("::")
        tree = ast.parse((REPO / file).read_text())
        assert name in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}, f"{option}: {ref}"


@pytest.mark.parametrize("key", sorted(k for k, v in CONFIG_VERDICTS.items() if v.kind == "refused"))
def test_refused_config_settings_raise_naming_themselves(key):
    with pytest.raises(MoKConfigError, match=rf"{key}\."):
        mds.read_mok_settings({"mok": {"enabled": True}, key: CONFIG_VERDICTS[key].example})


@pytest.mark.parametrize("key", sorted(k for k, v in CONFIG_VERDICTS.items() if v.kind in ("honoured", "depends")))
def test_honoured_config_settings_name_existing_tests(key):
    _names_existing_tests(key, CONFIG_VERDICTS[key])
