"""Tests for mok_plugin/random_stream.py: the counter-based routing random stream.

Covers: Philox-4x32-10 (and -7) against Random123's published known-answer vectors and against an
independent pure-Python Philox; the documented key layout; stream ids (pinned crc32 values);
pinned output bits (so a change of stream is caught across versions and processes); bitwise
repeatability; invariance to the other tokens in the call, their order, the column count and the
EP split; distinct keys give distinct draws; shapes on the meta device and empty shapes; argument
errors; statistics of uniform, normal and Gumbel draws (moments, Kolmogorov-Smirnov, correlation of
neighbours, the Gumbel-max trick); the exactness of the float64 log/cos; CPU == CUDA bitwise.
"""

from __future__ import annotations

import math

import pytest
import torch

from mok_plugin import random_stream as rs

M32 = 0xFFFFFFFF

# Random123 examples/kat_vectors (D. E. Shaw Research), lines "philox4x32 R CTR[4] KEY[2] EXPECTED[4]".
# The first three are the canonical vectors (zeros, all ones, digits of pi) quoted by every Philox
# port; the others vary one counter or key word at a time.
KAT_10 = [
    pytest.param((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8), id="zeros"),
    pytest.param((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD), id="ones"),
    pytest.param(
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        id="pi",
    ),
    pytest.param((1, 0, 0, 0), (1, 0), (0xAC08141B, 0xDFC5CCBE, 0x79C07A47, 0xA7F66093), id="c0_k0"),
    pytest.param((0, 0, 0, 1), (1, 0), (0x127BEE41, 0x1E047488, 0x48842B20, 0x0A393496), id="c3_k0"),
    pytest.param((0, 0, M32, 0), (0, 1), (0x576241AF, 0xD3B45BEE, 0x619BD94D, 0x15DD8793), id="c2max_k1"),
    pytest.param((0, 0x80000000, 0, 0), (0, M32), (0x715A87CF, 0xF966A7F0, 0x3E6DD95F, 0xE884E2FD), id="c1top_k1max"),
    pytest.param(
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0, 0x80000000),
        (0x63675D2C, 0x422D7C4D, 0x3145D30D, 0x3BCE33A4),
        id="pi_k1top",
    ),
]
KAT_7 = [
    pytest.param((1, 0, 0, 0), (1, 0), (0x6B3257C3, 0x820C5486, 0x4DE08B66, 0x8771D665), id="c0_k0"),
    pytest.param(
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0, M32),
        (0x80FDA6C5, 0x33DB1407, 0x042DEEE8, 0x0DEC8A67),
        id="pi_k1max",
    ),
]

FUNCTIONS = [rs.uniform, rs.normal, rs.gumbel]
FUNCTION_IDS = ["uniform", "normal", "gumbel"]


def _philox_oracle(counter, key, rounds=10):
    """Philox-4x32-R on Python ints, written straight from the paper (full product, then split)."""
    c = [v & M32 for v in counter]
    k = [v & M32 for v in key]
    for r in range(rounds):
        if r:
            k = [(k[0] + 0x9E3779B9) & M32, (k[1] + 0xBB67AE85) & M32]
        p0 = 0xD2511F53 * c[0]
        p1 = 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & M32, (p0 >> 32) ^ c[3] ^ k[1], p0 & M32]
    return tuple(c)


def _as_tensors(words):
    return tuple(torch.tensor([w], dtype=torch.int64) for w in words)


def _bits(x: torch.Tensor) -> list[int]:
    return [v & M32 for v in x.view(torch.int32).flatten().tolist()]


# ---------------------------------------------------------------------------------------------
# The core generator
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("counter", "key", "expected"), KAT_10)
def test_philox_known_answers(counter, key, expected):
    out = rs.philox4x32(_as_tensors(counter), key)
    assert [int(w) for w in out] == list(expected)
    assert all(w.dtype == torch.int64 for w in out)
    # The same function on Python ints (the host path philox_words uses for step and stream).
    assert rs.philox4x32(counter, key) == expected


