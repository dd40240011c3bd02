"""The multi-kernel layer's peak memory at small batches, as a model of its allocations: MoK's
kernels replaced by stubs that allocate what they allocate (same shapes, dtypes and lifetimes, no
arithmetic), the peak of the bytes alive among the tensors made during one fwd+bwd (what
torch.cuda.max_memory_allocated follows on a GPU). With h per row the model gives the peaks the
H200 measured (1155.0 / 1201.3 / 1216.4 MiB at T = 1 / 37 / 512, qwen3-30b-a3b's dimensions;
BENCHMARKS.md); with h per pair (`ops.compact_h`) dh's padded rows are gone from the peak."""

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mok_plugin import ops
from mok_plugin.schedule import DEFAULT_TILE_M, build_schedule

H, I, E, K = 2048, 768, 128, 8  # qwen3-30b-a3b's expert dimensions
MIB = 2**20
WEIGHT_GRADS_MIB = E * (2 * I * H + H * I) * 2 / MIB  # dW13 and dW2 in bf16: 1152 MiB


def _stub_kernels(monkeypatch):
    """The launchers ops.py calls, as allocations of their outputs (and of down_dgrad's fp32 dA',
    freed before it returns)."""

    def gate_up_fwd(x, w13, row_to_token, tile_to_expert, tile_m, h_pairs=None, **family):
        rows = row_to_token.shape[0]
        h_rows = rows if h_pairs is None else h_pairs[1]
        return x.new_empty(h_rows, w13.shape[1]), x.new_empty(rows, w13.shape[1] // 2)

    def down_fwd(a, w2, topk_weights, row_to_tk, row_to_token, tile_to_expert, tile_m, **bias):
        return a.new_empty(row_to_token.shape[0], w2.shape[1])

    def down_dgrad(d_out, w2, h, topk_weights, row_to_tk, row_to_token, tile_to_expert, tile_m, **family):
        rows, inner = row_to_token.shape[0], w2.shape[2]
        d_a_prime = torch.empty(rows, inner, dtype=torch.float32)  # noqa: F841 (its bytes, until return)
        return h.new_empty(h.shape), h.new_empty(rows, inner), torch.zeros(rows, 6, dtype=torch.float32)

    def gate_up_dgrad(d_h, w13, row_to_token, tile_to_expert, tile_m, d_h_row_to_pair=None):
        return d_h.new_empty(row_to_token.shape[0], w13.shape[2])

    def expert_wgrad(left, right, row_to_token, offsets, counts, **layout):
        return left.new_empty(counts.shape[0], left.shape[1], right.shape[1])

    def combine_rows(rows, tk_to_row, num_tokens, top_k):
        return rows.new_empty(num_tokens, rows.shape[1])

    def reduce_router_grad(partial, tk_to_row, num_tokens, top_k):
        return torch.empty(num_tokens, top_k, dtype=torch.float32)

    for fn in (gate_up_fwd, down_fwd, down_dgrad, gate_up_dgrad, expert_wgrad, combine_rows, reduce_router_grad):
        monkeypatch.setattr(ops, fn.__name__, fn)


class _PeakOfLiveTensors(TorchDispatchMode):
    """Bytes of the storages made under this mode that are still alive, and their peak. A storage
    is alive while a tensor on it is (torch keeps a tensor's Python object while the C++ tensor
    lives, so autograd's saved tensors count), views made later included: a reshape's copy is
    returned as a view of it, and the copy's own tensor object dies at once."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, tensors on it]
        self.peak = 0

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if not torch.is_tensor(t):
                continue
            key = t.untyped_storage().data_ptr()
            if key not in self.live and key in inputs:
                continue  # a view of a tensor made before the mode (an input, a weight)
            self.live.setdefault(key, [t.untyped_storage().nbytes(), 0])[1] += 1
            weakref.finalize(t, self._release, key)
        self.peak = max(self.peak, sum(size for size, _ in self.live.values()))
        return out


def _peak_mib(T: int, per_pair: bool, monkeypatch) -> float:
    _stub_kernels(monkeypatch)
    monkeypatch.setattr(ops, "COMPACT_H_MIN_RATIO", 2 if per_pair else 10**9)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    schedule = build_schedule(ids, E, tile_m=DEFAULT_TILE_M)
    assert ops.compact_h(schedule.num_rows, T * K) == per_pair
    leaves = [torch.zeros(T, H, dtype=torch.bfloat16), torch.rand(T, K, generator=g),
              torch.zeros(E, 2 * I, H, dtype=torch.bfloat16), torch.zeros(E, H, I, dtype=torch.bfloat16)]  # fmt: skip
    leaves = [t.requires_grad_() for t in leaves]
    d_out = torch.zeros(T, H, dtype=torch.bfloat16)  # the inputs and dO: not the layer's own bytes
    mode = _PeakOfLiveTensors()
    with mode:
        out = ops.moe_experts(*leaves, schedule, variant="multi_kernel")
        grads = torch.autograd.grad(out, leaves, d_out)
        del out, grads
    return mode.peak / MIB


@pytest.mark.parametrize(("T", "measured_on_h200"), [(1, 1155.0), (37, 1201.3), (512, 1216.4)])
def test_the_model_gives_the_measured_peak_with_h_per_row(T, measured_on_h200, monkeypatch):
    assert _peak_mib(T, per_pair=False, monkeypatch=monkeypatch) == pytest.approx(measured_on_h200, abs=0.5)


@pytest.mark.parametrize(("T", "pytorch_path_on_h200"), [(1, 1152.2), (37, 1155.4), (512, 1198.1)])
def test_h_per_pair_keeps_the_peak_under_the_pytorch_paths(T, pytorch_path_on_h200, monkeypatch):
    per_row = _peak_mib(T, per_pair=False, monkeypatch=monkeypatch)
    per_pair = _peak_mib(T, per_pair=True, monkeypatch=monkeypatch)
    rows = build_schedule(torch.zeros(T, K, dtype=torch.int64), E, tile_m=DEFAULT_TILE_M).num_rows
    padded_dh_mib = rows * 2 * I * 2 / MIB
    # dh per pair in place of the padded dh; x read through the pair map, not copied per pair
    assert per_row - per_pair == pytest.approx(padded_dh_mib - T * K * 2 * I * 2 / MIB, abs=0.1)
    assert WEIGHT_GRADS_MIB <= per_pair < pytorch_path_on_h200
