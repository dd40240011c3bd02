"""GPT pretraining on megatron.training (from the megatron-core wheel) with mock data, taking
Megatron's own flags plus --mok, --mok-config, --mok-backend and --mok-deterministic.

The megatron-core wheel ships megatron.training but not Megatron-LM's pretrain_gpt.py; this is
the same entry (parse and validate args, GPTModelConfig, PretrainConfigContainer, pretrain) on
MockGPTDataset, with its batch handling: TP rank 0 of the stages that read the data loads it and
broadcasts it over TP, each CP rank keeps its sequence chunks, middle pipeline stages read none.
Megatron's builder makes the (virtual) pipeline stages. Stock and MoK runs differ only by --mok:

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

# The mock samples carry no attention mask (the attention is causal without one); the TP broadcast
# must expect the same keys the data loader produces.
CREATE_ATTENTION_MASK = False


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


def mtp_here(config, vp_stage: int | None) -> bool:
    """Whether this (virtual) stage holds MTP layers, which read tokens and labels wherever they sit."""
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank

    return mtp_on_this_rank(layout=config.pipeline_model_parallel_layout, mtp_num_layers=config.mtp_num_layers,
                            ignore_virtual=False, vp_stage=vp_stage)  # fmt: skip


def reads_data(config, vp_stage: int | None) -> bool:
    """The first stage embeds tokens, the last takes labels; middle stages get only activations."""
    from megatron.training.utils import is_first_or_last_pipeline_stage

    return is_first_or_last_pipeline_stage(vp_stage) or mtp_here(config, vp_stage)


def get_batch(data_iterator, config, vp_stage: int | None = None):
    """(tokens, labels, loss_mask, attention_mask, position_ids) of this rank; Nones on middle stages."""
    from megatron.core import parallel_state as mpu
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args

    if not reads_data(config, vp_stage):
        return None, None, None, None, None
    args = get_args()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:  # only there is the data loader built (datasets_provider)
        batch = {k: (v.cuda(non_blocking=True) if torch.is_tensor(v) else v) for k, v in next(data_iterator).items()}
    whole = vp_stage is None  # without virtual stages, the physical stage decides
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False, create_attention_mask_in_dataloader=CREATE_ATTENTION_MASK,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size, tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
        mtp_on_this_rank=mtp_here(config, vp_stage), pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(ignore_virtual=whole, vp_stage=vp_stage),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(ignore_virtual=whole, vp_stage=vp_stage),
    )  # fmt: skip
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return tuple(batch.get(k) for k in ("tokens", "labels", "loss_mask", "attention_mask", "position_ids"))


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """One micro-batch: mock tokens in, per-token losses out (on the last stage; hidden states before)."""
    from megatron.core.utils import get_attr_wrapped_model

    # Each virtual stage is its own model chunk with its own data iterator; the chunk knows its stage.
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    config = get_attr_wrapped_model(model, "config")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, config, vp_stage)
    if return_schedule_plan:
        # --overlap-moe-expert-parallel-comm: the combined 1F1B schedule runs the model's layers in
        # stages from this plan (MoK's layer through its stage methods) instead of calling it.
        plan = model.build_schedule_plan(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
        return plan, partial(loss_func, loss_mask)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def datasets_provider(train_val_test_num_samples, vp_stage=None, config=None):
    from megatron.core import parallel_state as mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    dataset_config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None, blend_per_split=None,
        split=args.split or "99,1,0", tokenizer=get_tokenizer(), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=CREATE_ATTENTION_MASK,
        path_to_cache=None, mmap_bin_files=False,
    )  # fmt: skip

    def built_here() -> bool:  # the ranks get_batch reads from; the others get no loader
        return reads_data(config, vp_stage) and mpu.get_tensor_model_parallel_rank() == 0

    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples, built_here, dataset_config).build()


def printable_help(parser):
    """Megatron 0.19.2's help for --moe-paged-stash-buffer-size-factor-cuda has a bare '%' ("10%)"),
    which argparse reads as a format directive: `--help` raised ValueError. Escape such strings."""
    for action in parser._actions:
        if action.help:
            try:
                action.help % dict(vars(action), prog=parser.prog)
            except (ValueError, TypeError, KeyError):
                action.help = action.help.replace("%", "%%")
    return parser


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
    args = parse_args_with_mok(
        parse_and_validate_args, printable_help, args_defaults={"tokenizer_type": "NullTokenizer"}
    )
    if not args.mock_data:
        raise SystemExit("scripts/pretrain_gpt.py trains on mock data only: pass --mock-data")
    model_config = gpt_config_from_args(args)
    # The validated TransformerConfig (its pipeline layout parsed) says which stages hold MTP layers.
    provider = partial(datasets_provider, config=model_config.transformer)
    provider.is_distributed = True  # each rank decides for itself whether it builds (built_here)
    pretrain(pretrain_cfg_container_from_args(args, model_config), provider, ModelType.encoder_or_decoder,
             forward_step)  # fmt: skip


if __name__ == "__main__":
    main()
