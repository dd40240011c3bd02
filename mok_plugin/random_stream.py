"""Counter-based random streams for routing randomness: a draw is a pure function of its key.

Owns: the Philox-4x32-10 block function on int64 tensors, the key layout below, and the maps from
its 32-bit words to uniform, standard normal and Gumbel floats. Used wherever a framework routes
randomly (DeepSpeed's noisy gates and random token selection, second-expert sampling, router
jitter), so that the noise is bitwise repeatable and independent of batch composition and EP size.

Does not own: what the noise is used for (routing.py and the adapters), the seed policy (callers
pass the framework's seed), or the global token numbering (callers pass it; `global_token_index`
only builds the usual "rank offset + local index" form).

Key layout. Every element (t, e) of a [T, columns] draw is one Philox-4x32-10 block with

    key     = (seed mod 2**32, seed >> 32)                          seed in [0, 2**64)
    counter = (e, token_index[t] mod 2**32, step, stream_id(stream)) e in [0, columns), step in [0, 2**32)

so a value depends only on (seed, step, stream, global token index, column) and never on which
other tokens share the call, on their order, on the rank that draws it, or on the device.
Token indices are reduced modulo 2**32 (they are not checked, as that would sync the host); keep
them in [0, 2**32) for distinct draws. Philox returns four 32-bit words x0..x3 per block:
`uniform` and `gumbel` read x0, `normal` reads x0 and x1, so draws of different kinds from the
same key are dependent: give each purpose its own stream.

Generator. Philox-4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers: as easy as 1, 2,
3", SC11, 2011), as in Random123, cuRAND's Philox4_32_10 and PyTorch's CUDA generator: multipliers
0xD2511F53 and 0xCD9E8D57, key increments 0x9E3779B9 and 0xBB67AE85, ten rounds. It passes
BigCrush, and distinct (key, counter) pairs give statistically independent blocks. Tests check it
against Random123's published known-answer vectors (examples/kat_vectors).

Determinism argument.
- The 32-bit arithmetic is emulated on int64 tensors without any overflow: a 32x32-bit product is
  formed from two 32x16-bit partial products (each < 2**48), so no result relies on int64
  wrap-around, and every `>>` acts on a non-negative value (torch's `>>` is arithmetic). Integer
  ops are exact, so the words are bitwise equal on every device and under any kernel fusion.
- `uniform` maps a word to an odd multiple of 2**-24 through an int -> float32 conversion of a
  number below 2**24 and a power-of-two scale: both exact, so CPU and CUDA agree bitwise.
- `normal` and `gumbel` need log, sqrt and cos. The libm of CPU and CUDA may differ in the last
  ulp, so they are not used: log and cos are evaluated here in float64 from IEEE-exact pieces
  (frexp, integer range reduction) and +, -, *, / and sqrt, which IEEE 754 rounds correctly on
  every device, then rounded once to float32. Each torch op is its own kernel in eager mode, so no
  multiply-add is contracted into an FMA. Caveat: under torch.compile a fused kernel may contract
  them and change the last bit of `normal`/`gumbel` between backends (the words and `uniform` are
  unaffected).
- No torch or numpy RNG, no host sync, no data-dependent shapes, no Python loop over tokens.

Resolution. `uniform` has 23 random bits: values (2k + 1) * 2**-24 for k in [0, 2**23), so it lies in
[2**-24, 1 - 2**-24], never 0 or 1, and is symmetric (1 - u has the same law). `normal` and
`gumbel` use all 32 bits of their words, (x + 1/2) / 2**32 in float64, so |normal| <= 6.77 and
gumbel lies in [-3.14, 22.9] (the tails cut off hold probability < 1e-9).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import torch

__all__ = [
    "PHILOX_KEY_INCREMENTS",
    "PHILOX_MULTIPLIERS",
    "PHILOX_ROUNDS",
    "STREAMS",
    "global_token_index",
    "gumbel",
    "normal",
    "philox4x32",
    "philox_words",
    "stream_id",
    "token_offset",
    "uniform",
]

PHILOX_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
PHILOX_KEY_INCREMENTS = (0x9E3779B9, 0xBB67AE85)  # golden ratio and sqrt(3) - 1, as 32-bit fractions
PHILOX_ROUNDS = 10

# The purposes the package draws for; any other name (or a raw 32-bit id) is allowed too. A caller
# that needs separate noise per layer names it in the stream, e.g. "jitter/layer=3".
STREAMS = ("force_balance", "rsample", "jitter", "rts")

_M32 = 0xFFFFFFFF
_M16 = 0xFFFF

# log(m) = 2 atanh(s) = 2 s sum_n s^(2n) / (2n + 1), s = (m - 1) / (m + 1), |s| <= 0.1716 for
# m in [sqrt(1/2), sqrt(2)); 12 terms leave a truncation error below 1e-18.
_LOG_COEFFS = tuple(1.0 / (2 * n + 1) for n in range(12))
_LN2 = math.log(2.0)
_SQRT_HALF = math.sqrt(0.5)
# Taylor series on [0, pi/4]: the 10th term is below 2e-21.
_SIN_COEFFS = tuple((-1) ** n / math.factorial(2 * n + 1) for n in range(10))
_COS_COEFFS = tuple((-1) ** n / math.factorial(2 * n) for n in range(10))
_TURN_2POW33 = math.tau * 2.0**-33  # radians per 1/2**33 of a turn (exact scaling of tau)


def stream_id(stream: str | int) -> int:
    """Map a stream name to its fixed 32-bit id.

    Args:
        stream: a purpose name (see `STREAMS`; any string works), or an id in [0, 2**32) used as is.

    Returns:
        zlib.crc32 of the UTF-8 name: the same in every process and on every platform, unlike
        Python's salted `hash()`.

    Raises:
        TypeError: stream is neither str nor int.
        ValueError: an int stream outside [0, 2**32), or an empty name.
    """
    if isinstance(stream, bool) or not isinstance(stream, str | int):
        raise TypeError(f"stream must be a str or an int, got {type(stream).__name__}")
    if isinstance(stream, int):
        if not 0 <= stream <= _M32:
            raise ValueError(f"stream={stream} must lie in [0, 2**32)")
        return stream
    if not stream:
        raise ValueError("stream must be a non-empty name")
    return zlib.crc32(stream.encode("utf-8"))


def _mulhilo(x, m: int):
    """(hi, lo) 32-bit halves of the 64-bit product m * x, for x in [0, 2**32) and a 32-bit constant m.

    Split m (not x) into 16-bit halves so each partial product stays below 2**48: nothing overflows
    int64, and every shift acts on a non-negative value. Works on int64 tensors and Python ints.
    """
    a = x * (m & _M16)  # < 2**48
    b = x * (m >> 16)  # < 2**48; the product is a + b * 2**16
    lo_full = a + ((b & _M16) << 16)  # < 2**49
    hi = (b >> 16) + (lo_full >> 32)  # < 2**32 since the product is < 2**64
    return hi, lo_full & _M32


def philox4x32(
    counter: Sequence[torch.Tensor | int], key: Sequence[int], rounds: int = PHILOX_ROUNDS
) -> tuple[torch.Tensor | int, ...]:
    """The Philox-4x32-R block function (R = 10 is the standard Philox-4x32-10).

    Args:
        counter: four words c0..c3; int64 tensors (broadcastable to one shape) or Python ints, each
            taken modulo 2**32.
        key: two words k0, k1, Python ints taken modulo 2**32.
        rounds: number of rounds R >= 1; 10 for the published generator (7 is the other KAT set).

    Returns:
        Four words x0..x3, each int64 in [0, 2**32) with the broadcast shape of the counter (Python
        ints when every counter word is an int).

    Raises:
        ValueError: not four counter words, not two key words, or rounds < 1.
    """
    if len(counter) != 4 or len(key) != 2:
        raise ValueError(f"philox4x32 takes 4 counter words and 2 key words, got {len(counter)} and {len(key)}")
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be at least 1")
    c0, c1, c2, c3 = (c & _M32 for c in counter)
    k0, k1 = key[0] & _M32, key[1] & _M32
    m0, m1 = PHILOX_MULTIPLIERS
    for r in range(rounds):
        if r:  # the key is bumped between rounds, never before the first (Random123 philox.h)
            k0 = (k0 + PHILOX_KEY_INCREMENTS[0]) & _M32
            k1 = (k1 + PHILOX_KEY_INCREMENTS[1]) & _M32
        hi0, lo0 = _mulhilo(c0, m0)
        hi1, lo1 = _mulhilo(c2, m1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _check_key(seed: int, step: int | torch.Tensor, columns: int, token_index: torch.Tensor) -> None:
    ints = (("seed", seed), ("columns", columns)) + ((("step", step),) if not torch.is_tensor(step) else ())
    for name, value in ints:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if torch.is_tensor(step) and (step.dim() != 0 or step.dtype != torch.int64):
        raise TypeError(f"step must be an int or an int64 0-dim tensor, got {step.dtype} {tuple(step.shape)}")
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"seed={seed} must lie in [0, 2**64)")
    if not torch.is_tensor(step) and not 0 <= step < 1 << 32:  # (a tensor is taken mod 2**32, unread)
        raise ValueError(f"step={step} must lie in [0, 2**32)")
    if not 0 <= columns <= 1 << 32:  # column indices are counter words, < 2**32
        raise ValueError(f"columns={columns} must lie in [0, 2**32]")
    if not isinstance(token_index, torch.Tensor):
        raise TypeError(f"token_index must be a torch.Tensor, got {type(token_index).__name__}")
    if token_index.dtype.is_floating_point or token_index.dtype.is_complex or token_index.dtype == torch.bool:
        raise TypeError(f"token_index must be an integer tensor (int64 [T]), got {token_index.dtype}")
    if token_index.dim() != 1:
        raise ValueError(f"token_index must be 1-D [T], got shape {tuple(token_index.shape)}")


def philox_words(
    seed: int,
    step: int | torch.Tensor,
    stream: str | int,
    token_index: torch.Tensor,
    columns: int,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four raw Philox words of every (token, column) key; see the module docstring's key layout.

    Args:
        seed: int in [0, 2**64).
        step: int in [0, 2**32), e.g. the training iteration; or an int64 0-dim tensor on `device`,
            taken modulo 2**32 and never read on the host (a counter a CUDA graph advances on replay).
        stream: the purpose, a name or a 32-bit id (`stream_id`).
        token_index: integer [T], global token indices (taken modulo 2**32).
        columns: number of columns C (experts), in [0, 2**32]; column e gets counter word e.
        device: where to draw; defaults to token_index's device.

    Returns:
        x0..x3: int64 [T, C] each, in [0, 2**32).

    Raises:
        TypeError, ValueError: a key argument of the wrong type or out of range.
    """
    _check_key(seed, step, columns, token_index)
    sid = stream_id(stream)
    device = token_index.device if device is None else torch.device(device)
    tok = token_index.to(device=device, dtype=torch.int64)
    col = torch.arange(columns, dtype=torch.int64, device=device)
    # Stream (and an int step) stay Python ints: round one handles them exactly on the host, and
    # broadcasting makes the early rounds work on [T, 1] and [1, C] rather than [T, C].
    if torch.is_tensor(step):
        step = step.to(device)
    words = philox4x32((col.unsqueeze(0), tok.unsqueeze(1), step, sid), (seed & _M32, seed >> 32))
    shape = (tok.shape[0], columns)
    return tuple(torch.as_tensor(w, dtype=torch.int64, device=device).expand(shape).contiguous() for w in words)


