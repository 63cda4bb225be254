"""Generated prose-like text for the data and eval tests (no network, no corpus)."""

from __future__ import annotations

import numpy as np

WORDS = (
    "the a of and to in was her it she that had as with for not but be his he at you all my "
    "letter garden morning sister house ball visit evening marriage fortune Elizabeth Darcy "
    "Bennet walked smiled replied certainly indeed perhaps very little great young"
).split()


def make_text(rng: np.random.Generator, n_sentences: int) -> str:
    """Prose-like text: sentences of random words, paragraphs separated by blank lines."""
    lines = []
    for i in range(n_sentences):
        words = rng.choice(WORDS, size=int(rng.integers(4, 14)))
        lines.append(" ".join(words).capitalize() + ".")
        if i % 5 == 4:
            lines.append("")
    return "\n".join(lines) + "\n"


def make_docs(n_docs: int, seed: int = 0, min_sent: int = 3, max_sent: int = 30) -> list[str]:
    rng = np.random.default_rng(seed)
    return [make_text(rng, int(rng.integers(min_sent, max_sent))) for _ in range(n_docs)]
