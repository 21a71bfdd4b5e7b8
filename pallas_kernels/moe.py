"""The routed experts of a mixture-of-experts layer: each token row through its k experts' gated MLPs,
weighted by the router and summed.

result[t] = sum_j weight[t, j] * ((a_e(x[t]) @ w_down[layer, e]) + b_down[layer, e]), e = ids[t, j],
where a_e is the activation of h = x[t] @ w_gate_up[layer, e] + b_gate_up[layer, e] (gate columns
h[:F], up columns h[F:]):
- "silu" (Qwen3-MoE): a = silu(g) * u;
- "gpt_oss" (gpt-oss's clamped SwiGLU): g = min(g, 7), u = clip(u, -7, 7), a = (u + 1) * g * sigmoid(1.702 g).
  gpt-oss's checkpoints interleave the gate and up columns: a loader splits them into this layout.
Products take x's dtype as operands (the weights converted in registers) and accumulate in float32;
the activations a enter the down product in x's dtype, as the model's own MLP does.

A decode or verification step routes a few rows to a few of E experts, so the layer's time is the
routed experts' bytes over the memory bandwidth. XLA's grouped product (lax.ragged_dot, the reference
here) reads far more than the routed experts at these row counts, hence the kernel: the T*k (token,
expert) assignments are grouped by expert (a one-hot and its running sums: a few fused XLA kernels;
a decode step's single row needs none), and each distinct expert hit gets a slot (min(E, T*k)
slots, static). Two calls, each a grid of (slot, column block): a slot past the
distinct experts returns at once, reading nothing; otherwise the program streams its expert's column
block of the weights through float32 accumulators for every row of that expert (row blocks of a
dynamic count; one block in the common case, so each routed weight is read once), x's rows gathered
by token inside the kernel. The first call writes the activations [T*k, F] (x's dtype, sorted order),
the second the experts' outputs [T*k, D] float32; XLA weights them and sums each token's k. The
weight stacks are read in place at the traced `layer`: a layer sliced out of a stack inside the
decoder's layer scan would be copied first (bench/NOTES.md, "fused layer projections").

Either stack may be `MXFP4` (gpt-oss's released expert form, 4.25 bits a weight instead of 16; the
format and its decodes: `pallas_kernels.mxfp4`): the
kernel then reads each routed expert's packed bytes and scales once, bf16 rows through Triton's
scaled dot (`mxfp4_dot`; with PAIRED_DECODE, a byte's two codes into one bf16x2 register in inline
PTX: `paired_weights`), float32 rows decoded in registers (`mxfp4.decode`), so the bytes floor is a
quarter of bf16's. Measured at 5.3-5.8x that floor at 7-128 rows while the code tiles were loaded a
byte at a time outside the pipeline (their offsets by floor division: `packed_offset`), and at
4.9-5.6x since (the decode's arithmetic, bench/NOTES.md); through the paired decode, 4.0-4.2x at 8-128
rows. A stack may also hold its codes as words (`mxfp4.to_words`, as `jaxspec.loaders.load_model` leaves
gpt-oss's experts: each scale group re-packed so that a
thread loads whole words and decodes 8 codes into its 4 operand registers by rotations and masks,
`word_weights`): measured on an H100, row blocks 19-25% faster than the paired decode at 2-128 rows
(2.3-2.5x the floor at 8-128). A decode step's single row through MXFP4 takes the one-row form of
both calls (bytes: 3.8x on the H100, the codes' bits placed, `code_values`; words: the row's columns
read a scale group at a time, `group_view`, so no decoded tile is reordered: 3.0x); a decode step's
single row through bf16 stacks the fused form where its steps are whole (one call: each program its F
columns' gate/up and their share of down), up to 128 rows the split-K form, whose programs keep wide
column blocks and, for a few rows, divide K (`default_form`). The reference decodes the layer's whole
stack with the same function and runs the float path.

An assignment of id -1 is dropped (expert parallelism: another device's expert): it sorts after every
expert's rows, no slot covers it, and its output row counts as zero.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import MIN_TILE, TARGET_PROGRAMS, divisor, matmul_precision, next_pow2, num_splits
from pallas_kernels.mxfp4 import (MXFP4, MXFP4_GROUP, code_values, decoded_dot, dequantize, mxfp4_dot,
                                  paired_weights, per_byte, scale_power, word_factors, word_values, word_weights)

ACTIVATIONS = ("silu", "gpt_oss")
GPT_OSS_LIMIT = 7.0  # gpt-oss's clamp of the gate (above) and the up projection (both sides)
GPT_OSS_ALPHA = 1.702  # gpt-oss's sigmoid slope
# Rows of the weights per loop step: a power of two, BLOCK_K or more, so that a step's weight tile holds
# STEP_ELEMENTS (a 64 x 64 tile's) however narrow the column block, PACKED_STEP_ELEMENTS for MXFP4
# stacks (a 4 KB tile: on an H200 at gpt-oss-20b's shapes 5-15% faster at 8-128 rows than 2 KB or
# 8 KB, bench/NOTES.md). Where the step does not divide K (gpt-oss's 2880 = 45 x 64) the last weights
# take static steps of smaller powers of two (`k_steps`).
BLOCK_K = 64
STEP_ELEMENTS = 64 * 64
PACKED_STEP_ELEMENTS = 128 * 64
GATE_UP_COLUMNS = 64  # the first call's columns per program, of the gate and of the up half each
DOWN_COLUMNS = 128  # the second call's columns per program (one accumulator)
# MXFP4 words' K step at most: a decode step's 32-column gate/up blocks at 256 take 244 registers (158 at
# 128) for 4% fewer instructions a weight (sm_90 SASS).
# Blocks of words narrower than WGMMA_COLUMNS (a decode step's: below a warpgroup's operand A, so
# mma.sync) take NARROW_WORD_WARPS warps: each thread then decodes twice the weights a step against the
# loop's fixed costs (sm_90 SASS, one row: 5.0 instructions a weight in the gate/up loop against 7.0 with 4).
WORD_STEP = 128
WGMMA_COLUMNS = 64
NARROW_WORD_WARPS = 2
# Blocks of words at least this wide: 64 keeps a decode step on the warpgroup's product (no round trip,
# fewer instructions a weight) at half the programs (180 at gpt-oss-20b's one row, against 132 SMs);
# 32 (the default) fills the GPU. bench/moe.py --word-columns times both.
WORD_MIN_COLUMNS = 32
MAX_ROWS = 64  # rows per row block: an expert's further rows take further blocks, re-reading its tile
# A decode step's single row with MXFP4 stacks takes the one-row kernels: float32 multiply-and-sum in
# registers instead of the matrix unit (which pads the row to 16 and takes each decoded tile through
# shared memory into its operand layout). Measured on an H200 at gpt-oss-20b's shapes: 82 against
# 106-110 us for row blocks and 98-102 for split K (131 against 164 before `packed_offset`); with bf16
# stacks, or more rows, the other forms win (bench/NOTES.md, "the experts kernel's one-row form" and
# "the floor-division fix"). ROW_STEP_ELEMENTS: the weights of a gate/up column block a loop step reads (down's:
# ONE_ROW_DOWN_STEP_ELEMENTS); 2,048 or 4,096 took 59.1-59.3 against 48.3 us at 8,192 (H100, bench/NOTES.md).
ROW_STEP_ELEMENTS = 8192
# Column blocks' tiles a one-row loop keeps loading while it multiplies a step (`_row_products`): gate/up
# multiplies two blocks a step, so it loads one step ahead, down one block, so two steps ahead. One step
# ahead left down's warps waiting on its loads (ncu: 69% long-scoreboard stalls against gate/up's 37%);
# two measured 54.3 against 56.3 us a one-row call on an H100 (bench/moe.py --tiles-in-flight).
ROW_TILES_IN_FLIGHT = 2
# The one-row form's programs at least (`column_block`'s target): 512 gives gpt-oss-20b's decode step
# 16-column blocks, 720 programs a call. With x fetched ahead with the tiles that measured 48.8 against
# 52.1 us for 256 (32-column blocks, 360 programs; before that fetch 512 lost, 63.6 against 52.0) on an
# H100 (bench/moe.py --one-row-programs; bench/NOTES.md).
ONE_ROW_PROGRAMS = 512
# Down's programs at least in the one-row form. A down program multiplies one column block where a gate/up
# program multiplies two (gate's and up's), so at equal targets its loop is half as long and its prologue
# and epilogue weigh twice as much; its own target lets bench/moe.py sweep it apart (--one-row-down-programs).
# Measured on an H100 at gpt-oss-20b's one row: 256 (32-column blocks) made down 10% slower (16.2 against 14.8 us).
ONE_ROW_DOWN_PROGRAMS = ONE_ROW_PROGRAMS
# Down's ROW_STEP_ELEMENTS in the one-row form. For the same reason its loop carries the step's fixed work (the
# tiles' addresses and x's run) over half the weights: in sm_90 SASS at gpt-oss-20b's one row (scale words, 16
# columns) the loop takes 6.6 instructions a weight against gate/up's 5.3, and 5.1 at 16,384 (163 registers
# against 71); bench/moe.py --one-row-down-step sweeps it. Measured on an H100, two processes: at best (16,384 with
# 256 programs) 14.5 against 14.8 us, so the loop's instructions are not what bounds down (bench/NOTES.md).
ONE_ROW_DOWN_STEP_ELEMENTS = ROW_STEP_ELEMENTS
# Row blocks of bf16 rows through MXFP4 stacks: Triton's scaled dot (`mxfp4_dot`) instead of `mxfp4.decode`
# in registers (float32 rows keep the decode). On an H200 at gpt-oss-20b's shapes 2-10% faster at 7-128
# rows, 5-6x the bytes floor either way (bench/NOTES.md); tests patch it off to cover the decode.
SCALED_DOT = True
# Row blocks of bf16 rows through MXFP4 stacks: each byte's two codes decoded into one bf16x2 register in
# inline PTX (`mxfp4.paired_values`: a byte permute, two shifts, two masks and two multiplies) and the product
# taken as W^T x^T, the decoded weights the matrix unit's A operand from registers, in place of the scaled
# dot's table lookups (compiled for sm_90: 9.4 -> 6.6 instructions a weight in the product's loop;
# measured on the H200 at gpt-oss-20b's shapes, 8-128 rows: row blocks 21-26% faster, 5.0-5.6x -> 4.0-4.2x
# the bytes floor, the same error; bench/NOTES.md). Tests patch it off to cover the other decodes.
PAIRED_DECODE = True
# The split-K form (`FORMS`): row blocks of wide column blocks, K split among programs, partial sums
# added (and the gate/up activation applied) by XLA after each call. A decode step's few experts fill
# the GPU only as narrow column blocks, and over [K, N] stacks a 16-column bf16 block reads 32 bytes of
# each row of K, 3 KB apart (Qwen3-30B-A3B); splitting K keeps each program's runs SPLIT_COLUMNS wide.
# Measured on an H200 at Qwen3-30B-A3B's shapes: one row 35.5 against 48.7 us (1.96x the bytes floor
# against 2.70x), 2-16 rows 2-12% faster, 32-128 rows (one chunk of K: the wider column blocks alone)
# 2-4% faster; bf16 stacks take it up to SPLIT_ROWS rows, the measured range (bench/NOTES.md; a
# prefill chunk's 64-row blocks of its wide columns spill on sm_90). MXFP4 stacks keep their forms
# (one row: 97 against the one-row form's 67 us, H200, the placed decode).
SPLIT_GATE_UP_COLUMNS = 128
SPLIT_DOWN_COLUMNS = 256
# The split-K form's programs about (`k_splits`, rounded down to a split count that divides K's tiles):
# Qwen3-30B-A3B's decode step gets 192 gate/up and 256 down programs (bench/moe.py --split-programs).
SPLIT_PROGRAMS = TARGET_PROGRAMS
SPLIT_ROWS = 128
# The fused form (`FORMS`, float stacks): a program takes FUSED_COLUMNS of its expert's F (their gate and
# up columns over all of K, up to FUSED_STEP_ELEMENTS weights of each a loop step, activated in registers) and
# multiplies them by the same rows of down, all D columns in steps of FUSED_DOWN_COLUMNS, into partial
# outputs [F / FUSED_COLUMNS, rows, D] that XLA adds up with the combine: one call instead of split K's
# two and the fusion between them, for the partial outputs' float32 bytes (0.75 MB at one Qwen3-30B-A3B
# row, beside its routed experts' 75 MB). Float stacks take it up to FUSED_ROWS rows. Measured on an H100
# at Qwen3-30B-A3B's shapes, six processes (bench/moe.py --implementations split_k,fused): one row 40.7 us
# against split K's 43.3 (1.61x the bytes floor against 1.72x), two rows 81.0 against 76.8, four 127.7
# against 122.4. The sweeps before (--fused-columns --fused-step --warps): 64 columns, 8,192 weights a
# step and 8 warps (96 programs, one an SM, then at 188 registers) best; 32 or 16 columns (192 or 384
# programs, 64- or 32-byte runs of each row of K) 46.5 and 52.4 us (bench/NOTES.md). Traced, the kernel
# itself takes 29.3-29.8 us at one row, 1.16-1.19x the floor; the rest of bench/moe.py's call is small XLA
# kernels of 1-2 us, some of them the benchmark's own (reading the slots in the kernel, `_slot`, tied);
# 3-5 pipeline stages tie (H100). Only where those steps are whole: at
# gpt-oss-20b's D = 2880 (not a multiple of FUSED_DOWN_COLUMNS) they shrink to 64 weights of K and 64
# columns of down, and split K wins at one row, 83.5 against 88.1-88.3 us (H100, two processes).
FUSED_COLUMNS = 64
FUSED_DOWN_COLUMNS = 256
FUSED_STEP_ELEMENTS = 64 * 128
FUSED_WARPS = 8
FUSED_ROWS = 1
FORMS = ("row_blocks", "one_row", "split_k", "fused")




def activate(gate, up, activation: str):
    """The gated activation of float32 gate and up columns (the module docstring's formulas)."""
    if activation == "silu":
        return jax.nn.silu(gate) * up
    if activation != "gpt_oss":
        raise ValueError(f"unknown MoE activation {activation!r}: expected one of {ACTIVATIONS}")
    gate = jnp.minimum(gate, GPT_OSS_LIMIT)
    up = jnp.clip(up, -GPT_OSS_LIMIT, GPT_OSS_LIMIT)
    return (up + 1.0) * gate * jax.nn.sigmoid(GPT_OSS_ALPHA * gate)


def _route(expert_ids, num_experts: int):
    """(order [T*k]: the assignments t*k + j sorted by expert, stable; position [T*k]: where each
    assignment sits in that order; sizes [E]: rows per expert), from a one-hot of the assignments in a
    few fused XLA kernels (a sort is several launches, and decode steps route a handful of rows).
    Dropped assignments (id -1: `moe_experts_pallas`) sort last, counted in no expert's size."""
    flat = jnp.where(expert_ids < 0, num_experts, expert_ids).reshape(-1)  # dropped: a last, virtual expert
    onehot = (flat[:, None] == jnp.arange(num_experts + 1, dtype=jnp.int32)).astype(jnp.int32)  # [T*k, E + 1]
    sizes = onehot.sum(axis=0)
    before = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), flat[:, None], axis=1)[:, 0] - 1  # same expert, earlier
    position = (jnp.cumsum(sizes) - sizes)[flat] + before
    order = jnp.zeros_like(flat).at[position].set(jnp.arange(flat.size, dtype=jnp.int32))
    return order, position, sizes[:num_experts]


