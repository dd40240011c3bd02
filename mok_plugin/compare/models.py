"""The model the comparison harness trains in-process: a small MoE language model whose MoE layers
come from a framework, stock or MoK.

    tokens -> embedding -> L x [x + MoE(LayerNorm(x))] -> tied output head -> next-token loss

`megatron`: Megatron-Core's MoELayer (stock, local spec, allgather dispatcher) or MoKMoELayer, built
from one TransformerConfig. `deepspeed`: deepspeed.moe.layer.MoE (stock, dropless, no random
routing, each expert drawn on its own rather than copied) or mok_plugin.deepspeed.MoE (which the
harness loads with the stock model's weights). The loss adds the MoE aux losses the way each framework
wants them (Megatron: through MoEAuxLossAutoScaler inside the layer, so the returned loss is the
cross-entropy alone; DeepSpeed: the run config's `aux_loss_coeff` x the sum of the layers' l_aux).
After each forward the model keeps the cross-entropy (`last_lm_loss`) and, with DeepSpeed, the
unscaled aux loss (`last_aux_loss`), so the harness can report the language-model loss, which means
the same thing under both frameworks.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from mok_plugin.run.topology import RunConfig

__all__ = ["MoELanguageModel", "build_model"]

VOCAB = 512


class MoELanguageModel(nn.Module):
    def __init__(self, run: RunConfig, moe_factory, returns_aux: bool, aux_coeff: float = 0.0):
        super().__init__()
        H = run.model.hidden_size
        self.embed = nn.Embedding(VOCAB, H)
        nn.init.normal_(self.embed.weight, std=0.02)  # small, as LM embeddings are: the tied head starts near uniform
        self.norms = nn.ModuleList(nn.LayerNorm(H) for _ in range(run.model.moe_layers))
        self.moes = nn.ModuleList(moe_factory() for _ in range(run.model.moe_layers))
        self.returns_aux = returns_aux  # DeepSpeed's MoE returns (out, l_aux, counts); Megatron's (out, bias)
        self.aux_coeff = aux_coeff  # DeepSpeed only: Megatron's layers scale and add their own aux loss
        self.last_lm_loss: torch.Tensor | None = None  # fp32 scalar, detached: the last forward's cross-entropy
        self.last_aux_loss: torch.Tensor | None = None  # fp32 scalar, detached: its summed l_aux (DeepSpeed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """int64 [B, S + 1] tokens -> the loss to minimise: next-token cross-entropy (+ aux_coeff x l_aux)."""
        h = self.embed(tokens[:, :-1]).transpose(0, 1)  # [S, B, H], Megatron's layout
        aux = h.new_zeros((), dtype=torch.float32)
        for norm, moe in zip(self.norms, self.moes, strict=True):
            out = moe(norm(h))
            if self.returns_aux:
                aux = aux + out[1]
            h = h + out[0]
        logits = F.linear(h.transpose(0, 1), self.embed.weight)
        lm_loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        self.last_lm_loss = lm_loss.detach()
        if not self.returns_aux:
            return lm_loss
        self.last_aux_loss = aux.detach().float()
        return lm_loss + self.aux_coeff * aux


def _megatron_factory(run: RunConfig, variant: str, device: torch.device):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer import TransformerConfig

    from mok_plugin.compare.stock_cpu import make_stock_router_cpu_safe
    from mok_plugin.megatron import set_default_mok_overrides, use_mok

    m, cfg = run.model, run.mok_config()
    config = TransformerConfig(
        num_layers=m.moe_layers, hidden_size=m.hidden_size, num_attention_heads=1, ffn_hidden_size=m.ffn_hidden_size,
        moe_ffn_hidden_size=m.ffn_hidden_size, num_moe_experts=cfg.num_experts, moe_router_topk=cfg.top_k,
        moe_router_pre_softmax=cfg.score_function == "softmax" and not cfg.norm_topk_prob,
        moe_router_score_function=cfg.score_function,
        moe_router_load_balancing_type="aux_loss" if cfg.aux_loss_coeff else "none",
        moe_aux_loss_coeff=cfg.aux_loss_coeff, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, moe_token_dispatcher_type="allgather" if device.type == "cpu" else "alltoall",
        use_cpu_initialization=device.type == "cpu", gradient_accumulation_fusion=False,
        params_dtype=torch.float32 if device.type == "cpu" else torch.bfloat16, bf16=device.type != "cpu",
    )  # fmt: skip
    spec = get_moe_module_spec(use_te=False, num_experts=cfg.num_experts, moe_grouped_gemm=False)
    if variant == "mok":
        set_default_mok_overrides({"backend": cfg.backend})
        return functools.partial(use_mok(spec), config=config)

    def stock():
        layer = spec(config=config)
        if device.type == "cpu":
            make_stock_router_cpu_safe(layer)
        return layer

    return stock


def _deepspeed_factory(run: RunConfig, variant: str):
    from deepspeed.moe.layer import MoE as StockMoE

    import mok_plugin.deepspeed as mds

    m, cfg = run.model, run.mok_config()
    kwargs = dict(num_experts=cfg.num_experts, k=cfg.top_k, drop_tokens=False, use_rts=False,
                  top2_2nd_expert_sampling=False)  # fmt: skip
    if variant == "mok":
        return lambda: mds.MoE(m.hidden_size, mds.SwiGLUExpert(m.hidden_size, m.ffn_hidden_size), **kwargs,
                               mok_config={"backend": cfg.backend})  # fmt: skip

    def stock():
        layer = StockMoE(m.hidden_size, mds.SwiGLUExpert(m.hidden_size, m.ffn_hidden_size), **kwargs)
        # DeepSpeed starts every expert as a copy of the one expert module it is given. Identical
        # experts make the router's true gradient zero (any routing gives the same output), so what
        # it gets is rounding noise (~1e-10), which differs between the stock and MoK layers' sums
        # and which Adam scales up into real updates: the two routers, then the runs, drift apart
        # for no reason of their own. Each expert gets its own draw instead (nn.Linear's default
        # init, from the seeded global generator); MoK's model loads these weights.
        for expert in layer.deepspeed_moe.experts.deepspeed_experts:
            for module in expert.modules():
                if isinstance(module, nn.Linear):
                    module.reset_parameters()
        return layer

    return stock


def build_model(run: RunConfig, framework: str, variant: str, device: torch.device) -> MoELanguageModel:
    """The comparison model with `framework`'s MoE layers, `variant` "stock" or "mok", seeded."""
    torch.manual_seed(0)
    if framework == "megatron":
        model = MoELanguageModel(run, _megatron_factory(run, variant, device), returns_aux=False)
    elif framework == "deepspeed":
        aux_coeff = run.mok_config().aux_loss_coeff
        model = MoELanguageModel(run, _deepspeed_factory(run, variant), returns_aux=True, aux_coeff=aux_coeff)
    else:
        raise ValueError(f"framework={framework!r}; allowed: megatron, deepspeed")
    if device.type == "cuda" and framework == "megatron":
        # Megatron's GPU layers are built in bf16; the rest of the model follows (DeepSpeed's engine
        # casts the model itself from its "bf16" block).
        return model.to(device=device, dtype=torch.bfloat16)
    return model.to(device)
