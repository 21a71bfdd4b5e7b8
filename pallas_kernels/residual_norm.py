"""A layer product's residual add and the next RMSNorm in one kernel: x + (the product, summed over
its K splits and scaled as rope_write's rule says), then the norm of that sum, both returned.

Why a kernel: XLA computed the residual stream and the two norms of a layer in five kernels (each
norm's statistics, its scaling, and the stream's update), each a launch's fixed cost for a few
thousand elements (bench/NOTES.md, "the residual stream and its norms"); this is two a layer, one after the attention's
output product and one after the MLP's (whose norm is the next layer's, or the final one).
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import next_pow2
from pallas_kernels.row_matmul import product_rows
from pallas_kernels.rope_write import rms_norm, split_sum


def residual_norm_reference(x, sums, weight, entry, *, eps: float, scale=None):
    """x [M, D] plus the product `sums` [S, R >= M, D] (times `scale` [E, D] at `entry` if given),
    in x's dtype; returns that and its RMSNorm with weight[entry] ([E, D])."""
    x = x + product_rows(sums, scale, entry, x.shape[0], x.dtype)
    return x, rms_norm(x, weight[entry], eps)


def _kernel(entry_ref, x_ref, sums_ref, w_ref, *refs, eps, has_scale):
    """Program m: row m, whole (one row a program: its sums do not depend on how many rows run)."""
    scale_ref, x_out, h_out = refs if has_scale else (None, *refs)
    m, entry = pl.program_id(0), entry_ref[0]
    D = x_ref.shape[1]
    cols = pl.ds(0, next_pow2(D))
    real = jnp.arange(next_pow2(D)) < D
    acc = split_sum(sums_ref, scale_ref, entry, m, cols, mask=real)
    x = plgpu.load(x_ref.at[m, cols], mask=real, other=0.0) + acc.astype(x_ref.dtype)
    xf = x.astype(jnp.float32)
    normed = (xf * jax.lax.rsqrt(jnp.sum(xf * xf) / D + eps)).astype(x.dtype)
    h = plgpu.load(w_ref.at[entry, cols], mask=real, other=0.0) * normed
    plgpu.store(x_out.at[m, cols], x, mask=real)
    plgpu.store(h_out.at[m, cols], h.astype(h_out.dtype), mask=real)


def residual_norm_pallas(x, sums, weight, entry, *, eps: float, scale=None, interpret: bool = False):
    """Pallas-Triton kernel: grid (M,), one row a program."""
    M, D = x.shape
    args = [jnp.asarray(entry, jnp.int32).reshape(1), x, sums, weight] + ([scale] if scale is not None else [])
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps, has_scale=scale is not None), grid=(M,),
        in_specs=[pl.no_block_spec] * len(args), out_specs=[pl.no_block_spec] * 2,
        out_shape=[jax.ShapeDtypeStruct((M, D), x.dtype),
                   jax.ShapeDtypeStruct((M, D), jnp.result_type(weight.dtype, x.dtype))],
        compiler_params=plgpu.CompilerParams(num_warps=min(16, max(4, next_pow2(D) // 256)), num_stages=1),
        interpret=interpret, name="residual_norm",
    )(*args)
