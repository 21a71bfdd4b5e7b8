"""Quantized copies of the layer weights that only draft steps read (`--draft-weights int8`).

A self-draft step reads every weight (issue: sparse-KV drafting removes KV reads, not weight reads),
so at batch 1 and short contexts it costs a full step. Draft steps can read int8 copies instead:
per-output-column symmetric int8 (w ~ values x scale, |error| <= scale / 2). The verify pass keeps
the exact weights, and draft proposals are whatever the quantized model proposes, so exact
rejection sampling keeps the output distribution the model's own; quantization only changes
acceptance. The draft's KV writes are temporary (verification rewrites every tree row's KV with the
exact weights), so the cache stays exact.

The copies live in the params pytree under "draft_layers" (`with_draft_weights`); the engine's draft
step takes `draft_params(params)`, the params with those matrices in place of the layers' own.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.errors import JaxspecError

DRAFT_MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")  # the layer matrices a draft step reads
DRAFT_WEIGHTS = ("exact", "int8")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Int8:
    """A matrix [..., K, N] as int8 values and one float32 scale per output column [..., N]."""

    values: jax.Array
    scale: jax.Array


def quantize_int8(w: jax.Array) -> Int8:
    """Symmetric per-column int8 of w [..., K, N] (columns of zeros get scale 1)."""
    amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=-2)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    values = jnp.clip(jnp.round(w.astype(jnp.float32) / scale[..., None, :]), -127, 127).astype(jnp.int8)
    return Int8(values, scale)


def dequantize(q: Int8, dtype=jnp.float32) -> jax.Array:
    return (q.values.astype(jnp.float32) * q.scale[..., None, :]).astype(dtype)


def with_draft_weights(params: dict, kind: str) -> dict:
    """`params` with the draft's copies of the layer matrices ("exact": none, unchanged)."""
    if kind not in DRAFT_WEIGHTS:
        raise JaxspecError(f"--draft-weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {kind!r}")
    if kind == "exact":
        return params
    return {**params, "draft_layers": {name: quantize_int8(params["layers"][name]) for name in DRAFT_MATRICES}}


def draft_params(params: dict, kind: str) -> dict:
    """The params a draft step reads under `--draft-weights kind`."""
    if kind == "exact":
        return params
    if "draft_layers" not in params:
        raise JaxspecError(f"--draft-weights {kind}: the params carry no draft copies (make them with with_draft_weights)")
    return {**params, "layers": {**params["layers"], **params["draft_layers"]}}


def draft_bytes(params: dict) -> int:
    """Device bytes of the draft copies (the memory --draft-weights adds)."""
    return sum(x.nbytes for x in jax.tree.leaves(params.get("draft_layers", {})))