@pytest.mark.parametrize(("counter", "key", "expected"), KAT_7)
def test_philox_known_answers_7_rounds(counter, key, expected):
    # The round count is a parameter; the 7-round vectors check the key schedule round by round.
    assert [int(w) for w in rs.philox4x32(_as_tensors(counter), key, rounds=7)] == list(expected)


def test_philox_matches_python_oracle():
    # Random words plus the extremes that would expose a sign or carry error in the int64 emulation.
    g = torch.Generator().manual_seed(20240611)
    n = 4096
    words = torch.randint(0, 1 << 32, (6, n), generator=g, dtype=torch.int64)
    edges = torch.tensor([0, 1, M32, M32 - 1, 1 << 31, (1 << 31) - 1, 0xFFFF, 0x10000])
    words[:, : edges.numel()] = edges.unsqueeze(0).roll(1, dims=1).repeat(6, 1)
    words[:4, edges.numel() : 2 * edges.numel()] = edges
    for key in [(0, 0), (M32, M32), (0x12345678, 0x9ABCDEF0), (int(words[4, 9]), int(words[5, 9]))]:
        out = torch.stack(rs.philox4x32(tuple(words[:4]), key), dim=1)
        expected = [_philox_oracle(col, key) for col in words[:4].T.tolist()]
        assert out.tolist() == [list(e) for e in expected]
        assert int(out.min()) >= 0 and int(out.max()) <= M32


def test_philox_argument_errors():
    with pytest.raises(ValueError, match="4 counter words and 2 key words"):
        rs.philox4x32((0, 0, 0), (0, 0))
    with pytest.raises(ValueError, match="rounds=0"):
        rs.philox4x32((0, 0, 0, 0), (0, 0), rounds=0)


def test_key_layout_is_as_documented():
    # key = (seed lo, seed hi); counter = (column, token mod 2**32, step, stream_id).
    seed, step, stream = (0xDEADBEEF << 32) | 0x01234567, 0xFFFFFFFE, "force_balance"
    tokens = torch.tensor([0, 5, (1 << 31) + 3, M32, (1 << 32) + 5, -1])
    words = torch.stack(rs.philox_words(seed, step, stream, tokens, 3), dim=-1)
    for t, tok in enumerate(tokens.tolist()):
        for e in range(3):
            expected = _philox_oracle((e, tok & M32, step, rs.stream_id(stream)), (seed & M32, seed >> 32))
            assert words[t, e].tolist() == list(expected)
    # Tokens are taken modulo 2**32 (documented): index 2**32 + 5 draws the same row as index 5.
    assert torch.equal(words[4], words[1]) and torch.equal(words[5], words[3])


# ---------------------------------------------------------------------------------------------
# Stream ids and pinned outputs
# ---------------------------------------------------------------------------------------------


def test_stream_ids_are_fixed_and_distinct():
    # Pinned crc32 values: the ids must never change between processes, platforms or versions.
    pinned = {"force_balance": 0xCC500138, "rsample": 0xA652C91C, "jitter": 0x9DABE016, "rts": 0x2A6BF958}
    assert {name: rs.stream_id(name) for name in rs.STREAMS} == pinned
    assert rs.stream_id("jitter/layer=3") != rs.stream_id("jitter/layer=4")
    assert rs.stream_id(7) == 7 and rs.stream_id(M32) == M32


@pytest.mark.parametrize(
    ("stream", "error", "match"),
    [
        pytest.param(-1, ValueError, "stream=-1", id="negative"),
        pytest.param(1 << 32, ValueError, "stream=4294967296", id="too_big"),
        pytest.param("", ValueError, "non-empty", id="empty"),
        pytest.param(1.5, TypeError, "stream must be", id="float"),
        pytest.param(True, TypeError, "stream must be", id="bool"),
    ],
)
def test_stream_id_errors(stream, error, match):
    with pytest.raises(error, match=match):
        rs.stream_id(stream)


