"""GPT pretraining on megatron.training (from the megatron-core wheel) with mock data, taking
Megatron's own flags plus --mok, --mok-config, --mok-backend and --mok-deterministic.

The megatron-core wheel ships megatron.training but not Megatron-LM's pretrain_gpt.py; this is
the same entry (parse and validate args, GPTModelConfig, PretrainConfigContainer, pretrain) on
MockGPTDataset, for TP = PP = CP = 1 (EP and DP any). Stock and MoK runs differ only by --mok:

    torchrun --nproc-per-node 2 scripts/pretrain_gpt.py --mok \
        --num-layers 2 --hidden-size 1024 --num-attention-heads 8 --seq-length 1024 \
        --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 8 \
        --num-experts 16 --moe-router-topk 2 --moe-ffn-hidden-size 512 --ffn-hidden-size 2048 \
        --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --swiglu \
        --disable-bias-linear --bf16 --train-iters 10 --lr 1e-4 --mock-data \
        --tokenizer-type NullTokenizer --vocab-size 4096 --transformer-impl local

Every iteration's loss is printed by Megatron's logger (--log-interval); `--mok-deterministic`
prints what else in the run is not deterministic.
"""

from __future__ import annotations

import sys
from functools import partial

import torch

UNSUPPORTED = {"tensor_model_parallel_size": "--tensor-model-parallel-size",
               "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
               "context_parallel_size": "--context-parallel-size"}  # fmt: skip


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def require_cuda(argv: list[str]) -> None:
    """Megatron's training loop needs CUDA; say so in one line, before Megatron parses its hundreds of
    flags (and prints them) only to stop with its own error. `--help` still works without a GPU."""
    if not torch.cuda.is_available() and not {"-h", "--help"} & set(argv):
        raise SystemExit(
            "scripts/pretrain_gpt.py needs a CUDA GPU (Megatron's training loop runs on CUDA only) and "
            "torch sees none; on the CPU, `bash scripts/main.sh` compares the stock and MoK MoE layers"
        )


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """One micro-batch: mock tokens in, per-token losses out (TP = PP = CP = 1: no broadcast)."""
    batch = {k: (v.cuda(non_blocking=True) if torch.is_tensor(v) else v) for k, v in next(data_iterator).items()}
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"],
                   loss_mask=batch["loss_mask"])  # fmt: skip
    return output, partial(loss_func, batch["loss_mask"])


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None, blend_per_split=None,
        split=args.split or "99,1,0", tokenizer=get_tokenizer(), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False, path_to_cache=None,
        mmap_bin_files=False,
    )  # fmt: skip
    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples, lambda: True, config).build()


def use_prebuilt_dataset_helpers() -> None:
    """Megatron compiles its C++ dataset helpers with `make` at start-up; the wheel ships them
    built (helpers_cpp) but no Makefile, so the compile step fails. Skip it when they import."""
    from megatron.core.datasets import (
        helpers_cpp,  # noqa: F401  (raises if the wheel lacks them)
        utils,
    )

    utils.compile_helpers = lambda: None


def main() -> None:
    require_cuda(sys.argv[1:])
    # Imported here, after the CUDA check: importing Megatron's training package is slow and noisy.
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from mok_plugin.megatron.launcher import parse_args_with_mok

    use_prebuilt_dataset_helpers()
    args = parse_args_with_mok(parse_and_validate_args, args_defaults={"tokenizer_type": "NullTokenizer"})
    for field, flag in UNSUPPORTED.items():
        if getattr(args, field, 1) != 1:
            raise SystemExit(f"scripts/pretrain_gpt.py runs {flag} 1 only (mock data, no TP/PP/CP batch broadcast)")
    if not args.mock_data:
        raise SystemExit("scripts/pretrain_gpt.py trains on mock data only: pass --mock-data")
    datasets_provider.is_distributed = True
    model_config = gpt_config_from_args(args)
    pretrain(pretrain_cfg_container_from_args(args, model_config), datasets_provider, ModelType.encoder_or_decoder,
             forward_step)  # fmt: skip


if __name__ == "__main__":
    main()
