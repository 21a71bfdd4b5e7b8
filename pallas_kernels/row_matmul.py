"""A few rows times a stacked layer matrix read in place: a decode step's products, exact or quantized.

A decode step at small batch multiplies one to a few rows by every layer matrix, so its time is the
matrix bytes over the memory bandwidth, or at small models the products' fixed costs. The kernel reads
the matrix once where it lies (a layer of a stack, at an index) and converts it in registers. XLA's
own products fall short at these shapes: it converts an int8 matrix to the activations' dtype before
the product, it runs a small exact matrix's product (SmolLM2's, < 2M elements) as multiply + reduce
fusions even with two rows, and a one-row cuBLAS gemm comes with a pad and a copy kernel (bench/NOTES.md,
"small exact matrices through the row kernel"). Which exact matrices the kernel takes: pallas_kernels.row_matmul_reads_exact.

Formats (jaxspec.models.quantize):
- exact: values [K, N] in a float dtype, no scale (scale None); w = values.
- int8: values [K, N] int8, scale [N] float32 per output column; w = values * scale.
- int4: packed [K/2, N] int8 and scale [K/G, N] float32 per group of G rows of K and column. Row j of
  group g's G/2 packed rows holds k = g*G + j in its low nibble and k = g*G + G/2 + j in its high one
  (two's complement, -8..7), so a group's low and high halves multiply two contiguous slices of x.

Grid: (row blocks of 16-64 rows, column blocks, K splits); x is read unpadded (a block's rows past M
load as zeros), so no padding kernel runs before each product; each program streams its columns' share of K
through an fp32 accumulator, and the consumer sums the splits (XLA, or rope_write / residual_norm,
applying int8's column scales). The K splits are the fewest divisors of K's steps that give
TARGET_PROGRAMS (256) programs, else one step a program: at Qwen3-8B shapes that was the best split
count for each of the four int8 matrices, and 128 x 128 blocks on 4 warps with 3 stages beat the other
tilings tried (bench/NOTES.md, "The product kernel against XLA"). SmolLM2's K of 576 is 9 steps of 64:
9 splits, not 1 (its products are latency, not bytes: the shortest program wins).
An exact product whose epilogue sums the splits takes at most epilogue_splits of them.
"""
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import MIN_TILE, TARGET_PROGRAMS, divisor, next_pow2

BLOCK_K = 128  # exact and int8: rows of K per loop step (a divisor of K: 128, 64, 32 or 16)
BLOCK_N = 128  # columns per program (a divisor of N: 128, 64, 32 or 16)
MAX_ROWS = 64  # rows per program: more rows take more row blocks, each reading the matrix again
# An exact product whose consumer sums the splits itself (rope_write, residual_norm: one program a
# row) hands it at most this many bytes of them a row (epilogue_splits): many splits (a 1.2B Llama's
# q/k/v and o at 16) slow those epilogues by more than the product gains (bench/NOTES.md, "the split
# merge in one kernel"). SmolLM2's counts are under the cap; quantized matrices keep the rule
# (Qwen3-8B's int8 counts were measured best with rope_write summing them).
EPILOGUE_BYTES = 40960


