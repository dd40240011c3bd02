"""The comparison's training data: a small synthetic language, made in-process from a seed.

Uniformly random tokens teach a model nothing (its loss stays at ln(vocab) and a loss plot shows
only noise), so the harness trains on a fixed random bigram grammar instead: every token of the
vocabulary has `SUCCESSORS` possible next tokens, with fixed random probabilities. The comparison
model sees one token at a time (no attention), so the grammar is exactly what it can learn; its
loss starts near ln(vocab) and falls towards the grammar's entropy (`BigramLanguage.entropy`).

Everything comes from `torch.Generator`s seeded here (on the CPU), so every run, process and
machine draws the same tokens; the batches are drawn once, before any run, and shared by all runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ALPHABET", "SUCCESSORS", "BigramLanguage", "make_batches", "uniform_loss"]

# A small alphabet, so that each word occurs often in the few tokens of a quick run (10 steps of the
# tiny config see 1280 tokens: 20 per word), and few successors, so the grammar has little entropy
# (at most ln 4 = 1.39 nats) against the untrained model's ln(vocab) (ln 512 = 6.24).
ALPHABET = 64
SUCCESSORS = 4


@dataclass(frozen=True, slots=True)
class BigramLanguage:
    """A fixed random bigram grammar over `words`, a subset of the model's vocabulary.

    Attributes:
        words: int64 [A], the token ids the language uses (A = its alphabet size).
        successors: int64 [A, SUCCESSORS], the word indices that may follow each word.
        cumulative: float64 [A, SUCCESSORS], running sums of their probabilities (last column 1).
    """

    words: torch.Tensor  # int64 [A]
    successors: torch.Tensor  # int64 [A, F]
    cumulative: torch.Tensor  # float64 [A, F]

    @classmethod
    def make(cls, vocab: int, alphabet: int = ALPHABET, seed: int = 0) -> BigramLanguage:
        """The grammar drawn from `seed`: `alphabet` of the `vocab` token ids, distinct successors per
        word, and probabilities from a flat Dirichlet (normalised exponentials), so some transitions
        dominate."""
        alphabet = min(alphabet, vocab)
        generator = torch.Generator().manual_seed(seed)
        words = torch.randperm(vocab, generator=generator)[:alphabet]
        successors = torch.rand(alphabet, alphabet, generator=generator).argsort(dim=1)[:, :SUCCESSORS]
        weights = torch.empty(alphabet, SUCCESSORS, dtype=torch.float64).exponential_(generator=generator)
        cumulative = (weights / weights.sum(dim=1, keepdim=True)).cumsum(dim=1)
        cumulative[:, -1] = 1.0  # exact, so a uniform draw below 1 always finds a column
        return cls(words, successors, cumulative)

    @property
    def entropy(self) -> float:
        """Mean next-token entropy in nats (words weighted equally): the loss a perfect model nears."""
        probs = torch.diff(self.cumulative, dim=1, prepend=torch.zeros_like(self.cumulative[:, :1]))
        return float(-(probs * probs.log()).sum(dim=1).mean())

    def sample(self, rows: int, length: int, generator: torch.Generator) -> torch.Tensor:
        """int64 [rows, length] token ids: each row starts at a uniform word and walks the grammar."""
        index = torch.empty(rows, length, dtype=torch.int64)
        index[:, 0] = torch.randint(0, len(self.words), (rows,), generator=generator)
        draws = torch.rand(length - 1, rows, 1, dtype=torch.float64, generator=generator)
        for i in range(1, length):  # a walk is sequential; the rows advance together
            current = index[:, i - 1]
            column = torch.searchsorted(self.cumulative[current], draws[i - 1], right=True).squeeze(1)
            index[:, i] = self.successors[current, column.clamp_max(SUCCESSORS - 1)]
        return self.words[index]


def make_batches(vocab: int, steps: int, batch: int, length: int, seed: int = 1234) -> list[torch.Tensor]:
    """`steps` batches of int64 [batch, length] token rows from `BigramLanguage.make(vocab)`, on the CPU.

    Args:
        vocab: the model's vocabulary size.
        steps: how many batches (one per training step).
        batch: rows per batch (the micro-batch).
        length: tokens per row (the sequence length + 1: inputs and their next tokens).
        seed: draws the walks; the grammar itself is fixed by seed 0.

    Returns:
        The batches, each int64 [batch, length].
    """
    if min(steps, batch) < 1 or vocab < SUCCESSORS or length < 2:
        raise ValueError(f"make_batches(vocab={vocab}, steps={steps}, batch={batch}, length={length}): "
                         f"need vocab >= {SUCCESSORS}, length >= 2 and positive steps and batch")  # fmt: skip
    language = BigramLanguage.make(vocab)
    generator = torch.Generator().manual_seed(seed)
    return list(language.sample(steps * batch, length, generator).split(batch))


def uniform_loss(vocab: int) -> float:
    """ln(vocab): the loss of a model that predicts every token equally (where training starts)."""
    return math.log(vocab)
