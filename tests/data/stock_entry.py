"""Stands in for a Megatron-LM pretraining script (tests/test_megatron_launch.py): it parses
Megatron's arguments with the stock `parse_and_validate_args`, builds the GPT model the way
pretrain_gpt.py does (GPTModelConfig from the args, Megatron's builder) on the CPU, and prints the
class of each layer's MLP (decoder and MTP) as JSON. It knows nothing about MoK."""

import json
import os
import socket

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.training.argument_utils import gpt_config_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.models.gpt import GPTModelBuilder

args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
dist.init_process_group("gloo", rank=0, world_size=1)
parallel_state.initialize_model_parallel(1, 1)
model = GPTModelBuilder(gpt_config_from_args(args)).build_model(ProcessGroupCollection.use_mpu_process_groups())
mlps = {name: type(module.mlp).__name__ for name, module in model.named_modules() if hasattr(module, "mlp")}
print("MLPS=" + json.dumps(mlps))