def _unit_f32(word: torch.Tensor) -> torch.Tensor:
    """(2 (word >> 9) + 1) * 2**-24 in float32: exact (an integer below 2**24, a power-of-two scale)."""
    return ((word >> 9) * 2 + 1).to(torch.float32) * 2.0**-24


def _unit_f64(word: torch.Tensor) -> torch.Tensor:
    """(word + 1/2) / 2**32 in float64: exact (33 significant bits), in (0, 1), never 0 or 1."""
    return (word * 2 + 1).to(torch.float64) * 2.0**-33


def _horner(z: torch.Tensor, coeffs: Sequence[float]) -> torch.Tensor:
    # One torch op per multiply and per add, so no FMA contraction: bitwise equal on CPU and CUDA.
    p = torch.full_like(z, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        p = p * z + c
    return p


def _log_f64(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive finite float64 x from exact frexp and correctly rounded + - * /."""
    m, e = torch.frexp(x)  # x = m * 2**e, m in [1/2, 1): exact
    small = m < _SQRT_HALF
    m = torch.where(small, m * 2.0, m)  # m in [sqrt(1/2), sqrt(2)), exact
    e = e.to(torch.float64) - small.to(torch.float64)
    s = (m - 1.0) / (m + 1.0)  # m - 1 is exact (Sterbenz)
    return e * _LN2 + (s * 2.0) * _horner(s * s, _LOG_COEFFS)


def _cos_turn_f64(word: torch.Tensor) -> torch.Tensor:
    """cos(2 pi (word + 1/2) / 2**32) in float64, with the range reduction done exactly on integers."""
    q = word * 2 + 1  # odd, the angle in units of 2**-33 turn
    quadrant = q >> 31  # 0..3
    r = q & ((1 << 31) - 1)  # angle within the quadrant, odd, in (0, 2**31)
    fold = r > (1 << 30)  # past pi/4: use the complement angle (never equal: r is odd)
    r = torch.where(fold, (1 << 31) - r, r)
    phi = r.to(torch.float64) * _TURN_2POW33  # in (0, pi/4]
    z = phi * phi
    sin_phi = phi * _horner(z, _SIN_COEFFS)
    cos_phi = _horner(z, _COS_COEFFS)
    # cos(quadrant * pi/2 + angle): quadrants 0..3 give cos, -sin, -cos, sin of the angle; the
    # angle's sin/cos swap when folded.
    use_sin = (quadrant & 1).bool() ^ fold
    value = torch.where(use_sin, sin_phi, cos_phi)
    negate = (quadrant == 1) | (quadrant == 2)
    return torch.where(negate, -value, value)


def uniform(
    seed: int,
    step: int | torch.Tensor,
    stream: str | int,
    token_index: torch.Tensor,
    columns: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Uniform draws in the open interval (0, 1), one per (token, column) key.

    Args:
        seed: int in [0, 2**64); Philox key.
        step: int in [0, 2**32) or an int64 0-dim tensor (see `philox_words`); counter word 2.
        stream: purpose name or 32-bit id (`stream_id`); counter word 3.
        token_index: integer [T], global token indices; counter word 1 (modulo 2**32).
        columns: C, the number of columns (experts); column e is counter word 0.
        device: where to draw; defaults to token_index's device.

    Returns:
        float32 [T, C]: (2 (x0 >> 9) + 1) * 2**-24, i.e. 23 random bits, in [2**-24, 1 - 2**-24].
        Exact on every device.

    Raises:
        TypeError, ValueError: a key argument of the wrong type or out of range.
    """
    return _unit_f32(philox_words(seed, step, stream, token_index, columns, device)[0])


def normal(
    seed: int,
    step: int | torch.Tensor,
    stream: str | int,
    token_index: torch.Tensor,
    columns: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Standard normal draws, one per (token, column) key, by the Box-Muller transform.

    z = sqrt(-2 log u1) cos(2 pi u2) with u1 = (x0 + 1/2) / 2**32 and u2 = (x1 + 1/2) / 2**32, two
    independent words of the same Philox block, evaluated in float64 from correctly rounded
    operations (see the module docstring) and rounded once to float32. |z| <= 6.77.

    Args:
        seed, step, stream, token_index, columns, device: the key, as in `uniform`.

    Returns:
        float32 [T, C].

    Raises:
        TypeError, ValueError: a key argument of the wrong type or out of range.
    """
    x0, x1, _, _ = philox_words(seed, step, stream, token_index, columns, device)
    radius = torch.sqrt(_log_f64(_unit_f64(x0)) * -2.0)
    return (radius * _cos_turn_f64(x1)).to(torch.float32)


def gumbel(
    seed: int,
    step: int | torch.Tensor,
    stream: str | int,
    token_index: torch.Tensor,
    columns: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Standard Gumbel draws, g = -log(-log(u)), one per (token, column) key.

    u = (x0 + 1/2) / 2**32 in float64 (the same word as `uniform`, at full 32-bit resolution), logs
    evaluated in float64 from correctly rounded operations, rounded once to float32. g lies in
    [-3.14, 22.9]; argmax(logits + g) samples from softmax(logits) (the Gumbel-max trick).

    Args:
        seed, step, stream, token_index, columns, device: the key, as in `uniform`.

    Returns:
        float32 [T, C].

    Raises:
        TypeError, ValueError: a key argument of the wrong type or out of range.
    """
    x0 = philox_words(seed, step, stream, token_index, columns, device)[0]
    return -_log_f64(-_log_f64(_unit_f64(x0))).to(torch.float32)


def global_token_index(
    local_tokens: int, rank_offset: int | torch.Tensor, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global indices of this rank's tokens: rank_offset + arange(local_tokens).

    With tokens numbered by (source rank, local index), rank_offset is the number of tokens on the
    ranks before this one; the resulting key is then the same for every EP size.

    Args:
        local_tokens: T_local >= 0.
        rank_offset: int >= 0, or an integer 0-d (or one-element) tensor, e.g. an exclusive prefix
            sum of token counts; a tensor is added on the device, without a host sync.
        device: where to build the indices; defaults to rank_offset's device, else the CPU.

    Returns:
        int64 [local_tokens].

    Raises:
        TypeError: a non-int local_tokens or rank_offset, or a non-integer tensor.
        ValueError: negative local_tokens or rank_offset, or a tensor offset with more than one element.
    """
    if isinstance(local_tokens, bool) or not isinstance(local_tokens, int):
        raise TypeError(f"local_tokens must be an int, got {type(local_tokens).__name__}")
    if local_tokens < 0:
        raise ValueError(f"local_tokens={local_tokens} must be >= 0")
    if isinstance(rank_offset, torch.Tensor):
        if rank_offset.dtype.is_floating_point or rank_offset.dtype.is_complex or rank_offset.dtype == torch.bool:
            raise TypeError(f"rank_offset must be an integer tensor, got {rank_offset.dtype}")
        if rank_offset.numel() != 1:
            raise ValueError(f"rank_offset must hold one element, got shape {tuple(rank_offset.shape)}")
        device = rank_offset.device if device is None else torch.device(device)
        local = torch.arange(local_tokens, dtype=torch.int64, device=device)
        return local + rank_offset.reshape(()).to(device=device, dtype=torch.int64)
    if isinstance(rank_offset, bool) or not isinstance(rank_offset, int):
        raise TypeError(f"rank_offset must be an int or a tensor, got {type(rank_offset).__name__}")
    if rank_offset < 0:
        raise ValueError(f"rank_offset={rank_offset} must be >= 0")
    return torch.arange(rank_offset, rank_offset + local_tokens, dtype=torch.int64, device=device)


def token_offset(num_tokens: int, group, device: torch.device | str | None = None) -> int | torch.Tensor:
    """This rank's first global token index: the token counts of the lower ranks of `group` (one
    all-gather of int64 counts; the result stays on the device). 0 without a group or on one rank."""
    if group is None or torch.distributed.get_world_size(group) == 1:
        return 0
    world = torch.distributed.get_world_size(group)
    rank = torch.distributed.get_rank(group)
    counts = torch.zeros(world, dtype=torch.int64, device=device)
    mine = torch.tensor([num_tokens], dtype=torch.int64, device=device)
    torch.distributed.all_gather_into_tensor(counts, mine, group=group)
    return counts[:rank].sum()