# Bits of f(seed=2**40 + 123, step=7, "jitter", tokens, 3), first token row (token 0), then an
# order-sensitive int64 checksum of the bit patterns of a [256, 8] draw. Computed on the CPU once;
# any change to the generator, the key layout or the float maps breaks these.
PINNED_ROWS = {
    "uniform": [0x3E2C7DAC, 0x3F6DC9C3, 0x3DD049A8],
    "normal": [0x3F56C055, 0xBDB823F4, 0x3DDEB58A],
    "gumbel": [0xBF13C66C, 0x4026CFCB, 0xBF53A0C1],
}
PINNED_CHECKSUMS = {"uniform": 2207938459275748, "normal": 4419128880155223, "gumbel": 3938708776778166}


def _checksum(x: torch.Tensor) -> int:
    bits = x.contiguous().view(torch.int32).to(torch.int64).flatten() & M32
    return int((bits * torch.arange(1, bits.numel() + 1)).sum())


@pytest.mark.parametrize("fn", FUNCTIONS, ids=FUNCTION_IDS)
def test_pinned_values(fn):
    seed, tokens = (1 << 40) + 123, torch.tensor([0, 1, 7, (1 << 31) + 5, M32])
    assert _bits(fn(seed, 7, "jitter", tokens, 3)[0]) == PINNED_ROWS[fn.__name__]
    assert _checksum(fn(seed, 7, "jitter", torch.arange(256), 8)) == PINNED_CHECKSUMS[fn.__name__]


# ---------------------------------------------------------------------------------------------
# Reproducibility and invariance
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", FUNCTIONS, ids=FUNCTION_IDS)
def test_bitwise_repeat(fn):
    tokens = torch.arange(1000, 1500)
    first = fn(11, 3, "rsample", tokens, 16)
    assert torch.equal(first, fn(11, 3, "rsample", tokens.clone(), 16))
    assert first.dtype == torch.float32 and first.shape == (500, 16) and first.is_contiguous()


@pytest.mark.parametrize("fn", FUNCTIONS, ids=FUNCTION_IDS)
def test_row_depends_only_on_its_token(fn):
    tokens = torch.arange(40, 240)
    full = fn(5, 9, "rts", tokens, 8)
    # Split in two and concatenate.
    halves = torch.cat([fn(5, 9, "rts", tokens[:77], 8), fn(5, 9, "rts", tokens[77:], 8)])
    assert torch.equal(halves, full)
    # Any subset, in any order, with repeats.
    g = torch.Generator().manual_seed(3)
    pick = torch.randint(0, tokens.numel(), (123,), generator=g)
    assert torch.equal(fn(5, 9, "rts", tokens[pick], 8), full[pick])
    # A single token.
    assert torch.equal(fn(5, 9, "rts", tokens[17:18], 8), full[17:18])


@pytest.mark.parametrize("fn", FUNCTIONS, ids=FUNCTION_IDS)
def test_columns_are_a_prefix(fn):
    # Column e is counter word e: asking for fewer columns gives the leading columns of a wider draw.
    tokens = torch.arange(64)
    assert torch.equal(fn(1, 2, "jitter", tokens, 5), fn(1, 2, "jitter", tokens, 64)[:, :5])


@pytest.mark.parametrize(
    "tokens_per_rank",
    [
        pytest.param([48], id="ep1"),
        pytest.param([24, 24], id="ep2"),
        pytest.param([12, 12, 12, 12], id="ep4"),
        pytest.param([0, 30, 1, 17], id="ep4_uneven_empty_rank"),
    ],
)
def test_ep_split_matches_single_rank(tokens_per_rank):
    # Each rank draws for its own tokens, numbered rank offset + local index; the concatenation over
    # ranks equals the single-rank draw. The tensor offsets exercise the no-host-sync form.
    expected = rs.normal(77, 1, "jitter", torch.arange(48), 6)
    counts = torch.tensor(tokens_per_rank)
    offsets = torch.cumsum(counts, 0) - counts
    parts_int, parts_tensor = [], []
    for rank, local in enumerate(tokens_per_rank):
        parts_int.append(rs.normal(77, 1, "jitter", rs.global_token_index(local, int(offsets[rank])), 6))
        parts_tensor.append(rs.normal(77, 1, "jitter", rs.global_token_index(local, offsets[rank]), 6))
    assert torch.equal(torch.cat(parts_int), expected)
    assert torch.equal(torch.cat(parts_tensor), expected)


