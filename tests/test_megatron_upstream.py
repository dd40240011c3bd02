# Copyright (c) 2023, NVIDIA CORPORATION. All rights reserved.
#
# Redistribution and use in source and binary forms, with or without
# modification, are permitted provided that the following conditions
# are met:
#  * Redistributions of source code must retain the above copyright
#    notice, this list of conditions and the following disclaimer.
#  * Redistributions in binary form must reproduce the above copyright
#    notice, this list of conditions and the following disclaimer in the
#    documentation and/or other materials provided with the distribution.
#  * Neither the name of NVIDIA CORPORATION nor the names of its
#    contributors may be used to endorse or promote products derived
#    from this software without specific prior written permission.
#
# THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS ``AS IS'' AND ANY
# EXPRESS OR IMPLIED WARRANTIES, INCLUDING, BUT NOT LIMITED TO, THE
# IMPLIED WARRANTIES OF MERCHANTABILITY AND FITNESS FOR A PARTICULAR
# PURPOSE ARE DISCLAIMED.  IN NO EVENT SHALL THE COPYRIGHT OWNER OR
# CONTRIBUTORS BE LIABLE FOR ANY DIRECT, INDIRECT, INCIDENTAL, SPECIAL,
# EXEMPLARY, OR CONSEQUENTIAL DAMAGES (INCLUDING, BUT NOT LIMITED TO,
# PROCUREMENT OF SUBSTITUTE GOODS OR SERVICES; LOSS OF USE, DATA, OR
# PROFITS; OR BUSINESS INTERRUPTION) HOWEVER CAUSED AND ON ANY THEORY
# OF LIABILITY, WHETHER IN CONTRACT, STRICT LIABILITY, OR TORT
# (INCLUDING NEGLIGENCE OR OTHERWISE) ARISING IN ANY WAY OUT OF THE USE
# OF THIS SOFTWARE, EVEN IF ADVISED OF THE POSSIBILITY OF SUCH DAMAGE.

"""Megatron-Core's own MoE layer tests, run with MoK substituted.

Source: NVIDIA/Megatron-LM, tests/unit_tests/transformer/moe/test_moe_layer.py at tag core_v0.19.0
(the megatron-core this project pins). Megatron-LM's license (above) covers the copied test
bodies. Each test names the test it copies.

What changed, and only that:
  * `MoELayer(config, submodules)` builds `MoKMoELayer(config, submodules)`, what `use_mok` and
    `--mok` build from the same spec; the block spec goes through `use_mok`. The isinstance checks
    against MoELayer still hold (MoKMoELayer is one); each also checks that MoK's layer is there.
  * Megatron's `Utils` (one NCCL process per GPU under torchrun) becomes `_Utils`: a gloo world of
    this one process. Only the cases with tensor and expert parallel sizes of 1 are kept; the
    others need that many GPUs in Megatron's harness (MoK's expert parallelism against EP 1:
    tests/test_parallel.py, tests/test_megatron.py).
  * The `.cuda()` tests are marked gpu and skip without CUDA. Each has a CPU variant (`*_cpu`) that
    runs the same body on the CPU (MoK's reference backend): parameters initialised there
    (use_cpu_initialization), tensors made there, and for the transformer block what Megatron's
    local attention needs there (tests/test_megatron.py's cpu_gpt_model fixture).
  * test_te_moe_layer and the fp8 recompute cases need Transformer Engine: skipped without it, as
    upstream skips them below TE 1.7.
  * The padding mask: upstream marks "the last 4 tokens as padding" with False, but Megatron's
    router code reads True as padding (tests/test_megatron_routing.py compares MoK with the stock
    router on masks): copied as written, it marks all but 4 tokens of each sequence.

Not copied: test_moe_with_late_initialize (skipped upstream: "Late init of parallel_state was broken
after parallel states refactor MR2988"). The other files of that folder test the parts MoK replaces,
each against MoK's own tests here: the stock dispatchers (test_token_dispatcher.py,
test_a2a_token_dispatcher.py; MoK's exchange in tests/test_parallel.py), TopKRouter called on its own
across TP/EP/CP ranks (test_routers.py, test_aux_loss.py; MoK's router against the stock one in
tests/test_megatron_routing.py), the stock expert classes (test_grouped_mlp.py,
test_sequential_mlp.py, test_moe_single_grouped_weight_numerics.py) and shared experts' internals
(test_shared_experts.py; MoK's shared experts against the stock ones in tests/test_megatron.py),
the dispatchers' agreement on 4096-wide layers over 8 GPUs (test_moe_layer_discrepancy.py), stock
internals MoK refuses or replaces (test_latent_moe_layer.py, test_qb_routing.py,
test_router_replay.py, test_paged_stashing.py, test_multihot_indices_converter.py,
test_router_trace.py), and upcycling (test_upcycling.py: a training run on GPUs; MoK's upcycling
against the stock layer's in tests/test_megatron.py).
"""

