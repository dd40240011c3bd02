"""`mok bench ep-overlap` (mok_plugin/bench/ep_overlap.py) on the CPU: every variant's command line
is one Megatron's parser and MoK's flags take, the overlap variants set what they name, each rank
runs its script with gloo's collectives made to take CUDA tensors, and the command without a GPU
says so. The runs themselves need CUDA (Megatron's training loop): the H200 runs them."""

import importlib.util
import subprocess
import sys

import pytest
import torch

from mok_plugin.bench import ep_overlap


def test_without_cuda_it_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the command would run")
    assert ep_overlap.main(["--out", "unused"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.megatron
@pytest.mark.parametrize("variant", list(ep_overlap.VARIANTS))
def test_variant_flags_parse(variant):
    pytest.importorskip("megatron.training", reason="needs megatron-core (pip install -e .[megatron])")
    from megatron.training.arguments import parse_args

    from mok_plugin.megatron import launcher

    old = sys.argv
    sys.argv = ["pretrain_gpt.py", *ep_overlap.MODEL_ARGS, "--train-iters", "2", *ep_overlap.VARIANTS[variant]]
    try:
        args = parse_args(launcher.add_mok_args)
    finally:
        sys.argv = old
    assert args.expert_model_parallel_size == ep_overlap.RANKS and args.distributed_backend == "gloo"
    assert args.overlap_moe_expert_parallel_comm == ("overlap" in variant)
    assert args.delay_wgrad_compute == variant.endswith("_dw")
    assert args.transformer_impl == ("transformer_engine" if variant.endswith("_dw") else "local")
    if variant.endswith("_dw") and importlib.util.find_spec("transformer_engine") is None:
        assert "Transformer Engine" in ep_overlap.why_not(variant)
    assert args.mok == variant.startswith("mok")


def test_a_rank_runs_its_script_with_collectives_one_by_one(tmp_path):
    # In a process of its own: the patch is process-wide (as each rank is).
    script, marker = tmp_path / "script.py", tmp_path / "ran"
    script.write_text(
        "import sys, pathlib, torch.distributed as dist\n"
        "from mok_plugin.parallel import gloo_cuda\n"
        "assert dist._coalescing_manager is gloo_cuda._one_by_one\n"
        "assert dist.all_reduce_coalesced is gloo_cuda._all_reduce_each\n"
        "assert __name__ == '__main__' and sys.argv[1:] == ['--x', '1']\n"
        f"pathlib.Path({str(marker)!r}).write_text('yes')\n"
    )
    command = [sys.executable, "-m", "mok_plugin.bench.ep_overlap", "--as-rank", str(script), "--x", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert marker.read_text() == "yes"
