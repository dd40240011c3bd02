"""What an adapter does with each option of its framework's MoE layer: the verdict record that the
adapters' option tables (megatron/verdicts.py, deepspeed/verdicts.py) are made of.

  honoured  MoK computes what the stock layer computes with it; `tests` names the tests against the
            stock layer.
  replaced  a choice of how the stock layer computes, with no effect on its values: MoK's own
            kernels run instead.
  refused   set to anything but its default, building the layer is an error naming the option
            (`example` is such a value, for the tables' checks).
  depends   honoured or replaced in some combinations, refused by name in the others; `tests`
            names the tests of each side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Kind", "Verdict", "depends", "honoured", "refused", "replaced"]

Kind = Literal["honoured", "replaced", "refused", "depends"]


@dataclass(frozen=True)
class Verdict:
    kind: Kind
    why: str
    # A non-default value of the option (refused and replaced options: the checks set it).
    example: Any = None
    # "tests/<file>.py::<test>" of the tests against the stock layer (honoured and depends).
    tests: tuple[str, ...] = ()


def honoured(why: str, *tests: str) -> Verdict:
    return Verdict("honoured", why, tests=tests)


def replaced(why: str, example: Any = True) -> Verdict:
    return Verdict("replaced", why, example=example)


def refused(why: str, example: Any = True) -> Verdict:
    return Verdict("refused", why, example=example)


def depends(why: str, *tests: str) -> Verdict:
    return Verdict("depends", why, tests=tests)