import importlib.util

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install -e .[megatron])")

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_submodules,
    get_gpt_layer_with_transformer_engine_submodules,
)
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules  # noqa: E402
from megatron.core.transformer.spec_utils import get_submodules  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlock  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron.core.utils import is_te_min_version  # noqa: E402
from megatron.training.initialize import _set_random_seed  # noqa: E402
from test_megatron import _init, cpu_gpt_model  # noqa: E402, F401

from mok_plugin.megatron import MoKMoELayer, use_mok  # noqa: E402

pytestmark = pytest.mark.megatron

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _Utils:
    """Megatron's tests.unit_tests.test_utilities.Utils for a world of this one process (gloo)."""

    @staticmethod
    def initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=1):
        assert tensor_model_parallel_size == expert_model_parallel_size == 1, "one process: TP = EP = 1"
        parallel_state.destroy_model_parallel()
        _init()

    @staticmethod
    def destroy_model_parallel():
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


Utils = _Utils
MoELayer_under_test = MoKMoELayer  # what the copied bodies build where upstream builds MoELayer


def _on(device: str, layer: torch.nn.Module) -> torch.nn.Module:
    """Upstream's `.cuda()`, or nothing on the CPU."""
    return layer.cuda() if device == "cuda" else layer


def _device(device: str):
    """Upstream's `torch.cuda.current_device()`, or the CPU."""
    return torch.cuda.current_device() if device == "cuda" else "cpu"


class TestMoELayerInit:
    def setup_method(self, method):
        pass

    @pytest.mark.skipif(
        not HAVE_TE or not is_te_min_version("1.7.0.dev0"),
        reason="Expert with TE Linear is only supported in TE 1.7.0 and later.",
    )
    @pytest.mark.parametrize("moe_token_dispatcher_type", ["allgather", "alltoall"])
    @pytest.mark.parametrize("num_moe_experts", [1, 2])
    @pytest.mark.parametrize("grouped_gemm", [True, False])
    def test_te_moe_layer(self, num_moe_experts, moe_token_dispatcher_type, grouped_gemm):
        Utils.initialize_model_parallel(1, 1)
        _set_random_seed(seed_=123, data_parallel_random_init=False)
        self.transformer_config = TransformerConfig(
            num_layers=1,
            hidden_size=12,
            num_attention_heads=4,
            num_moe_experts=num_moe_experts,
            use_cpu_initialization=True,
            moe_token_dispatcher_type=moe_token_dispatcher_type,
            moe_router_topk=2,
            moe_aux_loss_coeff=0.01,
            moe_grouped_gemm=grouped_gemm,
            moe_ffn_hidden_size=128,
            add_bias_linear=False,
        )
        submodules = get_submodules(
            get_gpt_layer_with_transformer_engine_submodules(
                num_experts=num_moe_experts, moe_grouped_gemm=grouped_gemm
            ).mlp
        )
        assert isinstance(submodules, MoESubmodules)
        moe_layer = MoELayer_under_test(self.transformer_config, submodules)
        assert isinstance(moe_layer, MoELayer)  # (added: MoK's layer is one)
        Utils.destroy_model_parallel()

    @pytest.mark.parametrize("moe_token_dispatcher_type", ["allgather", "alltoall"])
    @pytest.mark.parametrize("num_moe_experts", [1, 2])
    @pytest.mark.parametrize("grouped_gemm", [True, False])
    def test_legacy_moe_layer(self, num_moe_experts, moe_token_dispatcher_type, grouped_gemm):
        Utils.initialize_model_parallel(1, 1)
        _set_random_seed(seed_=123, data_parallel_random_init=False)
        num_moe_experts = 4
        self.transformer_config = TransformerConfig(
            num_layers=1,
            hidden_size=12,
            num_attention_heads=4,
            num_moe_experts=num_moe_experts,
            use_cpu_initialization=True,
            moe_token_dispatcher_type=moe_token_dispatcher_type,
            moe_router_load_balancing_type="aux_loss",
            moe_router_topk=2,
            moe_aux_loss_coeff=0.01,
            moe_grouped_gemm=grouped_gemm,
            add_bias_linear=False,
        )
        submodules = get_submodules(
            get_gpt_layer_local_submodules(num_experts=num_moe_experts, moe_grouped_gemm=grouped_gemm).mlp
        )
        assert isinstance(submodules, MoESubmodules)
        moe_layer = MoELayer_under_test(self.transformer_config, submodules)
        assert isinstance(moe_layer, MoELayer)  # (added: MoK's layer is one)
        Utils.destroy_model_parallel()

    def teardown_method(self, method):
        Utils.destroy_model_parallel()


