"""The kernel backend switch: each kernel as a jnp reference ("reference") or a Pallas-Triton
kernel ("pallas"). On a CPU default backend the Pallas kernels run in interpret mode, so tests
exercise the kernel code without a GPU.
"""
from pallas_kernels._common import interpret_default
from pallas_kernels.sparse_attention import (
    sparse_attention_pallas,
    sparse_attention_reference,
)
from pallas_kernels.topk import select_topk_pallas, select_topk_reference
from pallas_kernels.verify_attention import (
    Collect,
    verify_attention_pallas,
    verify_attention_reference,
)

BACKENDS = ("reference", "pallas")

__all__ = ["BACKENDS", "Collect", "select_topk", "sparse_attention", "verify_attention"]


def _is_pallas(backend: str) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}: expected one of {BACKENDS}")
    return backend == "pallas"


def verify_attention(q, k_cache, v_cache, layer, q_pos, *, scale: float,
                     collect: Collect | None = None, backend: str = "reference"):
    """q [B, T, Hq, Dh] against layer `layer` of the cache [L, B, Hkv, S, Dh]; row (b, t) sees slots
    <= q_pos[b, t]. Returns out [B, T, Hq, Dh] (q.dtype), lse [B, T, Hq] fp32, and the selection
    scores asked for by `collect` (None without it). The Pallas kernel covers T <= 16; larger T
    run the reference."""
    if _is_pallas(backend):
        return verify_attention_pallas(q, k_cache, v_cache, layer, q_pos, scale=scale,
                                       collect=collect, interpret=interpret_default())
    return verify_attention_reference(q, k_cache, v_cache, layer, q_pos, scale=scale,
                                      collect=collect)


def sparse_attention(q, k_cache, v_cache, layer, idx, n_idx, tail_start, q_pos, *, scale: float,
                     tail_capacity: int, backend: str = "reference"):
    """q [B, Hq, Dh] over slots idx[b, s, :n_idx[b]] (idx [B, 1 or Hkv, K]) plus the tail
    tail_start[b] .. q_pos[b] of layer `layer` of the cache. Returns out [B, Hq, Dh] (q.dtype)."""
    if _is_pallas(backend):
        return sparse_attention_pallas(q, k_cache, v_cache, layer, idx, n_idx, tail_start, q_pos,
                                       scale=scale, tail_capacity=tail_capacity,
                                       interpret=interpret_default())
    return sparse_attention_reference(q, k_cache, v_cache, layer, idx, n_idx, tail_start, q_pos,
                                      scale=scale, tail_capacity=tail_capacity)


def select_topk(scores, k_max: int, k, *, backend: str = "reference"):
    """idx [..., k_max] int32: the first k (per row, 1 <= k <= k_max) entries are the slots of the
    k largest scores [..., S] (-inf: invalid; fewer if fewer are finite); the rest are any slots."""
    if _is_pallas(backend):
        return select_topk_pallas(scores, k_max, k, interpret=interpret_default())
    return select_topk_reference(scores, k_max, k)