@pytest.mark.parametrize("fn", FUNCTIONS, ids=FUNCTION_IDS)
@pytest.mark.parametrize("step", [0, 5, (1 << 32) - 1])
def test_a_tensor_step_draws_what_the_int_step_draws(fn, step):
    # The layers keep their call count in an int64 buffer (a CUDA graph replays the draw with the
    # count it advances); the draw must be the int key's, bit for bit. Beyond 2**32 the tensor wraps.
    tokens = torch.arange(64)
    assert torch.equal(fn(9, torch.tensor(step), "jitter", tokens, 5), fn(9, step, "jitter", tokens, 5))
    assert torch.equal(fn(9, torch.tensor(step + (1 << 32)), "jitter", tokens, 5), fn(9, step, "jitter", tokens, 5))


def test_a_tensor_step_must_be_an_int64_scalar():
    with pytest.raises(TypeError, match="int64 0-dim tensor"):
        rs.uniform(1, torch.tensor([1, 2]), "jitter", torch.arange(3), 2)
    with pytest.raises(TypeError, match="int64 0-dim tensor"):
        rs.uniform(1, torch.tensor(1, dtype=torch.int32), "jitter", torch.arange(3), 2)


def test_different_keys_give_different_draws():
    tokens = torch.arange(4096)
    base = rs.uniform(1, 2, "jitter", tokens, 4)
    variants = {
        "seed": rs.uniform(2, 2, "jitter", tokens, 4),
        "seed_high_word": rs.uniform(1 + (1 << 32), 2, "jitter", tokens, 4),
        "step": rs.uniform(1, 3, "jitter", tokens, 4),
        "stream": rs.uniform(1, 2, "rsample", tokens, 4),
        "token": rs.uniform(1, 2, "jitter", tokens + 1, 4),
        "column": rs.uniform(1, 2, "jitter", tokens, 5)[:, 1:],
    }
    for name, other in variants.items():
        # Two independent 23-bit uniforms collide with probability 2**-23: expect no collisions.
        same = (other == base).float().mean().item()
        assert same < 1e-3, f"{name}: {same:.4%} of draws equal the base draw"


# ---------------------------------------------------------------------------------------------
# Shapes, devices and argument errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", FUNCTIONS, ids=FUNCTION_IDS)
def test_meta_shapes(fn):
    out = fn(1, 2, "jitter", torch.arange(7, device="meta"), 5)
    assert out.device.type == "meta" and out.shape == (7, 5) and out.dtype == torch.float32
    cpu_tokens_to_meta = fn(1, 2, "jitter", torch.arange(7), 3, device="meta")
    assert cpu_tokens_to_meta.device.type == "meta" and cpu_tokens_to_meta.shape == (7, 3)
    words = rs.philox_words(1, 2, "jitter", torch.arange(7, device="meta"), 5)
    assert all(w.shape == (7, 5) and w.dtype == torch.int64 for w in words)


@pytest.mark.parametrize("fn", FUNCTIONS, ids=FUNCTION_IDS)
@pytest.mark.parametrize(("tokens", "columns"), [(0, 4), (3, 0), (0, 0)], ids=["no_tokens", "no_columns", "none"])
def test_empty_shapes(fn, tokens, columns):
    out = fn(1, 2, "jitter", torch.arange(tokens), columns)
    assert out.shape == (tokens, columns) and out.dtype == torch.float32