class TestInterleaveTransformerBlock:
    def _test_interleave_transformer_block(self, moe_layer_freq, device):
        Utils.initialize_model_parallel(1, 1)
        if device == "cuda":
            model_parallel_cuda_manual_seed(123)
        self.transformer_config = TransformerConfig(
            num_layers=4,
            hidden_size=64,
            num_attention_heads=4,
            moe_layer_freq=moe_layer_freq,
            moe_ffn_hidden_size=256,
            use_cpu_initialization=True,
            num_moe_experts=2,
            add_bias_linear=False,
        )
        self.parallel_transformer_block = TransformerBlock(
            self.transformer_config, use_mok(get_gpt_decoder_block_spec(self.transformer_config, False))
        )

        # Check if the moe layer is interleaved correctly
        if isinstance(self.transformer_config.moe_layer_freq, int):
            moe_layer_pattern = [
                1 if (i % self.transformer_config.moe_layer_freq == 0) else 0
                for i in range(self.transformer_config.num_layers)
            ]
        else:
            moe_layer_pattern = self.transformer_config.moe_layer_freq

        for i, layer in enumerate(self.parallel_transformer_block.layers):
            is_moe_layer = isinstance(layer.mlp, MoELayer)
            assert is_moe_layer == moe_layer_pattern[i]
            assert isinstance(layer.mlp, MoKMoELayer) == moe_layer_pattern[i]  # (added)

        # Test forward pass
        parallel_transformer_block = self.parallel_transformer_block
        config: TransformerConfig = parallel_transformer_block.config
        sequence_length = 32
        micro_batch_size = 2
        _on(device, parallel_transformer_block)

        # [sequence length, batch size, hidden size]
        hidden_states = torch.ones((sequence_length, micro_batch_size, config.hidden_size))
        hidden_states = hidden_states.to(_device(device))

        attention_mask = torch.ones((1, 1, sequence_length, sequence_length), dtype=bool).to(_device(device))
        hidden_states = parallel_transformer_block(hidden_states=hidden_states, attention_mask=attention_mask)
        assert hidden_states.shape[0] == sequence_length
        assert hidden_states.shape[1] == micro_batch_size
        assert hidden_states.shape[2] == config.hidden_size

    @needs_cuda
    @pytest.mark.gpu
    @pytest.mark.parametrize("moe_layer_freq", [2, eval("[0,1,1,1]"), eval("[0]*2+[1]*2")])
    def test_interleave_transformer_block(self, moe_layer_freq):
        self._test_interleave_transformer_block(moe_layer_freq, "cuda")

    @pytest.mark.usefixtures("cpu_gpt_model")
    @pytest.mark.parametrize("moe_layer_freq", [2, eval("[0,1,1,1]"), eval("[0]*2+[1]*2")])
    def test_interleave_transformer_block_cpu(self, moe_layer_freq):
        self._test_interleave_transformer_block(moe_layer_freq, "cpu")

    def teardown_method(self, method):
        Utils.destroy_model_parallel()