def _combine(y, position, expert_ids, expert_weights):
    """float32 [T, D]: each token's k expert outputs (rows of y [>= T*k, D] in sorted order) weighted
    and summed, dropped assignments' rows (never written) as zeros; a gather of each token's rows
    rather than a scatter-add, so the sum's order is fixed."""
    T, k = expert_weights.shape
    rows = jnp.where((expert_ids >= 0)[..., None], y[position].reshape(T, k, -1), 0.0)
    return jnp.einsum("tkd,tk->td", rows, expert_weights, precision=lax.Precision.HIGHEST)


def _row_experts(expert_ids, order):
    """[T*k]: the expert of each assignment in sorted order (a dropped one's: 0, any expert, its row
    unused), to gather per-expert biases by."""
    return jnp.maximum(expert_ids.reshape(-1)[order], 0)


def moe_experts_reference(x, expert_ids, expert_weights, w_gate_up, w_down, layer, *, b_gate_up=None,
                          b_down=None, activation: str = "silu"):
    """The routed experts through XLA's grouped product (lax.ragged_dot) over the sorted assignments,
    at layer `layer` of the stacks (an MXFP4 stack's layer dequantized first); correct for any shape.
    float32 [T, D]."""
    k = expert_ids.shape[1]
    order, position, sizes = _route(expert_ids, w_gate_up.shape[1])
    expert = _row_experts(expert_ids, order)
    product = functools.partial(lax.ragged_dot, group_sizes=sizes, precision=matmul_precision(x.dtype),
                                preferred_element_type=jnp.float32)
    at_layer = lambda w: dequantize(jax.tree.map(lambda a: a[layer], w)) if isinstance(w, MXFP4) else w[layer]
    h = product(x[order // k], at_layer(w_gate_up).astype(x.dtype))
    if b_gate_up is not None:
        h = h + b_gate_up[layer, expert].astype(jnp.float32)
    F = w_down.shape[-2]
    a = activate(h[:, :F], h[:, F:], activation).astype(x.dtype)
    y = product(a, at_layer(w_down).astype(x.dtype))
    if b_down is not None:
        y = y + b_down[layer, expert].astype(jnp.float32)
    return _combine(y, position, expert_ids, expert_weights)


def supported(w_gate_up, w_down) -> bool:
    """Whether the kernel covers these stacks (others run the reference): D and F multiples of 16,
    the smallest Triton tile (Qwen3-30B-A3B's 2048 and 768, gpt-oss-20b's 2880 = 45 x 64 are); an
    MXFP4 stack's K steps hold whole scale groups then (K is a multiple of 32)."""
    D, F = w_down.shape[-1], w_down.shape[-2]
    return w_gate_up.shape[-2:] == (D, 2 * F) and divisor(D, MIN_TILE) is not None and divisor(F, MIN_TILE) is not None


def block_rows(assignments: int, slots: int) -> int:
    """Rows per row block: twice an expert's mean rows (random routing's busiest experts stay in one
    block), a power of two from 16 to MAX_ROWS."""
    return min(max(MIN_TILE, next_pow2(2 * -(-assignments // slots))), MAX_ROWS)


def column_block(N: int, widest: int, slots: int, narrowest: int = MIN_TILE,
                 target: int = TARGET_PROGRAMS) -> int:
    """Columns per program: the widest divisor of N up to `widest` that still gives `target` (slot, column
    block) programs, else the narrowest (at least `narrowest`): a decode step's few experts need narrow
    blocks to fill the GPU."""
    block = divisor(N, widest)
    while block > narrowest and slots * (N // block) < target and N % (block // 2) == 0:
        block //= 2
    return block


def step_rows(K: int, columns: int, packed: bool, words: bool = False) -> int:
    """Weights of K per loop step for a `columns`-wide block (BLOCK_K, STEP_ELEMENTS; MXFP4 words at most
    WORD_STEP): a power of two."""
    floor_pow2 = lambda n: 1 << (n.bit_length() - 1)
    widest = (PACKED_STEP_ELEMENTS if packed else STEP_ELEMENTS) // columns
    return min(max(BLOCK_K, floor_pow2(widest)), floor_pow2(K), WORD_STEP if words else K)


def k_steps(K: int, bk: int) -> tuple[int, list[tuple[int, int]]]:
    """(full, tail): `full` loop steps of bk weights of K, then static (start, size) steps of smaller
    powers of two over the rest (each a multiple of 16, and of 32 for MXFP4, as K is)."""
    full, tail, size = K // bk, [], bk
    start = full * bk
    while start < K:
        while size > K - start:
            size //= 2
        tail.append((start, size))
        start += size
    return full, tail


def _over_k(step, acc, K: int, bk: int, first=0):
    """Inside a kernel: acc through step(acc, k0, size) over K weights from `first` (a split's chunk):
    a loop of bk-weight steps, then `k_steps`' static tail."""
    full, tail = k_steps(K, bk)
    acc = lax.fori_loop(0, full, lambda i, acc: step(acc, first + i * bk, bk), acc)
    for start, size in tail:
        acc = step(acc, first + start, size)
    return acc


def _slot(slots_ref):
    """Inside a kernel: (expert, start, end) of this program's slot, grid axis 0: a column of `_slots`
    [3, S], or of a decode step's single row its expert ids [1, k] (slot s is assignment s, empty where
    the id is -1, dropped): read in the kernel, so that the row's ids need no XLA kernel to become slots."""
    s = pl.program_id(0)
    if slots_ref.shape[0] == 1:
        e = slots_ref[0, s]
        return jnp.maximum(e, 0), s, s + (e >= 0).astype(jnp.int32)
    return slots_ref[0, s], slots_ref[1, s], slots_ref[2, s]


def _slot_rows(slots_ref, bm: int, body):
    """Inside a kernel: body(start, real) for each row block of this program's slot (real [bm]: the
    block's rows inside the slot's range), nothing for a slot past the distinct experts."""
    _, lo, hi = _slot(slots_ref)

    @pl.when(hi > lo)
    def _():
        def block(r, carry):
            start = lo + r * bm
            body(start, start + jnp.arange(bm) < hi)
            return carry

        lax.fori_loop(0, (hi - lo + bm - 1) // bm, block, 0)


def packed_offset(k0, per: int):
    """Inside a kernel: weight offset k0 (>= 0, a multiple of `per`) in units of `per` weights (a byte
    holds 2 codes, a scale 32), by truncating division. Python's floor division of a traced int adds a
    sign fix-up that hides from Triton that the offset stays a multiple of the step, and then a tile
    of MXFP4 bytes is loaded one byte a thread at a time, outside the pipeline (sm_90 SASS: LDG.E.U8
    instead of 16-byte async copies; bench/NOTES.md)."""
    return lax.div(k0, per)


def step_scales(scales_ref, layer, e, cols, k0, bk: int, masked: bool = False):
    """Inside a kernel: the scales of K's [k0, k0 + bk) at `cols` of expert e at `layer`, as loaded: a
    byte ref's [columns, bk/32] (uint8), or from scale words (`mxfp4.pack_scales`) bk/128 words from k0 a
    multiple of 128, or the one word that holds the step's bk/32 groups (`scale_bytes` takes them
    apart). `masked` (a step that may run past K): what lies past the stack's scales reads 0."""
    groups = bk // MXFP4_GROUP
    start, size = ((packed_offset(k0, MXFP4_GROUP), groups) if scales_ref.dtype == jnp.uint8
                   else (packed_offset(k0, 4 * MXFP4_GROUP), max(1, groups // 4)))
    ref, inside = scales_ref.at[layer, e, cols, pl.ds(start, size)], start + jnp.arange(size) < scales_ref.shape[-1]
    return plgpu.load(ref, mask=inside[None, :], other=0) if masked else ref[...]


def scale_bytes(scales, k0, bk: int, stacked: bool = False):
    """[columns, bk/32] scales of `step_scales`' tile: bytes as they are, words taken apart (int32) by
    shifts of their broadcast copies, or with `stacked` (bk a multiple of 128) stacked one by one: the
    row blocks' gate/up call then takes 155 registers a thread, not 162 (sm_90 with the CPU's Triton,
    gpt-oss-20b's shapes). The one-row form takes shifts: with its tiles fetched a step ahead, stacking
    raised its gate/up call from 128 registers to 163 and its loop from 661 instructions to 681."""
    if scales.dtype == jnp.uint8:
        return scales
    groups, words = bk // MXFP4_GROUP, scales.astype(jnp.int32)
    if stacked:  # [columns, n, 4] by two-way stacks (Triton's only): bytes (0, 2) and (1, 3) interleaved
        byte = lambda b: lax.shift_right_logical(words, 8 * b) & 255
        pairs = jnp.stack([jnp.stack([byte(0), byte(2)], axis=-1), jnp.stack([byte(1), byte(3)], axis=-1)], axis=-1)
        return pairs.reshape(words.shape[0], groups)
    first = 0 if groups >= 4 else lax.rem(packed_offset(k0, MXFP4_GROUP), 4)  # the step's first byte of its word
    shifts = 8 * ((first + jnp.arange(groups)) % 4)
    return lax.shift_right_logical(per_byte(words, units=min(4, groups)), shifts[None, :]) & 255


def _product(acc, load_x, w_refs, layer, e, k0, bk: int, cols, small: bool = False):
    """Inside a kernel: float32 acc [rows, columns] + x's columns [k0, k0 + bk) (load_x(slice), in x's
    dtype) times W's rows [k0, k0 + bk) at `cols`: a float stack's tile converted to x's dtype, or an
    MXFP4 stack's [columns, bk/2] bytes and [columns, bk/32] scales decoded to [columns, bk] in
    registers (a transposed product), or with SCALED_DOT and bf16 rows, by `mxfp4_dot`; with
    `_transposed` stacks acc is [columns, rows] (W^T x^T, by `paired_weights` or `word_weights`; `small`:
    words of scales between 1 and 128, `MXFP4.small_scales`)."""
    x = load_x(pl.ds(k0, bk))
    if len(w_refs) == 1:
        w = w_refs[0][layer, e, pl.ds(k0, bk), cols].astype(x.dtype)
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)
    blocks_ref, scales_ref = w_refs
    stacked = bk % (4 * MXFP4_GROUP) == 0 and cols.size >= WGMMA_COLUMNS  # fewer registers there (`scale_bytes`)
    scales = scale_bytes(step_scales(scales_ref, layer, e, cols, k0, bk), k0, bk, stacked)
    transposed = lambda w: acc + lax.dot_general(w.astype(x.dtype), x, (((1,), (1,)), ((), ())),
                                                 preferred_element_type=jnp.float32)
    if _reads_words(w_refs):
        words = lax.bitcast_convert_type(blocks_ref[layer, e, cols, pl.ds(packed_offset(k0, 8), bk // 8)], jnp.int32)
        return transposed(word_weights(words, scales, small))
    codes = blocks_ref[layer, e, cols, pl.ds(packed_offset(k0, 2), bk // 2)]
    if _transposed(w_refs, x.dtype):
        return transposed(paired_weights(codes, scales))
    if SCALED_DOT and x.dtype == jnp.bfloat16:
        return mxfp4_dot(acc, x, codes, scales)
    return decoded_dot(acc, x, codes, scales)


def _reads_words(w_refs) -> bool:
    """Whether a kernel's weight refs are an MXFP4 stack of words (`MXFP4.words`, for refs)."""
    return len(w_refs) == 2 and w_refs[0].dtype == jnp.uint32


def _transposed(w_refs, dtype) -> bool:
    """Whether `_product` takes MXFP4 weights as W^T x^T: words (`word_weights`), or bytes through
    `paired_weights` (PAIRED_DECODE, bf16 rows)."""
    return _reads_words(w_refs) or len(w_refs) == 2 and PAIRED_DECODE and dtype == jnp.bfloat16


def _over_rows(step, K: int, bk: int, first, bm: int, columns: int, w_refs, dtype, products: int):
    """`_over_k` of `products` float32 accumulators [bm, columns] (`_transposed` ones as [columns, bm]
    inside the loop, transposed once after it)."""
    transposed = _transposed(w_refs, dtype)
    zeros = jnp.zeros((columns, bm) if transposed else (bm, columns), jnp.float32)
    accs = _over_k(step, (zeros,) * products, K, bk, first)
    return tuple(a.T for a in accs) if transposed else accs


def default_form(rows: int, packed: bool, D: int) -> str:
    """The kernel's form (`FORMS`) for `rows` token rows of width D: through MXFP4 stacks (bytes or
    words) one row (a decode step's) takes the one-row form and more rows row blocks; through float
    stacks up to FUSED_ROWS rows the fused form where D takes its whole down steps, then up to
    SPLIT_ROWS rows split K, more row blocks."""
    if packed:
        return "one_row" if rows == 1 else "row_blocks"
    if rows <= FUSED_ROWS and D % FUSED_DOWN_COLUMNS == 0:
        return "fused"
    return "split_k" if rows <= SPLIT_ROWS else "row_blocks"


def k_splits(K: int, programs: int, packed: bool) -> int:
    """The split-K form's chunks of K for `programs` (slot, column block) programs: `num_splits`'
    count, lowered until whole scale groups (MXFP4) or MIN_TILE rows divide evenly among them."""
    units = K // (MXFP4_GROUP if packed else MIN_TILE)
    splits = num_splits(programs, units, target=SPLIT_PROGRAMS)
    while units % splits:
        splits -= 1
    return splits


def row_step(K: int, columns: int, elements: int) -> int:
    """Weights of K per loop step of the one-row kernels for a `columns`-wide block reading about
    `elements` weights a step: a power of two (whole MXFP4 groups), the last step masked where it does
    not divide K (gpt-oss's 2880)."""
    return min(max(MXFP4_GROUP, elements // columns), next_pow2(K))


def group_view(x):
    """x [rows, K] as [rows, K/32, 32], one scale group a row (a view: no kernel), for the one-row form
    through words: output j of word t of group g multiplies columns 32 g + 8 j + 2 t and the next (the
    pair 4 j + t), so a step reads output j's columns as the [groups, 8] block at column 8 j."""
    rows, K = x.shape
    return x.reshape(rows, K // MXFP4_GROUP, MXFP4_GROUP)


def _width(ref) -> int:
    """K of a kernel's rows: x_ref [rows, K], or a `group_view` one [rows, K/32, 32]."""
    return ref.shape[1] if ref.ndim == 2 else ref.shape[1] * ref.shape[2]


def _row_products(x_ref, row, w_refs, layer, e, column_blocks, bk: int, small: bool = False):
    """Inside a kernel: float32 [columns] for each of `column_blocks`: x_ref's row `row` times W[:, cols]
    of expert e at `layer`, multiplied and summed in float32 over K in steps of bk weights. An MXFP4
    tile [columns, bk/2] bytes multiplies x's even and odd columns (a step of x split in two) with its
    low and high codes, so no decoded tile is interleaved; a tile of words [columns, bk/8] multiplies
    each output's two halves with x's columns by `group_view` (x_ref [rows, K/32, 32]) into sums
    [columns, bk/8] (a multiply-add a weight: no sum across a step's words until the loop ends; `small`:
    as `_product`'s).
    Each step's weight tiles and its run of x are loaded steps ahead, in the loop's carry
    (ROW_TILES_IN_FLIGHT): Triton does not pipeline this loop, and its warps waited on the loads of the
    step they were in, the weights' and then x's (ncu; bench/NOTES.md)."""
    K, of_words = _width(x_ref), _reads_words(w_refs)
    ahead = max(1, ROW_TILES_IN_FLIGHT // len(column_blocks))
    masked = K % bk != 0
    steps = -(-K // bk)
    load = lambda ref, inside: plgpu.load(ref, mask=inside, other=0) if masked else ref[...]

    def row_at(k0):
        """x's row for the step at k0, as loaded: [bk], or (words) the columns of each word output j,
        [bk/4] from its step's groups' [groups, 8] block at column 8 j (`group_view`)."""
        if of_words:
            first, groups = packed_offset(k0, MXFP4_GROUP), bk // MXFP4_GROUP
            inside = (first + jnp.arange(groups) < K // MXFP4_GROUP)[:, None]
            return tuple(load(x_ref.at[row, pl.ds(first, groups), pl.ds(8 * j, 8)], inside).reshape(groups * 8)
                         for j in range(4))
        return load(x_ref.at[row, pl.ds(k0, bk)], k0 + jnp.arange(bk) < K)

    def halves(pairs):
        """float32 even and odd columns [1, n/2] of a run of x [n]."""
        even, odd = lax.unstack(pairs.astype(jnp.float32).reshape(-1, 2), axis=1)
        return even[None, :], odd[None, :]

    def fetch(i):
        """Step i's row of x and tiles (for each column block), as loaded (the last step's again past it:
        unused)."""
        k0 = jnp.minimum(i, steps - 1) * bk
        if len(w_refs) == 1:
            inside = k0 + jnp.arange(bk) < K
            return row_at(k0), tuple(load(w_refs[0].at[layer, e, pl.ds(k0, bk), cols], inside[:, None])
                                     for cols in column_blocks)
        blocks_ref, scales_ref = w_refs
        per, units = (8, bk // 8) if of_words else (2, bk // 2)
        unit0 = packed_offset(k0, per)
        inside = unit0 + jnp.arange(units) < K // per
        return row_at(k0), tuple((load(blocks_ref.at[layer, e, cols, pl.ds(unit0, units)], inside[None, :]),
                                  step_scales(scales_ref, layer, e, cols, k0, bk, masked)) for cols in column_blocks)

    def step(i, carry):
        accs, ((x, tiles), *later) = carry
        k0, loading = i * bk, (*later, fetch(i + ahead))
        if len(w_refs) == 1:
            x = x.astype(jnp.float32)[:, None]
            return tuple(acc + jnp.sum(w.astype(jnp.float32) * x, axis=0) for acc, w in zip(accs, tiles)), loading
        if of_words:
            xs = [halves(run) for run in x]
            out = []
            for acc, (words, scales) in zip(accs, tiles):
                factors = per_byte(word_factors(scale_bytes(scales, k0, bk), small), units=4)
                words = lax.bitcast_convert_type(words, jnp.int32)
                for j, (even, odd) in enumerate(xs):  # a multiply-add a weight into [columns, n] sums
                    pairs = word_values(words, factors, j, small)
                    acc = acc + lax.bitcast_convert_type(pairs << 16, jnp.float32) * even
                    acc = acc + lax.bitcast_convert_type(pairs & jnp.int32(-65536), jnp.float32) * odd
                out.append(acc)
            return tuple(out), loading
        even, odd = halves(x)
        out = []
        for acc, (codes, scales) in zip(accs, tiles):
            codes, power = codes.astype(jnp.int32), per_byte(scale_power(scale_bytes(scales, k0, bk)))
            low, high = code_values(codes, high=False), code_values(codes, high=True)
            out.append(acc + jnp.sum((low * even + high * odd) * power, axis=1))
        return tuple(out), loading

    # words: sums kept a word apart, added up once at the end
    zeros = tuple(jnp.zeros((cols.size, bk // 8) if of_words else (cols.size,), jnp.float32) for cols in column_blocks)
    sums, _ = lax.fori_loop(0, steps, step, (zeros, tuple(fetch(i) for i in range(ahead))))
    return tuple(s.sum(axis=1) for s in sums) if of_words else sums


def _split_chunk(K: int, splits: int):
    """Inside a kernel, at its top level (interpret mode reads program ids there only): (split, first,
    size) of this program's chunk of K, the grid's third axis (one chunk when splits is 1)."""
    split = pl.program_id(2)
    return split, split * (K // splits) if splits > 1 else 0, K // splits


def _gate_up_sums(x_ref, tokens_ref, w_refs, layer, e, columns, start, real, K: int, bk: int, first, bm: int,
                  small: bool = False, bias_ref=None):
    """Inside a kernel: float32 (gate, up) [bm, columns] of the row block at `start` (real [bm]: its rows
    inside the slot's range), x's rows gathered by token, over K weights from `first` (`_over_rows`), plus
    expert e's bias at `layer` from `bias_ref` if one is given."""
    tokens = plgpu.load(tokens_ref.at[pl.ds(start, bm)], mask=real, other=0)
    load_x = lambda cols: x_ref[tokens, cols]  # rows past the range read token 0, are not stored
    gate, up = columns

    def step(acc, k0, size):
        return (_product(acc[0], load_x, w_refs, layer, e, k0, size, gate, small),
                _product(acc[1], load_x, w_refs, layer, e, k0, size, up, small))

    g, u = _over_rows(step, K, bk, first, bm, gate.size, w_refs, x_ref.dtype, 2)
    if bias_ref is None:
        return g, u
    bias = lambda cols: bias_ref[layer, e, cols].astype(jnp.float32)[None, :]
    return g + bias(gate), u + bias(up)


def _gate_up_kernel(layer_ref, slots_ref, tokens_ref, x_ref, *refs, bm: int, bk: int, bf: int, activation: str,
                    packed: bool, biased: bool, one_row: bool, splits: int, small: bool):
    """a_ref [rows, F]: the activations; with splits > 1 instead float32 partial gate/up columns
    [splits, rows, 2F], neither biased nor activated (`moe_experts_pallas` adds them up). `small`:
    words of scales between 1 and 128."""
    w_refs, (*b_ref, a_ref) = refs[:1 + packed], refs[1 + packed:]
    j = pl.program_id(1)
    e, layer = _slot(slots_ref)[0], layer_ref[0]
    F = a_ref.shape[-1] // 2 if splits > 1 else a_ref.shape[-1]
    gate, up = pl.ds(j * bf, bf), pl.ds(F + j * bf, bf)
    split, first, K = _split_chunk(_width(x_ref), splits)
    bias = lambda cols: b_ref[0][layer, e, cols].astype(jnp.float32)

    def row(r, _):
        g, u = _row_products(x_ref, tokens_ref[r], w_refs, layer, e, (gate, up), bk, small)
        if biased:
            g, u = g + bias(gate), u + bias(up)
        a_ref[r, pl.ds(j * bf, bf)] = activate(g, u, activation).astype(a_ref.dtype)

    def rows(start, real):
        g, u = _gate_up_sums(x_ref, tokens_ref, w_refs, layer, e, (gate, up), start, real, K, bk, first, bm, small,
                             b_ref[0] if biased else None)  # split K: never biased here (`moe_experts_pallas`)
        if splits > 1:
            for cols, h in ((gate, g), (up, u)):
                plgpu.store(a_ref.at[split, pl.ds(start, bm), cols], h, mask=real[:, None])
            return
        a = activate(g, u, activation)
        plgpu.store(a_ref.at[pl.ds(start, bm), pl.ds(j * bf, bf)], a.astype(a_ref.dtype), mask=real[:, None])

    _slot_rows(slots_ref, bm, row if one_row else rows)


def _down_kernel(layer_ref, slots_ref, a_ref, *refs, bm: int, bk: int, bd: int, packed: bool, biased: bool,
                 one_row: bool, splits: int, small: bool):
    """y_ref [rows, D] float32: the experts' outputs; with splits > 1 partial sums [splits, rows, D],
    not biased. `small`: words of scales between 1 and 128."""
    w_refs, (*b_ref, y_ref) = refs[:1 + packed], refs[1 + packed:]
    cols = pl.ds(pl.program_id(1) * bd, bd)
    e, layer = _slot(slots_ref)[0], layer_ref[0]
    bias = lambda: b_ref[0][layer, e, cols].astype(jnp.float32)
    split, first, K = _split_chunk(_width(a_ref), splits)

    def row(r, _):
        (y,) = _row_products(a_ref, r, w_refs, layer, e, (cols,), bk, small)
        y_ref[r, cols] = y + bias() if biased else y

    def rows(start, real):
        load_a = lambda k: plgpu.load(a_ref.at[pl.ds(start, bm), k], mask=real[:, None], other=0.0)
        step = lambda acc, k0, size: (_product(acc[0], load_a, w_refs, layer, e, k0, size, cols, small),)
        (y,) = _over_rows(step, K, bk, first, bm, bd, w_refs, a_ref.dtype, 1)
        if splits > 1:
            plgpu.store(y_ref.at[split, pl.ds(start, bm), cols], y, mask=real[:, None])
            return
        if biased:
            y = y + bias()[None, :]
        plgpu.store(y_ref.at[pl.ds(start, bm), cols], y, mask=real[:, None])

    _slot_rows(slots_ref, bm, row if one_row else rows)


def _fused_kernel(layer_ref, slots_ref, tokens_ref, x_ref, wg_ref, wd_ref, *refs, bm: int, bk: int, bf: int, bd: int,
                  activation: str, biased: bool):
    """y_ref [F / bf, rows, D] float32: program (slot, j)'s share of its rows' outputs, from its expert's F
    columns [j bf, (j + 1) bf): gate and up over all of K, biased and activated, then times down's
    same rows, bd columns a step (down's bias is left to `moe_experts_pallas`)."""
    *b_ref, y_ref = refs
    j = pl.program_id(1)
    e, layer = _slot(slots_ref)[0], layer_ref[0]
    F, D = wd_ref.shape[-2:]
    gate, up = pl.ds(j * bf, bf), pl.ds(F + j * bf, bf)  # gate: also the rows of down this program takes

    def rows(start, real):
        g, u = _gate_up_sums(x_ref, tokens_ref, (wg_ref,), layer, e, (gate, up), start, real, D, bk, 0, bm,
                             bias_ref=b_ref[0] if biased else None)
        a = activate(g, u, activation).astype(x_ref.dtype)

        def down(c, carry):
            cols = pl.ds(c * bd, bd)
            y = jnp.dot(a, wd_ref[layer, e, gate, cols].astype(a.dtype), preferred_element_type=jnp.float32)
            plgpu.store(y_ref.at[j, pl.ds(start, bm), cols], y, mask=real[:, None])
            return carry

        lax.fori_loop(0, D // bd, down, 0)

    _slot_rows(slots_ref, bm, rows)


def _slots(sizes, num_slots: int):
    """int32 [3, num_slots]: each distinct expert hit (ascending) with its [start, end) in the sorted
    assignments; slots past the distinct experts have start = end = 0."""
    hit = sizes > 0
    slot = jnp.where(hit, jnp.cumsum(hit) - 1, num_slots)  # each expert's slot; unhit: dropped
    expert = jnp.zeros(num_slots, jnp.int32).at[slot].set(jnp.arange(sizes.size, dtype=jnp.int32), mode="drop")
    ends = jnp.cumsum(sizes)
    valid = jnp.arange(num_slots) < hit.sum()
    start = jnp.where(valid, (ends - sizes)[expert], 0)
    return jnp.stack([expert, start, jnp.where(valid, ends[expert], 0)]).astype(jnp.int32)


def _slot_call(kernel, name: str, grid, out_shape, args, w, bias, *, params, interpret: bool):
    """One of the two calls: refs in, one ref out; the weights (an MXFP4 stack: its blocks and
    scales) after `args`, the optional bias last."""
    args = [*args, *(jax.tree.leaves(w))] + ([] if bias is None else [bias])
    return pl.pallas_call(kernel, grid=grid, in_specs=[pl.no_block_spec] * len(args), out_specs=pl.no_block_spec,
                          out_shape=out_shape, compiler_params=params, interpret=interpret, name=name)(*args)


def moe_experts_pallas(x, expert_ids, expert_weights, w_gate_up, w_down, layer, *, b_gate_up=None,
                       b_down=None, activation: str = "silu", interpret: bool = False, num_warps: int = 4,
                       num_stages: int = 3, form: str | None = None):
    """The kernels' routed experts (the reference's result, summed in another order), float32 [T, D];
    the stacks (float or MXFP4) read in place at `layer` (an int32 scalar). Shapes: `supported`.
    `form`: one of FORMS (None: `default_form`; bench/moe.py times each); `num_warps`: every form's but
    the fused one's (FUSED_WARPS)."""
    T, k = expert_ids.shape
    E, D = w_gate_up.shape[1], x.shape[1]
    F = w_down.shape[-2]
    N, S = T * k, min(E, T * k)
    if T == 1:  # a decode step: its k experts are distinct, each its own slot (no routing kernels, `_slot`),
        # in an order known when tracing: NumPy constants, which the program embeds (jnp's iota and pad ran a kernel)
        order = position = np.arange(k, dtype=np.int32)
        slots = expert_ids.astype(jnp.int32)
    else:
        order, position, sizes = _route(expert_ids, E)
        slots = _slots(sizes, S)
    gate_up_packed, down_packed = isinstance(w_gate_up, MXFP4), isinstance(w_down, MXFP4)
    gate_up_words, down_words = (isinstance(w, MXFP4) and w.words for w in (w_gate_up, w_down))
    small = lambda w: isinstance(w, MXFP4) and w.words and w.small_scales  # one multiply an output
    words = gate_up_words or down_words
    form = default_form(T, gate_up_packed and down_packed, D) if form is None else form
    if form not in FORMS:
        raise ValueError(f"unknown MoE kernel form {form!r}: expected one of {FORMS}")
    if words and form == "split_k":
        raise ValueError("MXFP4 words are read by the row-block and one-row forms, not 'split_k'")
    if form == "fused" and (gate_up_packed or down_packed):
        raise ValueError("the 'fused' MoE kernel form reads float stacks, not MXFP4")
    one_row = form == "one_row"
    rows_of = lambda v, words: group_view(v) if one_row and words else v  # the one-row form's x through words
    bm = 1 if one_row else block_rows(N, S)
    tokens = (np if T == 1 else jnp).pad(order // k, (0, bm))  # a last row block may run past N: rows of token 0
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    call = functools.partial(_slot_call, interpret=interpret)

    def chunk_sums(partial, b):
        """Split K: the chunks' partial sums [splits, rows, columns] added up, and biased (also the fused
        form's shares of F)."""
        total = partial[:, :N].sum(axis=0)
        return total if b is None else total + b[layer[0], _row_experts(expert_ids, order)].astype(jnp.float32)

    if form == "fused":
        bf, bd = divisor(F, FUSED_COLUMNS), divisor(D, FUSED_DOWN_COLUMNS)
        bk = divisor(D, max(BLOCK_K, FUSED_STEP_ELEMENTS // bf))  # no tail steps: their registers spilled
        y = call(functools.partial(_fused_kernel, bm=bm, bk=bk, bf=bf, bd=bd,
                                   activation=activation, biased=b_gate_up is not None),
                 "moe_fused", (S, F // bf), jax.ShapeDtypeStruct((F // bf, N + bm, D), jnp.float32),
                 [layer, slots, tokens, x], (w_gate_up, w_down), b_gate_up,
                 params=plgpu.CompilerParams(num_warps=FUSED_WARPS, num_stages=num_stages))
        return _combine(chunk_sums(y, b_down), position, expert_ids, expert_weights)

    word_blocks = lambda words: words and not one_row  # row blocks of words: their own column and warp rules
    params = lambda columns, words: plgpu.CompilerParams(
        num_warps=NARROW_WORD_WARPS if word_blocks(words) and columns < WGMMA_COLUMNS else num_warps,
        num_stages=num_stages)
    if form == "split_k":
        bf, bd = divisor(F, SPLIT_GATE_UP_COLUMNS), divisor(D, SPLIT_DOWN_COLUMNS)
        gate_up_splits = k_splits(D, S * (F // bf), gate_up_packed)
        down_splits = k_splits(F, S * (D // bd), down_packed)
    else:
        narrowest = lambda words: WORD_MIN_COLUMNS if word_blocks(words) else MIN_TILE
        targets = (ONE_ROW_PROGRAMS, ONE_ROW_DOWN_PROGRAMS) if one_row else (TARGET_PROGRAMS, TARGET_PROGRAMS)
        bf = column_block(F, GATE_UP_COLUMNS, S, narrowest(gate_up_words), targets[0])
        bd = column_block(D, DOWN_COLUMNS, S, narrowest(down_words), targets[1])
        gate_up_splits = down_splits = 1
    out_shape = lambda splits, columns, dtype: jax.ShapeDtypeStruct(
        (N + bm, columns) if splits == 1 else (splits, N + bm, columns), dtype if splits == 1 else jnp.float32)
    in_kernel = lambda b, splits: b if splits == 1 else None  # split K: the kernels leave the bias out
    gate_up_bias, down_bias = in_kernel(b_gate_up, gate_up_splits), in_kernel(b_down, down_splits)
    if one_row:
        gate_up_step, down_step = row_step(D, bf, ROW_STEP_ELEMENTS), row_step(F, bd, ONE_ROW_DOWN_STEP_ELEMENTS)
    else:
        gate_up_step = step_rows(D // gate_up_splits, bf, gate_up_packed, gate_up_words)
        down_step = step_rows(F // down_splits, bd, down_packed, down_words)
    a = call(functools.partial(_gate_up_kernel, bm=bm, bk=gate_up_step, bf=bf, activation=activation,
                               packed=gate_up_packed, biased=gate_up_bias is not None, one_row=one_row,
                               splits=gate_up_splits, small=small(w_gate_up)),
             "moe_gate_up", (S, F // bf, gate_up_splits),
             out_shape(gate_up_splits, 2 * F if gate_up_splits > 1 else F, x.dtype),
             [layer, slots, tokens, rows_of(x, gate_up_words)], w_gate_up, gate_up_bias,
             params=params(bf, gate_up_words))
    if gate_up_splits > 1:
        h = chunk_sums(a, b_gate_up)
        a = jnp.pad(activate(h[:, :F], h[:, F:], activation).astype(x.dtype), ((0, bm), (0, 0)))
    y = call(functools.partial(_down_kernel, bm=bm, bk=down_step, bd=bd,
                               packed=down_packed, biased=down_bias is not None, one_row=one_row, splits=down_splits,
                               small=small(w_down)),
             "moe_down", (S, D // bd, down_splits), out_shape(down_splits, D, jnp.float32),
             [layer, slots, rows_of(a, down_words)], w_down, down_bias, params=params(bd, down_words))
    if down_splits > 1:
        y = chunk_sums(y, b_down)
    return _combine(y, position, expert_ids, expert_weights)
