"""Helpers shared by the attention kernels: online softmax, split-K merge, tiling choices.

Both attention kernels run flash-decoding style: a grid of (batch, kv head, split) programs, each
streams blocks of keys through an online softmax and writes a normalised partial output plus its
log-sum-exp; `merge_splits` combines the splits in XLA.
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Enough (batch x kv head x split) programs to fill an H100 (132 SMs) about twice over, with at
# most 16 splits: at B=1 x 32K, 16 splits beat 32 (57 vs 63 us, T=10), at B=4 8 beat 16.
TARGET_PROGRAMS = 256
MAX_SPLITS = 16
# Triton dots need every operand dimension >= 16; all loaded tensors need power-of-two shapes.
MIN_TILE = 16


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def num_splits(programs: int, max_blocks: int) -> int:
    """Split-K factor: `programs * splits` about TARGET_PROGRAMS, one block per split at least."""
    return max(1, min(-(-TARGET_PROGRAMS // programs), MAX_SPLITS, max_blocks))


def split_range(split, n_splits: int, n_blocks):
    """Blocks [lo, hi) of split `split` when the (traced) n_blocks are shared evenly by n_splits."""
    per = (n_blocks + n_splits - 1) // n_splits
    lo = split * per
    return lo, jnp.minimum(lo + per, n_blocks)


def pad_rows(x):
    """Pads axis 2 of [B, Hkv, N, Dh] with zero rows up to a Triton tile: a power of two >= 16."""
    n = x.shape[2]
    return jnp.pad(x, ((0, 0), (0, 0), (0, next_pow2(max(n, MIN_TILE)) - n), (0, 0)))


def compiler_params():
    """Measured on an H100 (bench/NOTES.md): four warps beat eight even for 64-row tiles (193 vs
    241 us, 4 x 32K, T=10), and three pipeline stages of 64-key blocks keep enough loads in flight
    while the largest collecting tile still fits in shared memory."""
    return plgpu.CompilerParams(num_warps=4, num_stages=3)


def matmul_precision(dtype):
    """Full fp32 products for float32 inputs (XLA on GPU would use TF32 otherwise)."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def init_carry(rows: int, head_dim: int):
    """Online-softmax state: unnormalised output, running max (-inf: nothing seen), running sum."""
    return (jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def softmax_step(carry, logits, mask, v):
    """Adds one key block: logits [rows, block] fp32, mask [rows, block] bool, v [block, Dh].

    Fully masked rows keep m = -inf; m_safe keeps exp() away from -inf - -inf = NaN.
    """
    o, m, l = carry
    logits = jnp.where(mask, logits, -jnp.inf)
    m_new = jnp.maximum(m, logits.max(axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(logits - m_safe[:, None])
    l = alpha * l + p.sum(axis=1)
    o = alpha[:, None] * o + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o, m_new, l


def store_split(o_ref, lse_ref, carry, rows: int):
    """Writes the split's normalised output and lse (0 and -inf for a split that saw no key).

    The refs hold `rows` real rows; the tile's padding rows are masked off the store.
    """
    o, m, l = carry
    seen = l > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    o = o / jnp.where(seen, l, 1.0)[:, None]
    tile = o.shape[0]
    real = jnp.arange(tile) < rows
    plgpu.store(o_ref.at[pl.ds(0, tile)], o, mask=real[:, None])
    plgpu.store(lse_ref.at[pl.ds(0, tile)], lse, mask=real)


def merge_splits(o_part, lse_part):
    """Log-sum-exp merge over axis -3 of o_part [..., n, rows, Dh] and axis -2 of lse_part [..., n, rows].

    Returns out [..., rows, Dh] fp32 and lse [..., rows] fp32. A row no split saw gets 0 and -inf.
    """
    m = lse_part.max(axis=-2)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse_part - m_safe[..., None, :])
    l = w.sum(axis=-2)
    out = (w[..., None] * o_part).sum(axis=-3) / jnp.where(l > 0, l, 1.0)[..., None]
    return out, m_safe + jnp.log(l)


def interpret_default() -> bool:
    """Pallas-Triton kernels run in interpret mode when JAX's default backend is the CPU."""
    return jax.default_backend() == "cpu"
