"""Tile configs as the tuning commands write them, and the in-process override of the pinned table.

The kernel package keeps the pinned table and its lookup (`mok_plugin.kernels.configs`); trying
other configs is a benchmark's business and lives here. The notation: '128x256x64w8s3' is
BLOCK_M x BLOCK_N x BLOCK_K, warps, stages; then 'g' for pre-gathered weight-gradient rows, 't'
for TMA and 'p' for a weight-gradient program sweeping its row block's tiles, in that order.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from mok_plugin.kernels import configs
from mok_plugin.kernels.configs import PINNED_KERNELS, MoKTileConfig

__all__ = [
    "Setting",
    "changed",
    "overridden_configs",
    "parse_overrides",
    "parse_setting",
    "parse_tile_config",
    "tile_config_label",
    "tile_config_spec",
]

_SPEC = re.compile(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(g?)(t?)(p?)")


def parse_tile_config(spec: str) -> MoKTileConfig:
    """A config from its short form: '128x256x64w8s3' (BLOCK_M x BLOCK_N x BLOCK_K, warps, stages),
    then 'g' for pre-gathered weight-gradient rows, 't' for TMA, 'p' for a weight-gradient program
    sweeping its row block's tiles.

    Raises:
        ValueError: spec is not in that form.
    """
    match = _SPEC.fullmatch(spec)
    if not match:
        raise ValueError(f"config {spec!r}: expected like 128x256x64w8s3, 128x128x64w8s4g or 128x128x64w8s4gt")
    *numbers, gather, tma, sweep = match.groups()
    return MoKTileConfig(*(int(n) for n in numbers), tma=tma == "t", gather_rows=gather == "g", sweep=sweep == "p")


def parse_overrides(specs: list[str]) -> dict[str, MoKTileConfig]:
    """The pinned-table entries of repeated `--override KERNEL=CONFIG` options, by kernel.

    Raises:
        ValueError: a spec not in that form, or a kernel the table does not have (the message says
            which, as the commands print it).
    """
    overrides = {}
    for text in specs:
        kernel, _, spec = text.partition("=")
        try:
            overrides[kernel] = parse_tile_config(spec)
        except ValueError as error:
            raise ValueError(f"--override KERNEL=CONFIG: {error}") from None
    unknown = sorted(set(overrides) - set(PINNED_KERNELS))
    if unknown:
        raise ValueError(f"--override: unknown kernel {', '.join(unknown)}; kernels: {', '.join(PINNED_KERNELS)}")
    return overrides


def tile_config_spec(cfg: MoKTileConfig) -> str:
    """The short form parse_tile_config reads back: '128x128x64w8s4gt'."""
    spec = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}w{cfg.num_warps}s{cfg.num_stages}"
    return spec + ("g" if cfg.gather_rows else "") + ("t" if cfg.tma else "") + ("p" if cfg.sweep else "")


def tile_config_label(cfg: MoKTileConfig) -> str:
    """'128x128x64 w8 s4 gather tma': a config as the benchmark tables print it."""
    extra = (" gather" if cfg.gather_rows else "") + (" tma" if cfg.tma else "") + (" sweep" if cfg.sweep else "")
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}{extra}"


@contextlib.contextmanager
def overridden_configs(overrides: Mapping[str, MoKTileConfig]) -> Iterator[None]:
    """Within the block, the pinned table has these entries instead (a benchmark comparing a
    candidate table in one process); the previous entries come back on leaving it, errors included.
    Not for training: every process must use the same table.

    Raises:
        KeyError: a kernel the table does not have (checked before anything is replaced).
    """
    unknown = set(overrides) - set(PINNED_KERNELS)
    if unknown:
        raise KeyError(f"no pinned config for {sorted(unknown)}; kernels: {', '.join(PINNED_KERNELS)}")
    previous = configs.swap_pinned(dict(overrides))
    try:
        yield
    finally:
        configs.swap_pinned(previous)


@dataclass(frozen=True, slots=True)
class Setting:
    """B's value of one module attribute."""

    module: str
    attr: str
    value: object

    def __str__(self) -> str:
        return f"{self.module}.{self.attr}={self.value!r}"


def parse_setting(text: str) -> Setting:
    """'package.module.ATTR=VALUE' (VALUE a Python literal) as a Setting, checked against the module.

    Raises:
        ValueError: not in that form, the module does not import, it has no such attribute, or
            VALUE is not a literal.
    """
    target, sep, literal = text.partition("=")
    module, dot, attr = target.strip().rpartition(".")
    if not sep or not dot or not module or not attr:
        raise ValueError(f"{text!r}: expected package.module.ATTR=VALUE")
    try:
        loaded = importlib.import_module(module)
    except ImportError as error:
        raise ValueError(f"{text!r}: module {module} does not import ({error})") from None
    if not hasattr(loaded, attr):
        raise ValueError(f"{text!r}: {module} has no attribute {attr}")
    try:
        value = ast.literal_eval(literal.strip())
    except (ValueError, SyntaxError):
        raise ValueError(f"{text!r}: {literal.strip()!r} is not a Python literal (quote strings)") from None
    return Setting(module, attr, value)


@contextlib.contextmanager
def changed(settings: Sequence[Setting], overrides: dict[str, MoKTileConfig]) -> Iterator[None]:
    """Within the block, B: each setting's attribute holds its value and the pinned table has the
    overrides; A's values come back on leaving it, errors included."""
    modules = [importlib.import_module(s.module) for s in settings]
    previous = [getattr(m, s.attr) for m, s in zip(modules, settings, strict=True)]
    try:
        for m, s in zip(modules, settings, strict=True):
            setattr(m, s.attr, s.value)
        with overridden_configs(overrides):
            yield
    finally:
        for m, s, value in zip(modules, settings, previous, strict=True):
            setattr(m, s.attr, value)
