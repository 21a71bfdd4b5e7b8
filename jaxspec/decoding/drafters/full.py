"""Full: draft attention over the whole cache. It pays only with a cheaper draft model (quantized or
layer-skipped weights: `--draft-weights`, `--draft-skip`), at contexts short enough that the KV read
is small next to the weights, where a sparse selection saves little and costs acceptance.

The attention is dense over every committed slot and the row's tree ancestors, for NSA models too
(as the sparse drafters' is): a draft need not be the model, only cheap and close to it.
"""

from __future__ import annotations

import pallas_kernels as kernels
from jaxspec.decoding.drafters.base import Drafter
from jaxspec.models import decoder


class Full(Drafter):
    def attend(self, state, budget, rows):
        def attend(layer, q, cache, _, gates, carry):
            out, _, _ = kernels.verify_attention(q, cache.k, cache.v, cache.pages, layer, rows.slots,
                                                 page_size=cache.page_size, scale=self.scale, tree=rows.mask,
                                                 backend=self.spec.backend, **decoder.sink_window(gates))
            return out, None, carry

        return attend, None
