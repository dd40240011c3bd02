"""The model the comparison harness trains in-process: a small MoE language model whose MoE layers
come from a framework, stock or MoK.

    tokens -> embedding -> L x [x + MoE(LayerNorm(x))] -> tied output head -> next-token loss

`megatron`: Megatron-Core's MoELayer or MoKMoELayer, built from one TransformerConfig. The stock
layer follows the `StockPath` (stock_path.py): Megatron's Transformer Engine spec (TEGroupedMLP,
moe_grouped_gemm, moe_permute_fusion) where TE imports on a GPU, else the local spec
(SequentialMLP); MoK replaces that spec's MoELayer; the "grouped_mm" variant is the local-spec
stock layer with its experts run by torch grouped_mm (the stand-in). Dispatcher: allgather on the
CPU, alltoall on a GPU. `deepspeed`: deepspeed.moe.layer.MoE (stock, each expert drawn on its own
rather than copied) or mok_plugin.deepspeed.MoE (which the harness loads with the stock model's
weights), both with the run config's `deepspeed:` gating arguments (capacity factors, min_capacity,
drop_tokens, use_rts, noisy_gate_policy, top2_2nd_expert_sampling), or without that section the
harness's own: dropless, no random routing (`HARNESS_DEEPSPEED`). The section is DeepSpeed's only:
`check_framework` refuses it with Megatron. MoK's random routing draws from a stream keyed by the
layer's number, which mok_plugin.deepspeed.MoE takes from a process-wide count; the harness numbers
each model's layers 0, 1, ... so that two runs in one process draw the same noise. Both
frameworks' experts compute the run config's expert family (`model.expert_*`): Megatron's through
its own flags (`gated_linear_unit`, `activation_func`, the clamp and offset, `add_bias_linear`),
DeepSpeed's as `FamilyExpert`, a plain module that MoK recognises or, for a clamped GLU, runs
through its generic path.

The loss adds the MoE aux losses the way each framework wants them (Megatron: through
MoEAuxLossAutoScaler inside the layer, so the returned loss is the cross-entropy alone; DeepSpeed:
the run config's `aux_loss_coeff` x the sum of the layers' l_aux). After each forward the model
keeps the cross-entropy (`last_lm_loss`) and, with DeepSpeed, the unscaled aux loss
(`last_aux_loss`), so the harness can report the language-model loss, which means the same thing
under both frameworks.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch import nn

from mok_plugin.compare.stock_path import StockPath, select_stock_path, stock_moe_spec, use_grouped_mm_experts
from mok_plugin.experts import MoKExpertFamily, activation
from mok_plugin.run.topology import DeepSpeedGating, RunConfig

__all__ = ["HARNESS_DEEPSPEED", "VARIANT_NAMES", "FamilyExpert", "MoELanguageModel", "build_model", "check_framework",
           "check_framework_family", "deepspeed_gating", "describe_gating", "random_options"]  # fmt: skip

VOCAB = 512
# "grouped_mm": the PyTorch grouped_mm stand-in (Megatron only; stock_path.use_grouped_mm_experts).
VARIANT_NAMES = ("stock", "mok", "grouped_mm")
# DeepSpeed's gating when the run config has no `deepspeed:` section: dropless and nothing random,
# so that the stock and MoK layers train the same model step by step (what the harness always did).
HARNESS_DEEPSPEED = DeepSpeedGating(drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)


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


class FamilyExpert(nn.Module):
    """One expert of `family` (mok_plugin/experts.py) as a user writes it for DeepSpeed: gate/up/down
    for a glu (GPT-OSS's clamp and offset in the forward), fc1/fc2 for an mlp, one Linear(H, H)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, family: MoKExpertFamily):
        super().__init__()
        self.family = family
        H, I, b1, b2 = hidden_size, ffn_hidden_size, family.fc1_bias, family.fc2_bias
        if family.kind == "linear":
            self.linear = nn.Linear(H, H, bias=b2)
            return
        if family.kind == "glu":
            self.gate_proj = nn.Linear(H, I, bias=b1)
        self.up_proj = nn.Linear(H, I, bias=b1)
        self.down_proj = nn.Linear(I, H, bias=b2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.family.kind == "linear":
            return self.linear(x)
        h = self.up_proj(x) if self.family.kind == "mlp" else torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
        return self.down_proj(activation(h, self.family))


def check_framework_family(run: RunConfig, framework: str) -> None:
    """Raise ValueError (naming the run-config fields) when `framework`'s stock layer cannot compute
    the run config's expert family, before anything is built or imported: a linear expert, or one
    linear biased and not the other (--add-bias-linear sets both), for Megatron."""
    family = run.mok_config().expert_family
    if framework != "megatron":
        return
    if family.kind == "linear":
        raise ValueError(
            "model.expert_kind='linear': Megatron's experts are MLPs; compare it with --framework deepspeed"
        )
    if family.fc1_bias != family.fc2_bias:
        raise ValueError(
            f"model.expert_fc1_bias={family.fc1_bias}, model.expert_fc2_bias={family.fc2_bias}: Megatron's "
            "--add-bias-linear gives both linears a bias (and the router); set both alike"
        )


def check_framework(run: RunConfig, framework: str) -> None:
    """Raise ValueError (naming the run-config section or fields) when `framework` cannot run `run`:
    `check_framework_family`, and a `deepspeed:` section with Megatron (it states DeepSpeed's gating,
    which Megatron's layer does not have; ignoring it would compare something else than it says)."""
    check_framework_family(run, framework)
    if framework == "megatron" and run.deepspeed is not None:
        raise ValueError(
            "deepspeed: this section states DeepSpeed's MoE gating (capacity_factor, drop_tokens, use_rts, ...) and "
            "applies to --framework deepspeed only; run it with --framework deepspeed, or remove the section to "
            "compare Megatron's dropless layers"
        )


def deepspeed_gating(run: RunConfig) -> DeepSpeedGating:
    """The DeepSpeed gating arguments of `run`: its `deepspeed:` section, else `HARNESS_DEEPSPEED`."""
    return run.deepspeed if run.deepspeed is not None else HARNESS_DEEPSPEED


def random_options(gating: DeepSpeedGating, top_k: int) -> list[str]:
    """The options of `gating` that draw random numbers in training at `top_k`, as DeepSpeed's gate
    does: Jitter at any k, RSample at k = 1, use_rts at k = 1 with dropping (DeepSpeed draws it
    dropless too, where it changes nothing), top2_2nd_expert_sampling at k = 2."""
    policy = gating.noisy_gate_policy
    return [name for name, on in (
        (f"noisy_gate_policy={policy}", policy == "Jitter" or (policy == "RSample" and top_k == 1)),
        ("use_rts", gating.use_rts and gating.drop_tokens and top_k == 1),
        ("top2_2nd_expert_sampling", gating.top2_2nd_expert_sampling and top_k == 2),
    ) if on]  # fmt: skip


def describe_gating(gating: DeepSpeedGating, top_k: int) -> str:
    """DeepSpeed's gating in a few words, for the report."""
    drops = (f"capacity factor {gating.capacity_factor:g} (eval {gating.eval_capacity_factor:g}), min_capacity "
             f"{gating.min_capacity}, drop_tokens" if gating.drop_tokens else "dropless")  # fmt: skip
    random = random_options(gating, top_k)
    return f"{drops}; random routing: {', '.join(random) if random else 'none'}"


def _megatron_expert_fields(family: MoKExpertFamily) -> dict:
    """The TransformerConfig fields that make Megatron's experts compute `family` (one that
    `check_framework_family` accepts)."""
    from mok_plugin.megatron.config_map import megatron_activation

    act = megatron_activation(family.activation)
    return dict(gated_linear_unit=family.kind == "glu", activation_func=act, activation_func_clamp_value=family.clamp,
                glu_linear_offset=family.linear_offset, add_bias_linear=family.fc1_bias)  # fmt: skip


def _megatron_factory(run: RunConfig, variant: str, device: torch.device, stock_path: StockPath):
    from megatron.core.transformer import TransformerConfig

    from mok_plugin.compare.stock_cpu import let_stock_fc2_bias_train_at_ep1, make_stock_router_cpu_safe
    from mok_plugin.megatron import set_default_mok_overrides, use_mok

    m, cfg = run.model, run.mok_config()
    options = stock_path.config_options()
    if variant == "grouped_mm":  # the local spec's SequentialMLP, its experts run by grouped_mm
        options["moe_grouped_gemm"] = False
    config = TransformerConfig(
        num_layers=m.moe_layers, hidden_size=m.hidden_size, num_attention_heads=1, ffn_hidden_size=m.ffn_hidden_size,
        moe_ffn_hidden_size=m.ffn_hidden_size, num_moe_experts=cfg.num_experts, moe_router_topk=cfg.top_k,
        moe_router_pre_softmax=cfg.score_function == "softmax" and not cfg.norm_topk_prob,
        moe_router_score_function=cfg.score_function,
        moe_router_load_balancing_type="aux_loss" if cfg.aux_loss_coeff else "none",
        moe_aux_loss_coeff=cfg.aux_loss_coeff, **_megatron_expert_fields(cfg.expert_family),
        moe_token_dispatcher_type="allgather" if device.type == "cpu" else "alltoall",
        use_cpu_initialization=device.type == "cpu", gradient_accumulation_fusion=False,
        params_dtype=torch.float32 if device.type == "cpu" else torch.bfloat16, bf16=device.type != "cpu",
        **options,
    )  # fmt: skip
    spec = stock_moe_spec(cfg.num_experts, stock_path.transformer_engine and variant != "grouped_mm")
    if variant == "mok":
        set_default_mok_overrides({"backend": cfg.backend})
        if cfg.fp8 is not None:
            # Megatron's config asks for Transformer Engine when FP8 meets MoE (its FP8 layers run through
            # it); this model has no layer but the MoE ones, so the flags are set after its checks.
            config = copy.copy(config)
            config.fp8, config.fp8_recipe = cfg.fp8, cfg.fp8_scaling
        return functools.partial(use_mok(spec), config=config)

    def stock():
        layer = spec(config=config)
        if device.type == "cpu":
            make_stock_router_cpu_safe(layer)
        if config.add_bias_linear and hasattr(layer.experts, "local_experts"):  # SequentialMLP's fc2
            let_stock_fc2_bias_train_at_ep1(layer)
        if variant == "grouped_mm":
            use_grouped_mm_experts(layer, cfg.expert_family)
        return layer

    return stock


def _deepspeed_factory(run: RunConfig, variant: str):
    from deepspeed.moe.layer import MoE as StockMoE

    import mok_plugin.deepspeed as mds

    m, cfg = run.model, run.mok_config()
    kwargs = dict(num_experts=cfg.num_experts, k=cfg.top_k, **deepspeed_gating(run).moe_kwargs())

    def expert() -> nn.Module:
        return FamilyExpert(m.hidden_size, m.ffn_hidden_size, cfg.expert_family)

    if variant == "mok":
        fp8 = {"fp8": cfg.fp8, "fp8_scaling": cfg.fp8_scaling} if cfg.fp8 is not None else {}
        knobs = {"backend": cfg.backend, **fp8}
        return lambda: mds.MoE(m.hidden_size, expert(), **kwargs, mok_config=knobs)

    def stock():
        layer = StockMoE(m.hidden_size, expert(), **kwargs)
        # DeepSpeed starts every expert as a copy of the one expert module it is given. Identical
        # experts make the router's true gradient zero (any routing gives the same output), so what
        # it gets is rounding noise (~1e-10), which differs between the stock and MoK layers' sums
        # and which Adam scales up into real updates: the two routers, then the runs, drift apart
        # for no reason of their own. Each expert gets its own draw instead (nn.Linear's default
        # init, from the seeded global generator); MoK's model loads these weights.
        for each in layer.deepspeed_moe.experts.deepspeed_experts:
            for module in each.modules():
                if isinstance(module, nn.Linear):
                    module.reset_parameters()
        return layer

    return stock


def build_model(run: RunConfig, framework: str, variant: str, device: torch.device,
                stock_path: StockPath | None = None) -> MoELanguageModel:  # fmt: skip
    """The comparison model with `framework`'s MoE layers, seeded.

    Args:
        variant: "stock", "mok", or "grouped_mm" (the PyTorch grouped_mm stand-in; Megatron only).
        stock_path: the stock path (default: `select_stock_path(framework, device)`); MoK replaces
            its spec's layer, the stand-in keeps its dispatcher settings.
    """
    if variant not in VARIANT_NAMES or (variant == "grouped_mm" and framework != "megatron"):
        raise ValueError(f"variant={variant!r} with framework={framework!r}; allowed: stock, mok, and grouped_mm "
                         "with megatron")  # fmt: skip
    torch.manual_seed(0)
    check_framework(run, framework)
    if framework == "megatron":
        path = stock_path if stock_path is not None else select_stock_path(framework, device)
        model = MoELanguageModel(run, _megatron_factory(run, variant, device, path), returns_aux=False)
    elif framework == "deepspeed":
        aux_coeff = run.mok_config().aux_loss_coeff
        model = MoELanguageModel(run, _deepspeed_factory(run, variant), returns_aux=True, aux_coeff=aux_coeff)
        if variant == "mok":  # this model's random streams: layers 0, 1, ..., whatever was built before
            for number, layer in enumerate(model.moes):
                layer.mok.random_stream_layer = layer.mok.routing_fn.layer = number
    else:
        raise ValueError(f"framework={framework!r}; allowed: megatron, deepspeed")
    if device.type == "cuda" and framework == "megatron":
        # Megatron's GPU layers are built in bf16; the rest of the model follows (DeepSpeed's engine
        # casts the model itself from its "bf16" block).
        return model.to(device=device, dtype=torch.bfloat16)
    return model.to(device)
