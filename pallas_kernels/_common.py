"""Helpers shared by the attention kernels: online softmax, split-K merge, tiling choices.

Both attention kernels run flash-decoding style: a grid of (batch, kv head, row block, split)
programs, each streams blocks of keys through an online softmax for its tile of GQA-packed query
rows and writes a normalised partial output plus its log-sum-exp; `merged` combines the splits in
one kernel (a single split's output is final, written in the output dtype).
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
import numpy as np

# Enough (batch x kv head x split) programs to fill a GPU of ~132 SMs about twice over; grids of
# fewer than 16 (batch x kv head) programs aim at one wave instead, where each split's fixed cost
# and the merge outweigh a second wave (bench/splits.py; bench/NOTES.md, "the split count at batch 1").
TARGET_PROGRAMS = 256
FEW_PROGRAMS = 16
MAX_SPLITS = 64
# Triton dots need every operand dimension >= 16; all loaded tensors need power-of-two shapes.
MIN_TILE = 16


# Query rows of one KV head go into one tile as packed row t*G + g. A tile holds at least 16 query
# rows (so T <= 16 stays one tile) and otherwise at most 64 packed rows: at
# Dh 128 a 128-row tile spills registers on four warps (tests/test_kernels_lowering.py); more rows
# go to more row blocks, a grid dimension.
MIN_BLOCK_ROWS = 16
TILE_ROWS = 64


def float_key(x):
    """Order-preserving int32 keys of float32 values (no NaN): x < y iff key(x) < key(y)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def key_float(key):
    """The inverse of float_key."""
    return lax.bitcast_convert_type(jnp.where(key < 0, key ^ 0x7FFFFFFF, key), jnp.float32)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def divisor(n: int, block: int) -> int | None:
    """The largest power-of-two tile <= block (and >= MIN_TILE) that divides n; None if none does."""
    while block >= MIN_TILE and n % block:
        block //= 2
    return block if block >= MIN_TILE else None


def num_splits(programs: int, max_blocks: int, skew: float = 1.0, target: int = TARGET_PROGRAMS) -> int:
    """Split-K factor: `programs * splits` about `target` (half that for fewer than FEW_PROGRAMS
    programs), one block per split at least. When the programs' work may differ up to
    `skew` times its mean (rows with budgets of their own), `skew` times as many: a kernel lasts as
    long as its longest program, and a split shortens every row's programs alike (bench/NOTES.md,
    "the sparse kernel's splits under a shared budget")."""
    target = target if programs >= FEW_PROGRAMS else target // 2
    return max(1, min(math.ceil(target * skew / programs), MAX_SPLITS, max_blocks))


def split_range(split, n_splits: int, n_blocks):
    """Blocks [lo, hi) of split `split` when the (traced) n_blocks are shared evenly by n_splits."""
    per = (n_blocks + n_splits - 1) // n_splits
    lo = split * per
    return lo, jnp.minimum(lo + per, n_blocks)


