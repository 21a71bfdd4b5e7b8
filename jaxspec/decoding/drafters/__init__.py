"""The drafters, one file each, behind the interface of `base.Drafter`: KV-selection policies that draft
with the model itself, n-gram lookup, and the EAGLE-3 head."""

from __future__ import annotations

from jaxspec.models.config import ModelConfig
from jaxspec.decoding.drafters.base import Drafter, DraftRows
from jaxspec.decoding.drafters.eagle import Eagle
from jaxspec.decoding.drafters.full import Full
from jaxspec.decoding.drafters.ngram import Ngram
from jaxspec.decoding.drafters.quest import Quest
from jaxspec.decoding.drafters.stream import Stream
from jaxspec.decoding.drafters.vegas import AllRows, LastAccepted, Vegas
from jaxspec.decoding.spec import SpecConfig

DRAFTERS: dict[str, type[Drafter]] = {
    "vegas": Vegas,
    "all_rows": AllRows,
    "last_accepted": LastAccepted,
    "stream": Stream,
    "quest": Quest,
    "full": Full,
    "ngram": Ngram,
    "eagle": Eagle,
}


def make_drafter(spec: SpecConfig, cfg: ModelConfig, max_len: int) -> Drafter | None:
    """The drafter of `spec.method` for contexts up to `max_len` (None for plain decoding); its
    selection capacity is `spec.capacity(max_len)`."""
    if spec.method == "plain":
        return None
    if spec.method == "eagle" and spec.eagle is None:
        raise ValueError("method eagle needs a draft head: SpecConfig.eagle (its weights in params['eagle'])")
    return DRAFTERS[spec.method](spec, cfg, spec.capacity(max_len))