def test_int32_token_index_matches_int64():
    tokens = torch.arange(100, 200)
    assert torch.equal(rs.gumbel(4, 4, "rts", tokens.int(), 3), rs.gumbel(4, 4, "rts", tokens, 3))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        pytest.param({"seed": -1}, ValueError, "seed=-1", id="negative_seed"),
        pytest.param({"seed": 1 << 64}, ValueError, "seed=", id="seed_too_big"),
        pytest.param({"seed": 1.0}, TypeError, "seed must be an int", id="float_seed"),
        pytest.param({"step": 1 << 32}, ValueError, "step=", id="step_too_big"),
        pytest.param({"step": True}, TypeError, "step must be an int", id="bool_step"),
        pytest.param({"columns": -1}, ValueError, "columns=-1", id="negative_columns"),
        pytest.param({"token_index": torch.arange(4.0)}, TypeError, "token_index must be an integer", id="float"),
        pytest.param({"token_index": torch.zeros(2, 2, dtype=torch.int64)}, ValueError, "1-D", id="2d"),
        pytest.param({"token_index": [0, 1]}, TypeError, "token_index must be a torch.Tensor", id="list"),
        pytest.param({"stream": ""}, ValueError, "non-empty", id="empty_stream"),
    ],
)
def test_argument_errors(kwargs, error, match):
    args = {"seed": 1, "step": 0, "stream": "jitter", "token_index": torch.arange(4), "columns": 2} | kwargs
    with pytest.raises(error, match=match):
        rs.uniform(**args)


def test_global_token_index():
    assert torch.equal(rs.global_token_index(4, 10), torch.tensor([10, 11, 12, 13]))
    assert rs.global_token_index(4, 10).dtype == torch.int64
    assert torch.equal(rs.global_token_index(3, torch.tensor(5, dtype=torch.int32)), torch.tensor([5, 6, 7]))
    assert torch.equal(rs.global_token_index(2, torch.tensor([7])), torch.tensor([7, 8]))
    assert rs.global_token_index(0, 3).shape == (0,)
    assert rs.global_token_index(5, torch.tensor(0, device="meta")).device.type == "meta"


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        pytest.param((-1, 0), ValueError, "local_tokens=-1", id="negative_count"),
        pytest.param((2.0, 0), TypeError, "local_tokens must be an int", id="float_count"),
        pytest.param((2, -3), ValueError, "rank_offset=-3", id="negative_offset"),
        pytest.param((2, 1.5), TypeError, "rank_offset must be an int", id="float_offset"),
        pytest.param((2, torch.tensor([1, 2])), ValueError, "one element", id="two_offsets"),
        pytest.param((2, torch.tensor(1.0)), TypeError, "integer tensor", id="float_tensor_offset"),
    ],
)
def test_global_token_index_errors(args, error, match):
    with pytest.raises(error, match=match):
        rs.global_token_index(*args)


# ---------------------------------------------------------------------------------------------
# Value maps: ranges, grids and the float64 log/cos against libm
# ---------------------------------------------------------------------------------------------

EDGE_WORDS = torch.tensor([0, 1, 511, 512, (1 << 30) - 1, 1 << 30, (1 << 31) - 1, 1 << 31, 3 << 30, M32 - 1, M32])


def test_uniform_grid_and_open_interval():
    u = rs._unit_f32(EDGE_WORDS)
    assert u[0].item() == 2.0**-24 and u[-1].item() == 1 - 2.0**-24
    draws = rs.uniform(8, 8, "force_balance", torch.arange(20000), 8)
    for x in (u, draws):
        assert bool(((x > 0) & (x < 1)).all())
        scaled = x.double() * 2.0**24  # odd integers: exact 23-bit grid, never 0 or 1
        assert torch.equal(scaled, scaled.round()) and bool((scaled.long() % 2 == 1).all())