class TestMoELayerFP16:
    """Test MoE layer with FP16 precision."""

    def setup_method(self, method):
        pass

    def _test_moe_layer_fp16_forward_backward(self, num_moe_experts, moe_token_dispatcher_type, tp_size, ep_size,
                                              device):  # fmt: skip
        """Test MoE layer forward and backward pass with fp16 params and inputs."""
        Utils.initialize_model_parallel(tensor_model_parallel_size=tp_size, expert_model_parallel_size=ep_size)
        _set_random_seed(seed_=123, data_parallel_random_init=False)

        hidden_size = 64
        sequence_length = 32
        micro_batch_size = 2

        transformer_config = TransformerConfig(
            num_layers=1,
            hidden_size=hidden_size,
            num_attention_heads=4,
            num_moe_experts=num_moe_experts,
            use_cpu_initialization=device == "cpu",
            moe_token_dispatcher_type=moe_token_dispatcher_type,
            moe_router_load_balancing_type="aux_loss",
            moe_router_topk=2,
            moe_aux_loss_coeff=0.01,
            moe_grouped_gemm=False,  # Use SequentialMLP for fp16 test
            moe_ffn_hidden_size=256,
            add_bias_linear=False,
            tensor_model_parallel_size=tp_size,
            expert_model_parallel_size=ep_size,
            sequence_parallel=tp_size > 1,
            fp16=True,
            params_dtype=torch.float16,
        )

        submodules = get_submodules(
            get_gpt_layer_local_submodules(num_experts=num_moe_experts, moe_grouped_gemm=False).mlp
        )
        assert isinstance(submodules, MoESubmodules)

        moe_layer = _on(device, MoELayer_under_test(transformer_config, submodules))

        hidden_states = torch.randn(
            sequence_length,
            micro_batch_size,
            hidden_size,
            device=_device(device),
            dtype=torch.float16,
            requires_grad=True,
        )

        # Forward pass
        output, _ = moe_layer(hidden_states)

        assert output.dtype == torch.float16, f"Expected fp16 output, got {output.dtype}"
        assert output.shape == hidden_states.shape, "Output shape mismatch"

        # Backward pass
        loss = output.sum()
        loss.backward()

        assert hidden_states.grad is not None, "Input gradients should exist"
        assert hidden_states.grad.dtype == torch.float16, f"Expected fp16 gradients, got {hidden_states.grad.dtype}"

        for name, param in moe_layer.named_parameters():
            if param.requires_grad:
                assert param.grad is not None, f"Gradient for {name} should exist"

        Utils.destroy_model_parallel()

    @needs_cuda
    @pytest.mark.gpu
    @pytest.mark.parametrize("moe_token_dispatcher_type", ["allgather", "alltoall"])
    @pytest.mark.parametrize("num_moe_experts", [2, 4])
    @pytest.mark.parametrize("tp_size,ep_size", [(1, 1)])  # upstream also (2, 2), (4, 2): 4-8 GPUs
    def test_moe_layer_fp16_forward_backward(self, num_moe_experts, moe_token_dispatcher_type, tp_size, ep_size):
        self._test_moe_layer_fp16_forward_backward(num_moe_experts, moe_token_dispatcher_type, tp_size, ep_size,
                                                   "cuda")  # fmt: skip

    @pytest.mark.parametrize("moe_token_dispatcher_type", ["allgather", "alltoall"])
    @pytest.mark.parametrize("num_moe_experts", [2, 4])
    def test_moe_layer_fp16_forward_backward_cpu(self, num_moe_experts, moe_token_dispatcher_type):
        self._test_moe_layer_fp16_forward_backward(num_moe_experts, moe_token_dispatcher_type, 1, 1, "cpu")

    def teardown_method(self, method):
        Utils.destroy_model_parallel()


