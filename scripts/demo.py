"""Layer demo: one MoE layer on its own (the README's main job is the comparison, scripts/compare.py).

Builds a MoKMoE layer from a YAML config, runs forward + backward twice from the same seeds and
checks that the output, the aux loss and every gradient are bitwise equal, then times forward,
backward and forward + backward. Prints one table last; `--json PATH` also writes the numbers.

    python scripts/demo.py --config configs/small.yaml [--tokens 2048] [--device cpu] [--iters 10]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from mok_plugin import MoKMoE, load_config
from mok_plugin.layer import resolve_backend
from mok_plugin.testing import make_layer_inputs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fwd_bwd(layer: MoKMoE, x: torch.Tensor, probe: torch.Tensor) -> dict[str, torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out, aux = layer(x)
    ((out.float() * probe).sum() + aux).backward()
    results = {"output": out.detach(), "aux_loss": aux.detach(), "d_x": x.grad}
    results.update({f"d_{name}": p.grad for name, p in layer.named_parameters()})
    return results


def _time_ms(fn, device: torch.device, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _quantiles(times: list[float]) -> tuple[float, float, float]:
    qs = statistics.quantiles(times, n=10) if len(times) > 1 else [times[0]] * 9
    return statistics.median(times), qs[1], qs[7]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", default="configs/small.yaml", help="YAML config (a mok: section or top-level fields)"
    )
    parser.add_argument("--tokens", type=int, default=2048, help="T, tokens in the batch")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per pass")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    cfg = load_config(args.config)
    device = torch.device(args.device)
    backend = resolve_backend(cfg.backend, device)
    T, H, I, E, K = args.tokens, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_experts, cfg.top_k
    print(f"MoK layer demo: config {args.config}")
    print(
        f"  shape (T, H, I, E, K) = ({T}, {H}, {I}, {E}, {K}), shared experts {cfg.num_shared_experts}, "
        f"dtype {cfg.params_dtype}, device {device}, backend {backend}"
    )

    layer = MoKMoE(cfg, device=device, seed=args.seed)
    x = make_layer_inputs(T, H, dtype=layer.params_dtype, device=device, seed=args.seed + 1)
    probe = make_layer_inputs(T, H, dtype=torch.float32, device=device, seed=args.seed + 2)

    # Determinism: two layers built from the same seed, each run once, compared bit for bit.
    runs = [_fwd_bwd(MoKMoE(cfg, device=device, seed=args.seed), x, probe) for _ in range(2)]
    mismatched = [name for name in runs[0] if not torch.equal(runs[0][name], runs[1][name])]
    bitwise = not mismatched
    print(
        f"  determinism: {len(runs[0])} tensors compared (output, aux loss, d_x, every weight gradient): "
        + ("bitwise equal" if bitwise else f"MISMATCH in {', '.join(mismatched)}")
    )

    def forward():
        with torch.no_grad():
            layer(x)

    def forward_backward():
        _fwd_bwd(layer, x, probe)

    for fn in (forward, forward_backward):  # warm-up
        fn()
    fwd = _time_ms(forward, device, args.iters)
    fwd_bwd = _time_ms(forward_backward, device, args.iters)
    flops_fwd = 6 * T * K * H * I  # DESIGN.md convention: routed SwiGLU experts only
    rows = []
    for name, times, flops in (("forward", fwd, flops_fwd), ("fwd+bwd", fwd_bwd, 3 * flops_fwd)):
        med, p20, p80 = _quantiles(times)
        rows.append({"pass": name, "ms": med, "p20": p20, "p80": p80, "tflops": flops / med / 1e9})
    bwd_ms = rows[1]["ms"] - rows[0]["ms"]
    rows.insert(
        1,
        {
            "pass": "backward*",
            "ms": bwd_ms,
            "p20": float("nan"),
            "p80": float("nan"),
            "tflops": 2 * flops_fwd / bwd_ms / 1e9 if bwd_ms > 0 else float("nan"),
        },
    )

    print()
    print(f"{'pass':<10} {'ms (median)':>12} {'p20-p80':>17} {'TFLOP/s':>9}  bitwise")
    for row in rows:
        spread = f"{row['p20']:.2f}-{row['p80']:.2f}" if row["p20"] == row["p20"] else "-"
        print(f"{row['pass']:<10} {row['ms']:>12.2f} {spread:>17} {row['tflops']:>9.3f}  {'yes' if bitwise else 'NO'}")
    print("* backward = median(fwd+bwd) - median(forward)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "config": cfg.model_dump(),
                    "shape": [T, H, I, E, K],
                    "device": str(device),
                    "backend": backend,
                    "torch": torch.__version__,
                    "python": platform.python_version(),
                    "bitwise": bitwise,
                    "mismatched": mismatched,
                    "rows": rows,
                },
                indent=2,
            )
        )
        print(f"wrote {args.json}")
    return 0 if bitwise else 1


if __name__ == "__main__":
    raise SystemExit(main())