def unpack_int4(packed, groups: int):
    """packed [K/2, N] int8 -> values [K, N] int8 in -8..7 (the layout above)."""
    half, N = packed.shape
    p = packed.reshape(groups, half // groups, N)
    lo = lax.shift_right_arithmetic(lax.shift_left(p, jnp.int8(4)), jnp.int8(4))
    hi = lax.shift_right_arithmetic(p, jnp.int8(4))
    return jnp.concatenate([lo, hi], axis=1).reshape(2 * half, N)


def pack_int4(values, groups: int):
    """values [K, N] int8 in -8..7 -> packed [K/2, N] int8 (the inverse of unpack_int4)."""
    K, N = values.shape
    v = values.reshape(groups, 2, K // groups // 2, N)
    return (v[:, 0] & 0xF | (v[:, 1] << 4)).astype(jnp.int8).reshape(K // 2, N)


def is_int4(values, scale) -> bool:
    """int4's scale has a group axis beside the values' own (int8's has none; exact: no scale)."""
    return scale is not None and scale.ndim == values.ndim


def row_matmul_reference(x, values, scale, out_dtype=None):
    """x [M, K] @ the (dequantized) matrix, in fp32 products of x's dtype; out [M, N] (x's dtype)."""
    if is_int4(values, scale):  # per group: one product per group, scaled, summed
        groups = scale.shape[0]
        w = unpack_int4(values, groups).reshape(groups, -1, values.shape[1]).astype(x.dtype)
        xg = x.reshape(x.shape[0], groups, -1)
        out = jnp.einsum("mgk,gkn,gn->mn", xg, w, scale, preferred_element_type=jnp.float32)
    else:  # exact, or int8 times its column scales
        out = jnp.dot(x, values.astype(x.dtype), preferred_element_type=jnp.float32)
        out = out if scale is None else out * scale
    return out.astype(out_dtype or x.dtype)


def product_rows(sums, scale, entry, rows: int, dtype, bias=None):
    """The product's first `rows` rows [rows, N] in `dtype` from its partial sums [S, R, N]
    (reduce=False's, or an exact product's one sum): summed over S in float32, times int8's column
    scales at `entry` (scale [E, N]; None: none), cast, plus bias[entry] if given. The rule every
    consumer of the sums (rope_write, residual_norm) follows, so their results match this product's."""
    out = sums[:, :rows].sum(axis=0)
    if scale is not None:
        out = out * scale[entry]
    out = out.astype(dtype)
    return out if bias is None else out + bias[entry]


def epilogue_splits(N: int) -> int:
    """The most K splits of an exact N-column product that an epilogue sums (EPILOGUE_BYTES a row)."""
    return max(1, EPILOGUE_BYTES // (4 * N))


def supported(values, scale) -> bool:
    """Whether the kernel covers this product (others run the reference); values and scale as
    row_matmul_pallas takes them, with or without a leading layer axis."""
    int4 = is_int4(values, scale)
    rows, N = values.shape[-2:]
    K = 2 * rows if int4 else rows
    step = K // scale.shape[-2] if int4 else divisor(K, BLOCK_K)
    return divisor(N, BLOCK_N) is not None and step is not None and step % (2 * MIN_TILE) == 0


def block_rows(M: int) -> int:
    """Rows per program: M rounded up to a power of two, 16 to MAX_ROWS (a 64 x 128 float32
    accumulator fits four warps' registers)."""
    return min(max(MIN_TILE, next_pow2(M)), MAX_ROWS)


def _make_kernel(M: int, bm: int, steps: int, step_k: int, bn: int, int4: bool, scaled: bool):
    def kernel(layer_ref, x_ref, w_ref, *refs):
        s_ref, o_ref = refs if scaled else (None, *refs)
        i, j, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        rows, cols = pl.ds(i * bm, bm), pl.ds(j * bn, bn)
        layer = layer_ref[0]  # refs are indexed once (Pallas-Triton takes one indexer per load)
        real = i * bm + jnp.arange(bm) < M  # x has M rows: the block's others read as zeros, are not stored

        def load_x(start, width):
            return plgpu.load(x_ref.at[rows, pl.ds(start, width)], mask=real[:, None], other=0.0)

        def body(t, acc):
            step = split * steps + t
            if not int4:
                x = load_x(step * step_k, step_k)
                w = w_ref[layer, pl.ds(step * step_k, step_k), cols].astype(x.dtype)
                return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)
            half = step_k // 2
            x_lo = load_x(step * step_k, half)
            x_hi = load_x(step * step_k + half, half)
            p = w_ref[layer, pl.ds(step * half, half), cols]
            lo = lax.shift_right_arithmetic(lax.shift_left(p, jnp.int8(4)), jnp.int8(4)).astype(x_lo.dtype)
            hi = lax.shift_right_arithmetic(p, jnp.int8(4)).astype(x_lo.dtype)
            part = (jnp.dot(x_lo, lo, preferred_element_type=jnp.float32)
                    + jnp.dot(x_hi, hi, preferred_element_type=jnp.float32))
            return acc + part * s_ref[layer, step, cols][None, :]

        acc = lax.fori_loop(0, steps, body, jnp.zeros((bm, bn), jnp.float32))
        plgpu.store(o_ref.at[split, rows, cols], acc, mask=real[:, None])

    return kernel


def row_matmul_pallas(x, values, scale, out_dtype=None, *, layer=None, interpret: bool = False,
                      block_k: int = BLOCK_K, block_n: int = BLOCK_N, block_m: int | None = None, num_warps: int = 4,
                      num_stages: int = 3, target_programs: int = TARGET_PROGRAMS, splits: int | None = None,
                      max_splits: int | None = None, reduce: bool = True):
    """The kernel's x [M, K] @ (dequantized) matrix (the reference's result, summed in another order).
    reduce=False returns the kernel's partial sums [splits, R >= M, N] float32 and int8's column
    scales [E, N] (None for exact matrices and for int4, whose group scales the kernel applies), for a
    consumer that sums them itself (rope_write) instead of XLA's kernel between the two.

    With `layer` (an int32 scalar), values and scale carry a leading layer axis and the kernel reads
    that layer's matrix in place: a layer sliced out of a stack inside a scan would be copied by XLA
    before the kernel reads it (bench/NOTES.md, "fused layer projections"). The tiling arguments
    are for bench/row_matmul.py's sweep (int4 steps are its groups, whatever block_k says);
    `max_splits` caps the rule's split count at its largest divisor of K's steps within the cap."""
    int4, scaled = is_int4(values, scale), scale is not None
    if layer is None:
        values, scale, layer = values[None], None if scale is None else scale[None], 0
    M, K = x.shape
    N = values.shape[-1]
    bn = divisor(N, block_n)
    step_k = K // scale.shape[1] if int4 else divisor(K, block_k)
    total = K // step_k
    bm = block_m or block_rows(M)
    m_blocks = -(-M // bm)
    programs = m_blocks * (N // bn)
    if splits is None:  # the fewest that make target_programs programs, else one step each (see above)
        splits = next(d for d in range(1, total + 1) if total % d == 0 and (programs * d >= target_programs or d == total))
        if max_splits is not None:
            splits = max(d for d in range(1, min(splits, max_splits) + 1) if total % d == 0)
    if total % splits:
        raise ValueError(f"{splits} splits do not divide {total} steps of K")
    partial = pl.pallas_call(
        _make_kernel(M, bm, total // splits, step_k, bn, int4, scaled),
        grid=(m_blocks, N // bn, splits),
        in_specs=[pl.no_block_spec] * (3 + scaled),
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((splits, m_blocks * bm, N), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="row_matmul",
    )(jnp.reshape(jnp.asarray(layer, jnp.int32), (1,)), x, values, *([scale] if scaled else []))
    scale = None if int4 else scale
    if not reduce:
        return partial, scale
    return product_rows(partial, scale, layer, M, out_dtype or x.dtype)
