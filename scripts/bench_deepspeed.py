"""Train a small MoE language model under DeepSpeed with the stock MoE layer and with MoK, in the
same process on the same data and initial weights, and print tokens/s and the losses of both.

    torchrun --nproc-per-node 2 scripts/bench_deepspeed.py --ep-size 2 --zero-stage 2 --out out/ds.json
    python scripts/bench_deepspeed.py --tiny                    # one CPU process, a smoke run

The model: token embedding, `--layers` blocks of (LayerNorm, MoE, residual), a tied output head,
next-token cross-entropy on random tokens, plus 0.01 x the MoE aux loss. The MoE layers are
`deepspeed.moe.layer.MoE` with a SwiGLU expert, built dropless and without random routing
(`drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False`); the MoK variant is the same
model built after `mok_plugin.deepspeed.apply(ds_config)` (the ds_config's "mok" block enabled),
loaded with the stock variant's initial weights. Step times exclude the first two steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deepspeed  # noqa: E402
from deepspeed.moe.layer import MoE  # noqa: E402

import mok_plugin.deepspeed as mds  # noqa: E402
from mok_plugin.testing import free_port  # noqa: E402


class MoELanguageModel(nn.Module):
    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.hidden)
        nn.init.normal_(self.embed.weight, std=0.02)  # LM-sized, so the tied head's loss starts near ln(vocab)
        self.norms = nn.ModuleList(nn.LayerNorm(args.hidden) for _ in range(args.layers))
        self.moes = nn.ModuleList(
            MoE(args.hidden, mds.SwiGLUExpert(args.hidden, args.ffn), num_experts=args.experts, ep_size=args.ep_size,
                k=args.k, drop_tokens=False, use_rts=False, top2_2nd_expert_sampling=False)
            for _ in range(args.layers)
        )  # fmt: skip

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens[:, :-1])
        aux = h.new_zeros((), dtype=torch.float32)
        for norm, moe in zip(self.norms, self.moes, strict=True):
            out, l_aux, _ = moe(norm(h))
            h = h + out
            aux = aux + l_aux
        logits = F.linear(h, self.embed.weight)
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) + 0.01 * aux


def ds_config(args: argparse.Namespace, mok: bool) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": args.zero_stage},
        "mok": {"enabled": mok},
    }
    if args.bf16:
        config["bf16"] = {"enabled": True}
    return config


def run_variant(args, variant: str, init_state: dict | None, device: torch.device, rank: int) -> dict:
    config = ds_config(args, mok=variant == "mok")
    mds.apply(config)  # builds MoK layers when config["mok"]["enabled"], stock ones otherwise
    try:
        torch.manual_seed(args.seed)
        model = MoELanguageModel(args)
        if init_state is not None:
            model.load_state_dict(init_state)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    finally:
        mds.revert()
    generator = torch.Generator().manual_seed(args.seed + rank)
    losses, times = [], []
    for _ in range(args.steps):
        tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=generator).to(device)
        start = time.perf_counter()
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    steady = times[2:] or times
    world = torch.distributed.get_world_size()
    step_s = statistics.median(steady)
    return {"variant": variant, "losses": losses, "step_ms": step_s * 1e3,
            "tokens_per_s": args.micro_batch * args.seq * world / step_s, "init_state": state}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--ep-size", type=int, default=1)
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2], default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--tiny", action="store_true", help="a CPU smoke run: a tiny model, 3 steps")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.tiny:
        args.layers, args.hidden, args.ffn, args.experts, args.k = 2, 32, 16, 4, 3
        args.vocab, args.seq, args.micro_batch, args.steps = 64, 16, 2, 3
    on_gpu = torch.cuda.is_available() and not args.tiny
    args.bf16 = on_gpu
    if "RANK" not in os.environ:  # one process without torchrun
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    rank = torch.distributed.get_rank()
    stock = run_variant(args, "stock", None, device, rank)
    mok = run_variant(args, "mok", stock.pop("init_state"), device, rank)
    mok.pop("init_state")
    if rank == 0:
        world, dtype = torch.distributed.get_world_size(), "bf16" if args.bf16 else "fp32"
        print(f"\nbench_deepspeed: {args.layers} layers, H={args.hidden}, I={args.ffn}, E={args.experts}, k={args.k}, "
              f"seq {args.seq} x micro-batch {args.micro_batch} x {world} ranks, EP={args.ep_size}, "
              f"ZeRO-{args.zero_stage}, {dtype}, {device.type}")  # fmt: skip
        print(f"{'variant':<8} {'step ms':>9} {'tokens/s':>10}  losses")
        for r in (stock, mok):
            losses = " ".join(f"{x:.4f}" for x in r["losses"])
            print(f"{r['variant']:<8} {r['step_ms']:>9.1f} {r['tokens_per_s']:>10.0f}  {losses}")
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                            "results": [stock, mok]}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
