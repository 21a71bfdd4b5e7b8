"""The top-p (nucleus) threshold of each row of logits, without sorting the vocabulary.

Definition (jaxspec's sampling uses it on every backend, for plain decoding, drafts and targets
alike): with x a row of tempered logits, m its max and e = exp(x - m), the threshold is the smallest
row value t whose mass strictly above, M(t) = sum(e[x > t]), is < top_p * sum(e). Walking the tokens
from the most likely and keeping each while the mass before it is < top_p keeps exactly x >= t (ties
at t included), so this is the usual nucleus, found without a sort.

Search: x maps to order-preserving int32 keys; M only steps at row values, so the smallest key k
with M(val(k)) < top_p * Z is a row value's key. The bracket (lo, hi], with the test false at lo and
true at hi, starts at (key(min x) - 1, key(m)]; each pass tests three pivots that quarter it, so at
most 16 passes over the row settle 32-bit keys. Masked sums of non-negative terms in one fixed order
are monotone in the mask, so the test is monotone in floating point too.

The Pallas kernel runs one program per row and loops over the row once per pass, so the row stays
in L1/L2 after the first read (96-192 KB at a 49K vocabulary); the reference runs the same search on
all rows in jnp. The two sum in different orders: they agree except where some M(t) lies within
rounding of top_p * Z.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import float_key, key_float, next_pow2

# Logits per vector step of a pass, on 32 warps. H100, 128 x 49152 float32: 2048 on 8 warps 211 us
# (a pass waits on one chunk's load at a time), 8192 on 32 warps 105 us (bench/NOTES.md).
CHUNK = 8192
NUM_WARPS = 32


def _average(a, b):
    """floor((a + b) / 2) of int32 keys without overflow."""
    return (a >> 1) + (b >> 1) + (a & b & 1)


def _pivots(lo, hi):
    """Three keys in [lo + 1, hi - 1] that quarter (lo, hi) (all hi while hi = lo + 1)."""
    mid = _average(lo, hi)
    clip = lambda k: jnp.maximum(jnp.minimum(k, hi - 1), lo + 1)
    return clip(_average(lo, mid)), clip(mid), clip(_average(mid, hi))


def _narrow(lo, hi, pivots, masses, target):
    """The bracket after testing the ascending pivots: the test M < target is monotone in the key."""
    for pivot, mass in zip(pivots, masses):
        below = mass >= target  # the threshold is above this pivot
        lo = jnp.where(below, pivot, lo)
        hi = jnp.where(below, hi, jnp.minimum(hi, pivot))
    return lo, hi


def _per_row(value, rows: int):
    """A float32 [rows] array of a scalar or per-row value."""
    return jnp.broadcast_to(jnp.asarray(value, jnp.float32), (rows,))


def top_p_threshold_reference(logits, inv_temperature, top_p):
    """logits [R, V] -> float32 [R]: each row's threshold on logits.astype(float32) * inv_temperature
    (inv_temperature and top_p: scalars, or one value per row [R])."""
    R = logits.shape[0]
    x = logits.astype(jnp.float32) * _per_row(inv_temperature, R)[:, None]
    top = jnp.max(x, axis=-1)
    e = jnp.exp(x - top[:, None])
    target = _per_row(top_p, R) * jnp.sum(e, axis=-1)

    def mass_above(key):
        return jnp.sum(jnp.where(x > key_float(key)[:, None], e, 0.0), axis=-1)

    def body(bracket):
        lo, hi = bracket
        pivots = _pivots(lo, hi)
        return _narrow(lo, hi, pivots, [mass_above(k) for k in pivots], target)

    lo, hi = float_key(jnp.min(x, axis=-1)) - 1, float_key(top)
    _, hi = lax.while_loop(lambda b: jnp.any(b[1] > b[0] + 1), body, (lo, hi))
    return key_float(hi)


def _kernel(logits_ref, inv_temperature_ref, top_p_ref, out_ref, *, chunk):
    row = pl.program_id(0)
    inv_temperature = inv_temperature_ref[row]
    V = logits_ref.shape[1]
    n_chunks = pl.cdiv(V, chunk)

    def load(c):
        """A chunk of the tempered row and its validity (lanes past V are masked out by callers)."""
        cols = c * chunk + jnp.arange(chunk)
        x = plgpu.load(logits_ref.at[row, pl.ds(c * chunk, chunk)], mask=cols < V, other=0.0)
        return x.astype(jnp.float32) * inv_temperature, cols < V

    def row_pass(step, init):
        """Folds step(acc, x, valid) over the row's chunks; acc is a tuple of [chunk] vectors."""
        zeros = tuple(jnp.full((chunk,), v, jnp.float32) for v in init)
        return lax.fori_loop(0, n_chunks, lambda c, acc: step(acc, *load(c)), zeros)

    big, small = row_pass(lambda acc, x, ok: (jnp.where(ok, jnp.maximum(acc[0], x), acc[0]),
                                              jnp.where(ok, jnp.minimum(acc[1], x), acc[1])),
                          (-jnp.inf, jnp.inf))
    top, bottom = jnp.max(big), jnp.min(small)
    weight = lambda x, ok: jnp.where(ok, jnp.exp(x - top), 0.0)
    (total,) = row_pass(lambda acc, x, ok: (acc[0] + weight(x, ok),), (0.0,))
    target = top_p_ref[row] * jnp.sum(total)

    def search(bracket):
        lo, hi = bracket
        pivots = _pivots(lo, hi)
        values = [key_float(k) for k in pivots]

        def step(acc, x, ok):
            e = weight(x, ok)
            return tuple(a + jnp.where(x > v, e, 0.0) for a, v in zip(acc, values))

        masses = [jnp.sum(a) for a in row_pass(step, (0.0, 0.0, 0.0))]
        return _narrow(lo, hi, pivots, masses, target)

    bracket = (float_key(bottom) - 1, float_key(top))
    _, hi = lax.while_loop(lambda b: b[1] > b[0] + 1, search, bracket)
    out_ref[row] = key_float(hi)


def top_p_threshold_pallas(logits, inv_temperature, top_p, *, interpret: bool = False, chunk: int = CHUNK):
    """The Pallas kernel of top_p_threshold_reference (same contract)."""
    R, V = logits.shape
    return pl.pallas_call(
        functools.partial(_kernel, chunk=min(chunk, next_pow2(V))),
        grid=(R,),
        in_specs=[pl.no_block_spec] * 3,
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((R,), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="top_p_threshold",
    )(logits, _per_row(inv_temperature, R), _per_row(top_p, R))