def row_blocks(T: int, G: int) -> tuple[int, int, int]:
    """(n_blocks, rows, tile): T query rows as n_blocks blocks of `rows` query rows (the last one
    padded), each packed with its G heads into a tile of `tile` rows (a power of two >= 16)."""
    n_blocks = -(-T // max(TILE_ROWS // G, MIN_BLOCK_ROWS))
    rows = -(-T // n_blocks)
    return n_blocks, rows, next_pow2(max(rows * G, MIN_TILE))


def array_module(x):
    """np for a NumPy array, else jnp: static inputs (a verification tree's mask) stay NumPy, constants
    of the program, where traced they would run as kernels."""
    return np if isinstance(x, np.ndarray) else jnp


def pack_rows(x, n_blocks: int, rows: int, tile: int, fill=0):
    """x [N, T, G, ...] -> [N, n_blocks, tile, ...]: block i holds rows t in [i*rows, (i+1)*rows)
    as packed row (t - i*rows)*G + g; rows past T and the tile's padding rows are `fill`. NumPy in,
    NumPy out (a constant of the program)."""
    xp = array_module(x)
    N, T, G = x.shape[:3]
    rest = [(0, 0)] * (x.ndim - 3)
    x = xp.pad(x, [(0, 0), (0, n_blocks * rows - T), (0, 0)] + rest, constant_values=fill)
    x = x.reshape(N, n_blocks, rows * G, *x.shape[3:])
    return xp.pad(x, [(0, 0), (0, 0), (0, tile - rows * G)] + rest, constant_values=fill)


def tile_positions(q_pos_ref, b, block, rows: int, G: int, tile: int, fill=-1):
    """Inside a kernel: the positions q_pos[b, t] [B, T] of row block `block`'s packed rows (pack_rows'
    layout, `rows` query rows of G heads), `fill` on padding rows. Read here rather than packed by XLA,
    which would run a kernel before every layer's call."""
    T = q_pos_ref.shape[1]
    packed = jnp.arange(tile)
    t = block * rows + packed // G
    real = (packed < rows * G) & (t < T)
    return jnp.where(real, q_pos_ref[b, jnp.minimum(t, T - 1)], fill)


def tile_sinks(sinks_ref, layer, h, G: int, tile: int, split):
    """Inside a kernel: the sink logits sinks[layer, h*G + g] (sinks [L, Hq]) of KV head h's packed
    rows, fp32; -inf outside split 0, since the split merge must count each sink once."""
    sinks = sinks_ref[layer, h * G + jnp.arange(tile) % G].astype(jnp.float32)
    return jnp.where(split == 0, sinks, -jnp.inf)


def tile_queries(q_ref, b, h, block, rows: int, G: int, tile: int, T: int):
    """Inside a kernel: row block `block`'s query tile [tile, Dh] for KV head h, gathered from
    q [B, T * Hq, Dh] (q [B, T, Hq, Dh] reshaped) in pack_rows' layout, zeros on padding rows. Read
    here rather than packed by XLA, which would run a kernel before every layer's call."""
    Hq = q_ref.shape[1] // T
    packed = jnp.arange(tile)
    t = block * rows + packed // G
    real = (packed < rows * G) & (t < T)
    q = q_ref[b, jnp.where(real, t * Hq + h * G + packed % G, 0), :]
    return jnp.where(real[:, None], q, 0)


def unpack_rows(x, T: int, G: int):
    """Kernel rows back to heads: [B, Hkv, n_blocks, rows*G, ...] -> [B, T, Hkv*G, ...]."""
    (B, Hkv, n_blocks, packed), rest = x.shape[:4], x.shape[4:]
    x = x.reshape(B, Hkv, n_blocks * packed // G, G, *rest)[:, :, :T]
    return jnp.moveaxis(x, 1, 2).reshape(B, T, Hkv * G, *rest)


def compiler_params(num_stages: int = 3):
    """The attention kernels' launch settings: four warps beat eight even for 64-row tiles, and three
    pipeline stages of 64-key blocks keep enough loads in flight while the largest collecting tile
    still fits in shared memory (bench/NOTES.md, "Verify attention"). A kernel whose key blocks' address
    is itself a load in the loop (a page-table entry) passes more: see PAGED_STAGES."""
    return plgpu.CompilerParams(num_warps=4, num_stages=num_stages)


# Triton's pipeliner gives a page-table read two of a loop's stages before the key and value loads
# that depend on it, so three stages kept one 64-key block in flight instead of two (the verify kernel's
# shared memory halved: 38.9 against 71.7 KB at Qwen3-8B decode; sm_90 compile of the captured IR; the
# NSA kernels alike). Five keep two, as three did for the contiguous cache (bench/NOTES.md, "Paged KV
# cache"). The sparse draft kernel's key slots were already a gathered load: three still keep its depth.
PAGED_STAGES = 5


def tile_row_blocks(T: int, G: int, Dh: int, max_tile: int):
    """(rows t per program, programs per KV head). A program keeps whole rows (all G heads: pass 2
    sums them in-program) and at most max_tile elements of fp32 output accumulator."""
    per = max(1, min(T, max_tile // Dh // next_pow2(G)))
    n_blocks = -(-T // per)
    return -(-T // n_blocks), n_blocks


def tile_compiler_params(tile_elems: int, max_tile: int):
    """The NSA kernels' settings (their blocks are read through the page table). Four warps (the
    attention kernels' choice) and PAGED_STAGES while the accumulator fits them; eight warps for larger
    tiles (NSA-1B at T = 16: 256 x 64 spills on four warps, not on eight; ptxas, sm_90), at three
    stages: five spill there, and four keep no more in flight than three."""
    if tile_elems <= max_tile // 2:
        return compiler_params(PAGED_STAGES)
    return plgpu.CompilerParams(num_warps=8, num_stages=3)


def matmul_precision(dtype):
    """Full fp32 products for float32 inputs (XLA on GPU would use TF32 otherwise)."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def init_carry(rows: int, head_dim: int, sinks=None):
    """Online-softmax state: unnormalised output, running max (-inf: nothing seen), running sum.

    sinks [rows] (fp32, -inf: none) start it as one seen key of that logit and value 0: each row's
    denominator gains exp(sink - m), its output has no term (an attention sink)."""
    o = jnp.zeros((rows, head_dim), jnp.float32)
    if sinks is None:
        return o, jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32)
    return o, sinks, (sinks > -jnp.inf).astype(jnp.float32)


def softmax_weights(logits, sinks, layer):
    """The references' softmax: (weights, lse) of masked logits [B, Hkv, T, G, N] over the keys. With
    sinks [L, Hq], layer `layer`'s sink logit of each head joins its denominator (a row that sees no
    key then weighs every key 0, and its lse is the sink)."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    if sinks is not None:
        Hkv, G = logits.shape[1], logits.shape[3]
        sink = lax.dynamic_index_in_dim(sinks, layer, 0, keepdims=False).astype(jnp.float32)
        lse = jnp.logaddexp(lse, sink.reshape(Hkv, 1, G))
    return jnp.exp(logits - lse[..., None]), lse


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
    plgpu.store(o_ref.at[pl.ds(0, tile)], o.astype(o_ref.dtype), mask=real[:, None])
    plgpu.store(lse_ref.at[pl.ds(0, tile)], lse, mask=real)


def split_outputs(B: int, Hkv: int, n_blocks: int, n_splits: int, n_rows: int, Dh: int, dtype):
    """out_specs and out_shape of the (b, h, r, split) grid's partial outputs, o [B, Hkv, n_blocks,
    n_splits, n_rows, Dh] and lse [..., n_rows]. One split's o is final, stored in `dtype`: no merge,
    and no conversion kernel between the call and the next product (`merged`)."""
    o_dtype = dtype if n_splits == 1 else jnp.float32
    specs = [pl.BlockSpec((None,) * 4 + (n_rows, Dh), lambda b, h, r, s: (b, h, r, s, 0, 0)),
             pl.BlockSpec((None,) * 4 + (n_rows,), lambda b, h, r, s: (b, h, r, s, 0))]
    shapes = [jax.ShapeDtypeStruct((B, Hkv, n_blocks, n_splits, n_rows, Dh), o_dtype),
              jax.ShapeDtypeStruct((B, Hkv, n_blocks, n_splits, n_rows), jnp.float32)]
    return specs, shapes


def merged(o_part, lse_part, T: int, G: int, dtype, interpret: bool = False):
    """split_outputs' partials merged and unpacked to heads: (out [B, T, Hkv G, Dh] in `dtype`, lse
    [B, T, Hkv G] fp32). One split is final as stored (unpacked by XLA); more go to
    merge_splits_pallas, which writes the unpacked rows itself."""
    if o_part.shape[-3] == 1:
        return unpack_rows(o_part[..., 0, :, :], T, G), unpack_rows(lse_part[..., 0, :], T, G)
    return merge_splits_pallas(o_part, lse_part, dtype, T=T, G=G, interpret=interpret)


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


def _merge_kernel(o_ref, lse_ref, out_ref, lse_out_ref, *, n_splits: int, width: int, Hkv: int, n_blocks: int,
                  rows: int, G: int, T: int):
    """Program (p, j): packed row j of block p = (b, h, r), its splits read as one [width, Dh] tile
    (splits past n_splits masked), written to head h G + g of row t (none past T: the last block's
    padding)."""
    p, j = pl.program_id(0), pl.program_id(1)
    Dh = o_ref.shape[-1]
    ok = jnp.arange(width) < n_splits
    lse = plgpu.load(lse_ref.at[p, pl.ds(0, width), j], mask=ok, other=-jnp.inf)
    o = plgpu.load(o_ref.at[p, pl.ds(0, width), j, pl.ds(0, Dh)], mask=ok[:, None], other=0.0)
    m = jnp.max(lse)
    m_safe = jnp.where(m > -jnp.inf, m, 0.0)
    w = jnp.exp(lse - m_safe)
    l = jnp.sum(w)
    out = jnp.sum(w[:, None] * o, axis=0) / jnp.where(l > 0, l, 1.0)
    b, h, r = p // (Hkv * n_blocks), p // n_blocks % Hkv, p % n_blocks
    t, head = r * rows + j // G, h * G + j % G

    @pl.when(t < T)
    def _():
        plgpu.store(out_ref.at[b, t, head, pl.ds(0, Dh)], out.astype(out_ref.dtype))
        lse_out_ref[b, t, head] = m_safe + jnp.log(l)


def merge_splits_pallas(o_part, lse_part, dtype, *, T: int, G: int, interpret: bool = False):
    """merge_splits as one kernel over split_outputs' partials o_part [B, Hkv, n_blocks, n_splits,
    rows G, Dh] and lse_part [..., rows G], writing the rows unpacked to heads: out [B, T, Hkv G, Dh]
    in `dtype`, lse [B, T, Hkv G] fp32. XLA ran the merge as three kernels (the max, the weights, the
    weighted sum with its conversion), whose fixed costs dominate small batches (bench/NOTES.md, "the
    split merge in one kernel"), and the unpacking of more than one row as a transpose kernel more
    (bench/NOTES.md, "the verify pass's transposes"). Grid (blocks, packed rows): one program a row,
    all its splits in one tile."""
    B, Hkv, n_blocks, n_splits, packed, Dh = o_part.shape
    P = B * Hkv * n_blocks
    kernel = functools.partial(_merge_kernel, n_splits=n_splits, width=next_pow2(max(n_splits, 2)), Hkv=Hkv,
                               n_blocks=n_blocks, rows=packed // G, G=G, T=T)
    return pl.pallas_call(
        kernel,
        grid=(P, packed),
        in_specs=[pl.no_block_spec] * 2,
        out_specs=[pl.no_block_spec] * 2,
        out_shape=[jax.ShapeDtypeStruct((B, T, Hkv * G, Dh), dtype),
                   jax.ShapeDtypeStruct((B, T, Hkv * G), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="merge_splits",
    )(o_part.reshape(P, n_splits, packed, Dh), lse_part.reshape(P, n_splits, packed))


def interpret_default() -> bool:
    """Pallas-Triton kernels run in interpret mode when JAX's default backend is the CPU."""
    return jax.default_backend() == "cpu"
