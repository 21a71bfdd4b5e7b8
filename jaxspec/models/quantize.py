"""Quantized matrices: the formats of a draft's weight copies (`models.draft_weights`).

- int8: per-output-column symmetric int8 (w ~ values x scale, |error| <= scale / 2);
- int4: group-wise (GROUP rows of K per scale) symmetric int4 in -7..7, packed two per byte in the
  layout of pallas_kernels/row_matmul.py (|error| <= scale / 2).
`decoder.matmul` multiplies a `Quantized` matrix with the row_matmul kernel.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.errors import JaxspecError
from pallas_kernels.row_matmul import pack_int4, unpack_int4

GROUP = 128  # int4: rows of K per scale (64 or 32 where 128 does not divide K)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    """A matrix [..., K, N] as int8 values and float32 scales: per output column (int8: values
    [..., K, N], scale [..., N]) or per group of rows (int4: packed values [..., K/2, N], scale
    [..., K/G, N]).

    Inside the decoder's layer scan a stacked matrix is not sliced: `layer` names the layer the
    product reads in place, with the kernel `backend` (pallas_kernels.row_matmul)."""

    values: jax.Array
    scale: jax.Array
    layer: jax.Array | None = None
    backend: str = dataclasses.field(default="reference", metadata=dict(static=True))

    @property
    def bits(self) -> int:
        return 4 if self.scale.ndim == self.values.ndim else 8


def quantize_int8(w: jax.Array) -> Quantized:
    """Symmetric per-column int8 of w [..., K, N] (columns of zeros get scale 1)."""
    amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=-2)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    values = jnp.clip(jnp.round(w.astype(jnp.float32) / scale[..., None, :]), -127, 127).astype(jnp.int8)
    return Quantized(values, scale)


def int4_group(K: int, shards: int = 1) -> int:
    """Rows per int4 scale of a matrix of K rows split into `shards` row blocks (tensor parallelism:
    a group must not straddle two devices)."""
    for group in (GROUP, 64, 32):
        if K % (shards * group) == 0:
            return group
    raise JaxspecError(f"--draft-weights int4 needs matrices whose rows are a multiple of 32 per device, got {K}"
                       + (f" over {shards} devices" if shards > 1 else ""))


def quantize_int4(w: jax.Array, shards: int = 1) -> Quantized:
    """Symmetric group-wise int4 of w [..., K, N]: one scale per int4_group(K, shards) rows and
    column, values in -7..7 (groups of zeros get scale 1)."""
    *lead, K, N = w.shape
    groups = K // int4_group(K, shards)
    wg = w.astype(jnp.float32).reshape(*lead, groups, K // groups, N)
    amax = jnp.max(jnp.abs(wg), axis=-2)
    scale = jnp.where(amax > 0, amax / 7.0, 1.0)
    values = jnp.clip(jnp.round(wg / scale[..., None, :]), -7, 7).astype(jnp.int8).reshape(-1, K, N)
    packed = jax.vmap(lambda v: pack_int4(v, groups))(values)
    return Quantized(packed.reshape(*lead, K // 2, N), scale)


def dequantize(q: Quantized, dtype=jnp.float32) -> jax.Array:
    if q.bits == 8:
        return (q.values.astype(jnp.float32) * q.scale[..., None, :]).astype(dtype)
    *lead, half, N = q.values.shape
    groups = q.scale.shape[-2]
    values = jax.vmap(lambda v: unpack_int4(v, groups))(q.values.reshape(-1, half, N))
    w = values.reshape(*lead, groups, 2 * half // groups, N).astype(jnp.float32) * q.scale[..., None, :]
    return w.reshape(*lead, 2 * half, N).astype(dtype)


QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}