def test_float64_log_and_cos_match_libm():
    # The hand-written float64 log and cos (used so that CPU and CUDA agree bitwise) are accurate to
    # a few float64 ulps, far below the float32 rounding of the outputs.
    g = torch.Generator().manual_seed(1)
    words = torch.cat([EDGE_WORDS, torch.randint(0, 1 << 32, (200000,), generator=g)])
    u = rs._unit_f64(words)
    assert ((rs._log_f64(u) - torch.log(u)).abs() / torch.log(u).abs()).max().item() < 4e-15
    inner = -torch.log(u)
    assert (rs._log_f64(inner) - torch.log(inner)).abs().max().item() < 4e-14
    assert (rs._cos_turn_f64(words) - torch.cos(u * math.tau)).abs().max().item() < 4e-15


def test_normal_and_gumbel_edges_are_finite_and_bounded():
    x0 = EDGE_WORDS.unsqueeze(1).expand(-1, EDGE_WORDS.numel()).reshape(-1)
    x1 = EDGE_WORDS.repeat(EDGE_WORDS.numel())
    z = (torch.sqrt(rs._log_f64(rs._unit_f64(x0)) * -2.0) * rs._cos_turn_f64(x1)).float()
    g = (-rs._log_f64(-rs._log_f64(rs._unit_f64(EDGE_WORDS)))).float()
    assert bool(torch.isfinite(z).all()) and z.abs().max().item() <= 6.77
    assert bool(torch.isfinite(g).all()) and -3.14 <= g.min().item() and g.max().item() <= 22.9


# ---------------------------------------------------------------------------------------------
# Statistics (fixed seeds; bounds are about 5 standard errors, or the KS 1e-3 critical value)
# ---------------------------------------------------------------------------------------------

N_TOKENS, N_COLUMNS = 125_000, 8  # 1e6 draws per distribution
N = N_TOKENS * N_COLUMNS
KS_CRITICAL_1E3 = math.sqrt(-math.log(1e-3 / 2) / 2) / math.sqrt(N)  # asymptotic, ~1.95 / sqrt(N)
EULER_GAMMA = 0.5772156649015329


@pytest.fixture(scope="module")
def draws() -> dict[str, torch.Tensor]:
    tokens = torch.arange(N_TOKENS) + 1_000_000  # not starting at 0, as on a later rank
    return {fn.__name__: fn(20250101, 42, "jitter", tokens, N_COLUMNS) for fn in FUNCTIONS}


def _ks_statistic(x: torch.Tensor, cdf) -> float:
    x = torch.sort(x.double().flatten()).values
    f = cdf(x)
    n = x.numel()
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return max((i / n - f).max().item(), (f - (i - 1) / n).max().item())


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.corrcoef(torch.stack([a.double().flatten(), b.double().flatten()]))[0, 1].item()


def test_uniform_statistics(draws):
    u = draws["uniform"].double()
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / N)
    assert abs(u.var().item() - 1 / 12) < 5 * math.sqrt((1 / 80 - 1 / 144) / N)
    assert _ks_statistic(u, lambda x: x) < KS_CRITICAL_1E3
    # Each column on its own is uniform too (the column is a counter word).
    for e in range(N_COLUMNS):
        assert abs(u[:, e].mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / N_TOKENS)


def test_normal_statistics(draws):
    z = draws["normal"].double()
    assert abs(z.mean().item()) < 5 / math.sqrt(N)
    assert abs(z.var().item() - 1) < 5 * math.sqrt(2 / N)
    assert _ks_statistic(z, torch.special.ndtr) < KS_CRITICAL_1E3
    # Excess kurtosis 0 (se ~ sqrt(24/N)): Box-Muller's tails are right, not just its variance.
    assert abs((z**4).mean().item() / z.var().item() ** 2 - 3) < 5 * math.sqrt(24 / N)


