"""Training and held-out text: a fixed split of the documents of `jaxspec.corpus` (the Python
documentation), cut into token windows. The split goes by topic name, so it stays the same wherever
the texts or their sizes differ; fits train on one part and report on the other, never trained on.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Iterator

import numpy as np

from jaxspec import corpus
from jaxspec.errors import JaxspecError

HELDOUT_MOD, HELDOUT_RESIDUE = 5, 2  # pydoc topics with crc32(name) % 5 == 2 are held out


def heldout_topic(name: str) -> bool:
    """Whether the pydoc topic `name` is held out: crc32(name) % 5 == 2, 15 of Python 3.12's 79 topics,
    about a fifth of the text (by name, so the split stays the same where the texts or sizes differ)."""
    return zlib.crc32(name.encode()) % HELDOUT_MOD == HELDOUT_RESIDUE


def split_documents() -> tuple[list[str], list[str]]:
    """(training, held-out) documents of `jaxspec.corpus`, in its order (`heldout_topic`); a fit
    never sees the held-out ones."""
    from pydoc_data.topics import topics

    names = sorted(topics, key=lambda name: (-len(topics[name]), name))  # the order of corpus.documents()
    docs = corpus.documents()
    train = [doc for name, doc in zip(names, docs) if not heldout_topic(name)]
    held = [doc for name, doc in zip(names, docs) if heldout_topic(name)]
    return train, held


def heldout_fingerprint() -> str:
    """A short hash of the held-out documents (they come from the running Python's pydoc topics)."""
    return hashlib.sha256("\x00".join(split_documents()[1]).encode()).hexdigest()[:16]


def token_stream(tokenizer, docs: list[str]) -> np.ndarray:
    """The documents, separated by blank lines, as one int32 token array."""
    return np.asarray(tokenizer.encode("\n\n".join(docs)), np.int32)


def training_batches(tokenizer, tokens: int, batch: int, seed: int = 0) -> Iterator[np.ndarray]:
    """Endless [batch, tokens] windows at random offsets of the training documents' token stream."""
    stream = token_stream(tokenizer, split_documents()[0])
    if len(stream) < tokens + 1:
        raise JaxspecError(f"the training text has {len(stream)} tokens, fewer than a window of {tokens}")
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(stream) - tokens + 1, batch)
        yield np.stack([stream[s : s + tokens] for s in starts])


def heldout_windows(tokenizer, tokens: int, count: int | None = None) -> np.ndarray:
    """[N, tokens] consecutive non-overlapping windows of the held-out documents' token stream."""
    stream = token_stream(tokenizer, split_documents()[1])
    n = len(stream) // tokens
    if count is not None:
        n = min(n, count)
    if n == 0:
        raise JaxspecError(f"the held-out text has {len(stream)} tokens, fewer than a window of {tokens}")
    return stream[: n * tokens].reshape(n, tokens)