class TestMoELayerRecompute:
    """Test MoE layer with recompute enabled (activation checkpointing).

    Tests both code paths:
    - fp8=False: uses tensor_parallel.checkpoint
    - fp8=True: uses te_checkpoint (requires TE >= 1.7.0)
    """

    def setup_method(self, method):
        pass

    def _test_moe_layer_recompute_forward_backward(
        self, num_moe_experts, moe_token_dispatcher_type, with_padding_mask, tp_size, ep_size, fp8, device
    ):
        """Test MoE layer forward and backward pass with recompute enabled.

        When fp8=False, uses tensor_parallel.checkpoint.
        When fp8=True, uses te_checkpoint (requires TE >= 1.7.0).
        """
        # Skip fp8 tests if TE version is not sufficient
        if fp8 and not (HAVE_TE and is_te_min_version("1.7.0.dev0")):
            pytest.skip("FP8 MoE recompute requires TE 1.7.0 and later.")

        Utils.initialize_model_parallel(tensor_model_parallel_size=tp_size, expert_model_parallel_size=ep_size)
        _set_random_seed(seed_=123, data_parallel_random_init=False)

        hidden_size = 64
        sequence_length = 32
        micro_batch_size = 2

        transformer_config = TransformerConfig(
            num_layers=1,
            hidden_size=hidden_size,
            num_attention_heads=4,
            num_moe_experts=num_moe_experts,
            use_cpu_initialization=device == "cpu",
            moe_token_dispatcher_type=moe_token_dispatcher_type,
            moe_router_load_balancing_type="aux_loss",
            moe_router_topk=2,
            moe_aux_loss_coeff=0.01,
            moe_grouped_gemm=False,
            moe_ffn_hidden_size=256,
            add_bias_linear=False,
            # Enable recompute for MoE layer
            recompute_granularity="selective",
            recompute_modules=["moe"],
            tensor_model_parallel_size=tp_size,
            expert_model_parallel_size=ep_size,
            sequence_parallel=tp_size > 1,
            fp8=fp8,
            bf16=True,
            params_dtype=torch.bfloat16,
        )

        # Use TE spec for fp8, local spec otherwise
        if fp8:
            submodules = get_submodules(
                get_gpt_layer_with_transformer_engine_submodules(
                    num_experts=num_moe_experts, moe_grouped_gemm=False
                ).mlp
            )
        else:
            submodules = get_submodules(
                get_gpt_layer_local_submodules(num_experts=num_moe_experts, moe_grouped_gemm=False).mlp
            )
        assert isinstance(submodules, MoESubmodules)

        moe_layer = _on(device, MoELayer_under_test(transformer_config, submodules))
        assert moe_layer.moe_layer_recompute  # (added: the recompute is on in MoK's layer too)

        hidden_states = torch.randn(
            sequence_length,
            micro_batch_size,
            hidden_size,
            device=_device(device),
            dtype=torch.bfloat16,
            requires_grad=True,
        )

        # Create padding mask if needed: shape [batch_size, sequence_length]
        padding_mask = None
        if with_padding_mask:
            padding_mask = torch.ones(
                micro_batch_size,
                sequence_length,
                device=_device(device),
                dtype=torch.bool,
            )
            # Mark last 4 tokens as padding for each batch
            padding_mask[:, -4:] = False

        output, _ = moe_layer(hidden_states, padding_mask=padding_mask)

        assert output.dtype == torch.bfloat16, f"Expected bf16 output, got {output.dtype}"
        assert output.shape == hidden_states.shape, "Output shape mismatch"

        # Backward pass - this is where recompute/checkpoint is actually used
        loss = output.sum()
        loss.backward()

        assert hidden_states.grad is not None, "Input gradients should exist"
        assert hidden_states.grad.dtype == torch.bfloat16, f"Expected bf16 gradients, got {hidden_states.grad.dtype}"

        for name, param in moe_layer.named_parameters():
            if param.requires_grad:
                assert param.grad is not None, f"Gradient for {name} should exist"

        Utils.destroy_model_parallel()

    @needs_cuda
    @pytest.mark.gpu
    @pytest.mark.parametrize("moe_token_dispatcher_type", ["allgather", "alltoall"])
    @pytest.mark.parametrize("num_moe_experts", [2, 4])
    @pytest.mark.parametrize("with_padding_mask", [True, False])
    @pytest.mark.parametrize("tp_size,ep_size", [(1, 1)])  # upstream also (4, 2): 8 GPUs
    @pytest.mark.parametrize("fp8", [False, True])
    def test_moe_layer_recompute_forward_backward(
        self, num_moe_experts, moe_token_dispatcher_type, with_padding_mask, tp_size, ep_size, fp8
    ):
        self._test_moe_layer_recompute_forward_backward(
            num_moe_experts, moe_token_dispatcher_type, with_padding_mask, tp_size, ep_size, fp8, "cuda"
        )

    @pytest.mark.parametrize("moe_token_dispatcher_type", ["allgather", "alltoall"])
    @pytest.mark.parametrize("num_moe_experts", [2, 4])
    @pytest.mark.parametrize("with_padding_mask", [True, False])
    def test_moe_layer_recompute_forward_backward_cpu(self, num_moe_experts, moe_token_dispatcher_type,
                                                      with_padding_mask):  # fmt: skip
        self._test_moe_layer_recompute_forward_backward(
            num_moe_experts, moe_token_dispatcher_type, with_padding_mask, 1, 1, False, "cpu"
        )

    def teardown_method(self, method):
        Utils.destroy_model_parallel()