def test_gumbel_statistics(draws):
    g = draws["gumbel"].double()
    sd = math.pi / math.sqrt(6)
    assert abs(g.mean().item() - EULER_GAMMA) < 5 * sd / math.sqrt(N)
    # Var of the sample variance: sd**4 (2 + excess kurtosis 12/5) / N.
    assert abs(g.var().item() - sd**2) < 5 * sd**2 * math.sqrt(4.4 / N)
    assert _ks_statistic(g, lambda x: torch.exp(-torch.exp(-x))) < KS_CRITICAL_1E3


@pytest.mark.parametrize("name", ["uniform", "normal", "gumbel"])
def test_neighbours_are_uncorrelated(draws, name):
    x = draws[name]
    bound = 5 / math.sqrt(N_TOKENS * (N_COLUMNS - 1))
    assert abs(_corr(x[:, :-1], x[:, 1:])) < bound  # adjacent columns (experts) of a token
    assert abs(_corr(x[:-1], x[1:])) < bound  # adjacent tokens, same column
    assert abs(_corr(x[:-N_COLUMNS].reshape(-1), x[N_COLUMNS:].reshape(-1))) < bound  # stride-8 tokens


def test_streams_and_steps_are_uncorrelated(draws):
    tokens = torch.arange(N_TOKENS) + 1_000_000
    base = draws["uniform"]
    bound = 5 / math.sqrt(N)
    assert abs(_corr(base, rs.uniform(20250101, 42, "rsample", tokens, N_COLUMNS))) < bound
    assert abs(_corr(base, rs.uniform(20250101, 43, "jitter", tokens, N_COLUMNS))) < bound


def test_gumbel_max_samples_softmax():
    # argmax(logits + Gumbel) ~ softmax(logits): the reason the stream has a Gumbel map.
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0])
    n = 200_000
    picks = torch.argmax(logits + rs.gumbel(9, 0, "rsample", torch.arange(n), 4), dim=1)
    freq = torch.bincount(picks, minlength=4).double() / n
    p = torch.softmax(logits.double(), 0)
    assert (freq - p).abs().max().item() < 5 * math.sqrt(0.25 / n)


# ---------------------------------------------------------------------------------------------
# CUDA
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device to compare CPU and CUDA bits")
@pytest.mark.parametrize("fn", FUNCTIONS, ids=FUNCTION_IDS)
def test_cpu_and_cuda_agree_bitwise(fn):
    tokens = torch.cat([torch.arange(100_000), torch.tensor([M32, (1 << 31) + 1])])
    on_cpu = fn((1 << 63) + 5, 123, "jitter", tokens, 16)
    on_cuda = fn((1 << 63) + 5, 123, "jitter", tokens.cuda(), 16)
    assert on_cuda.device.type == "cuda"
    mismatch = (on_cpu != on_cuda.cpu()).nonzero()
    assert mismatch.numel() == 0, f"{mismatch.shape[0]} mismatches, first at {mismatch[0].tolist()}"
    # Tokens on the CPU, drawn on the GPU through the device argument.
    assert torch.equal(fn((1 << 63) + 5, 123, "jitter", tokens, 16, device="cuda").cpu(), on_cpu)


def test_recompute_steps_pair_a_no_grad_pass_with_its_recomputation():
    # (mok_plugin/recompute_draws.py) Two no-grad passes queue their steps; the next two calls with
    # gradients take them in order; then new steps again. Never-recomputed passes cannot grow the queue.
    from mok_plugin.recompute_draws import MAX_QUEUED, RecomputeSteps

    counter = iter(range(10**6))
    steps = RecomputeSteps()
    with torch.no_grad():
        first = [steps.take(lambda: next(counter)) for _ in range(2)]
    assert first == [0, 1] and len(steps) == 2
    assert [steps.take(lambda: next(counter)) for _ in range(3)] == [0, 1, 2]
    with torch.no_grad():
        for _ in range(MAX_QUEUED + 10):
            steps.take(lambda: next(counter))
    assert len(steps) == MAX_QUEUED
