"""The DeepSpeed "mok" block (mok_plugin/deepspeed/config.py) refuses what validates but cannot run
(issue 18): the removed `deterministic` key, in the block and in its YAML file, with a message saying
MoK is always deterministic; a non-finite or huge ep_capacity_factor; a YAML file that cannot be read
(not UTF-8, a directory, broken YAML) or holds unknown keys, naming the file; a JSON config file that
is not JSON; a long base64 config string that is not a file name, without echoing it whole."""

import json
import math

import pytest

pytest.importorskip("deepspeed", reason="needs deepspeed (pip install -e .[deepspeed])")

from mok_plugin.config import MoKConfigError  # noqa: E402
from mok_plugin.deepspeed.config import DeepSpeedMoKSettings, read_mok_settings  # noqa: E402

pytestmark = pytest.mark.deepspeed


def _knobs(block: dict) -> dict:
    return read_mok_settings({"train_batch_size": 2, "mok": block}).knobs()


def test_deterministic_was_removed_from_the_block_and_its_file(tmp_path):
    assert "deterministic" not in DeepSpeedMoKSettings.model_fields
    removed = r"mok\.deterministic: this key was removed: MoK is always deterministic"
    with pytest.raises(MoKConfigError, match=removed):
        _knobs({"enabled": True, "deterministic": True})
    path = tmp_path / "knobs.yaml"
    path.write_text("mok:\n  deterministic: true\n  backend: reference\n")
    with pytest.raises(MoKConfigError, match=rf"mok\.config='.*knobs\.yaml': {removed}"):
        _knobs({"enabled": True, "config": str(path)})


@pytest.mark.parametrize("value", [math.inf, math.nan, 1e9])
def test_ep_capacity_factor_finite_and_bounded(value):
    with pytest.raises(MoKConfigError, match=r"mok\.ep_capacity_factor="):
        _knobs({"enabled": True, "ep_capacity_factor": value})


def test_the_yaml_file_is_read_and_checked_naming_it(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"backend: \xff\n")
    broken = tmp_path / "broken.yaml"
    broken.write_text("backend: [\n")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("backnd: reference\n")
    cases = [(binary, r"binary\.yaml: not UTF-8 text"), (tmp_path, r"is a directory"),
             (broken, r"broken\.yaml: not valid YAML"),
             (unknown, r"unknown\.yaml': unknown MoK fields \['backnd'\]; allowed: .*'backend'")]  # fmt: skip
    for path, match in cases:
        with pytest.raises(MoKConfigError, match=match):
            _knobs({"enabled": True, "config": str(path)})
    good = tmp_path / "good.yaml"
    good.write_text("mok:\n  kernel_variant: megakernel\n")
    assert _knobs({"enabled": True, "config": str(good), "backend": "reference"}) == {
        "kernel_variant": "megakernel",
        "backend": "reference",
    }


def test_config_files_and_strings_that_are_not_configs(tmp_path):
    not_json = tmp_path / "ds.json"
    not_json.write_text("{'mok': 1")
    with pytest.raises(MoKConfigError, match=r"ds\.json: cannot read it as JSON"):
        read_mok_settings(not_json)
    a_list = tmp_path / "list.json"
    a_list.write_text(json.dumps([1, 2]))
    with pytest.raises(MoKConfigError, match="expected a JSON object, got list"):
        read_mok_settings(a_list)
    too_deep = tmp_path / "deep.json"
    too_deep.write_text("[" * 100_000)
    with pytest.raises(MoKConfigError, match=r"deep\.json: cannot read it as JSON"):
        read_mok_settings(too_deep)
    with pytest.raises(MoKConfigError, match="not a dict, a JSON file or base64 JSON") as info:
        read_mok_settings("A" * 100_000)  # too long for a file name: was an OSError from is_file()
    assert len(str(info.value)) < 300
