"""The top-p (nucleus) threshold of each row of logits, without sorting the vocabulary.

Definition (jaxspec's sampling uses it on every backend, for plain decoding, drafts and targets
alike): with x a row of tempered logits, m its max and e = exp(x - m), the threshold is the smallest
row value t whose mass strictly above, M(t) = sum(e[x > t]), is < top_p * sum(e). Walking the tokens
from the most likely and keeping each while the mass before it is < top_p keeps exactly x >= t (ties
at t included), so this is the usual nucleus, found without a sort.

Search: x maps to order-preserving int32 keys; M only steps at row values, so the smallest key k
with M(val(k)) < top_p * Z is a row value's key. The reference keeps a bracket (lo, hi], with the
test false at lo and true at hi, from (key(min x) - 1, key(m)]; each pass tests three pivots that
quarter it, so at most 16 passes over the row settle 32-bit keys. Masked sums of non-negative terms in
one fixed order are monotone in the mask, so the test is monotone in floating point too.

Two Pallas paths, chosen by the row count (top_p_threshold_pallas: the split path for few rows, one
program per row for many; bench/NOTES.md, "top-p at small batch"):

- One program per row (top_p_threshold_per_row) loops over the row once per pass, so the row stays
  in L1/L2 after the first read (96-192 KB at a 49K vocabulary). Pass 1 finds m; pass 2 sums Z and
  the masses above m - CUTS, which bracket the threshold in values (no lower than the bound m +
  log((1 - top_p) / V) - 1, below which all values hold less than (1 - top_p) / e <= (1 - top_p) Z);
  pass 3 writes the values inside the bracket to a scratch row. While they number at most PAIRWISE
  (a real model's rows at T 0.7 put tens there) each held value's mass comes from one comparison of
  every pair: the mass above hi, from pass 2, plus that of the held values above it; the threshold
  is the smallest held value whose mass is < top_p * Z. Up to CAPACITY the search runs over them in
  registers (SPREAD pivots a pass); a flat row puts more, and the search runs over the row instead,
  three pivots a pass from the same bracket (bench/NOTES.md, "top-p over the values near the
  threshold", "top-p's last step pairwise").
- The split path (top_p_threshold_split) spreads each row over many programs (SPLIT_PER chunks of
  SPLIT_CHUNK logits each) and settles DIGIT_BITS bits of the key a launch, a radix search: the
  bracket is (hi - 2^level, hi], at first (key(+inf) - 2^32, key(+inf)], and a pass sums in every
  program the mass above the 15 pivots that cut it into 16: 8 passes and a final settle, a fixed 9
  launches and no while_loop. A program sums its chunks relative to its own max (the first pass
  finds it). The next launch, in every program of the row alike (no launch of its own), scales each
  program's sums by exp(its max - m), adds them in one fixed order (Z from the unmasked sums) and
  takes the smallest pivot whose mass is < top_p * Z as the new hi (the pivot below it, or lo, has
  mass >= top_p * Z). Masked sums in one fixed order, times non-negative factors, summed in one fixed
  order: the masses are monotone in the key and step only at row values here too.

The reference sums in another order than the kernels (the split path also with per-program maxima):
they agree except where some M(t) lies within rounding of top_p * Z.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import float_key, key_float, next_pow2

# Logits per vector step of a pass, on 32 warps: with fewer, a pass waits on one chunk's load at a
# time (bench/NOTES.md, "sort-free top-p").
CHUNK = 8192
NUM_WARPS = 32
# The per-row path measures the mass above these distances below the row's max (tempered logits) in
# its second pass; the bracket they leave is searched over its values alone when it holds at most
# CAPACITY of them. The cuts fit a real model's rows: SmolLM2's 0.95 nucleus at T 0.7 ends a few units
# below the max, with tens of values within 8 of it (bench/NOTES.md, "top-p over the values near the
# threshold").
CUTS = (4.0, 8.0, 16.0)
CAPACITY = 1024
SPREAD = 16  # pivots a pass of the search over held values (a power of two)
# At most this many held values take the pairwise step ([PAIRWISE, PAIRWISE] comparisons), which
# replaces the search's 8 block-wide passes, half the kernel's time on real rows (bench/NOTES.md,
# "top-p's last step pairwise").
PAIRWISE = 128


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


def _spread(lo, hi):
    """SPREAD ascending keys in [lo + 1, hi - 1] about evenly spaced over (lo, hi) (computed without
    overflow: the step is (hi - lo) / SPREAD to within one; the last ones clip to hi - 1)."""
    shift = SPREAD.bit_length() - 1
    step = jnp.maximum((hi >> shift) - (lo >> shift), 1)
    return jnp.minimum(lo + jnp.arange(1, SPREAD + 1, dtype=jnp.int32) * step, hi - 1)


def _kernel(logits_ref, inv_temperature_ref, top_p_ref, out_ref, held_ref, *, chunk, capacity, pairwise, barrier):
    row = pl.program_id(0)
    inv_temperature, top_p = inv_temperature_ref[row], top_p_ref[row]
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

    (big,) = row_pass(lambda acc, x, ok: (jnp.where(ok, jnp.maximum(acc[0], x), acc[0]),), (-jnp.inf,))
    top = jnp.max(big)
    weight = lambda x, ok: jnp.where(ok, jnp.exp(x - top), 0.0)
    cuts = [top - d for d in CUTS]

    def cut_step(acc, x, ok):
        e = weight(x, ok)
        return (acc[0] + e,) + tuple(a + jnp.where(x > v, e, 0.0) for a, v in zip(acc[1:], cuts))

    total, *above = [jnp.sum(a) for a in row_pass(cut_step, (0.0,) * (1 + len(CUTS)))]
    target = top_p * total
    # The bracket in values: the test is false at lo (mass above >= target) and true at hi. Values at
    # or below the bound hold less than (1 - top_p) / e of Z >= 1 in all, so the bound is false.
    lo, hi, mass_hi = top + jnp.log((1 - top_p) / V) - 1, top, jnp.float32(0.0)
    for v, mass in zip(cuts, above):  # descending values, so ascending masses
        true = mass < target
        lo = jnp.where(true, lo, jnp.maximum(lo, v))
        hi, mass_hi = jnp.where(true, v, hi), jnp.where(true, mass, mass_hi)
    lo = jnp.where(lo < hi, lo, -jnp.inf)  # rounding's guard: a bracket must not be empty

    def hold(c, count):
        """Writes the chunk's values in (lo, hi] after the `count` held so far, while they fit."""
        x, ok = load(c)
        inside = ok & (x > lo) & (x <= hi)
        n = jnp.sum(inside.astype(jnp.int32))

        @pl.when(count + n <= capacity)  # else the search runs over the row: the scan is skipped
        def _():
            at = count + jnp.cumsum(inside.astype(jnp.int32)) - 1
            # lanes outside write nowhere on the GPU; in interpret mode a masked store still writes
            # back, so they aim at a spare slot past the capacity
            plgpu.store(held_ref.at[row, jnp.where(inside, at, capacity)], x, mask=inside)

        return count + n

    count = lax.fori_loop(0, n_chunks, hold, jnp.int32(0))
    if barrier:  # the held values, written by all the program's threads, are read back by others
        plgpu.debug_barrier()

    def load_held(n):
        """The first n held slots (-inf past `count`) and their weights exp(x - top)."""
        x = plgpu.load(held_ref.at[row, pl.ds(0, n)], mask=jnp.arange(n) < count, other=-jnp.inf)
        return x, jnp.exp(x - top)

    def mass_above(x, e, values):
        """The mass above each of `values` [k]: mass_hi plus that of the held values x (weights e)."""
        return mass_hi + jnp.sum(jnp.where(x[None, :] > values[:, None], e[None, :], 0.0), axis=1)

    def each_pair(bracket):
        """Every held value's mass at once; the smallest whose mass is < target (the bracket holds
        the threshold, since masses step only at row values); padding is never chosen."""
        x, e = load_held(pairwise)
        chosen = (jnp.arange(pairwise) < count) & (mass_above(x, e, x) < target)
        return bracket[0], float_key(jnp.min(jnp.where(chosen, x, jnp.inf)))

    def in_registers(bracket):
        """The search over the held values, SPREAD pivots a pass."""
        x, e = load_held(capacity)

        def narrow(bracket):
            lo, hi = bracket
            pivots = _spread(lo, hi)
            masses = mass_above(x, e, key_float(pivots))
            false = masses >= target
            return jnp.max(jnp.where(false, pivots, lo)), jnp.min(jnp.where(false, hi, pivots))

        return lax.while_loop(lambda b: b[1] > b[0] + 1, narrow, bracket)

    def over_row(bracket):
        """The search over the whole row, three pivots a pass, when the bracket holds too many values."""

        def search(bracket):
            lo, hi = bracket
            pivots = _pivots(lo, hi)
            values = [key_float(k) for k in pivots]

            def step(acc, x, ok):
                e = weight(x, ok)
                return tuple(a + jnp.where(x > v, e, 0.0) for a, v in zip(acc, values))

            masses = [jnp.sum(a) for a in row_pass(step, (0.0, 0.0, 0.0))]
            return _narrow(lo, hi, pivots, masses, target)

        return lax.while_loop(lambda b: b[1] > b[0] + 1, search, bracket)

    search = lambda bracket: lax.cond(count <= capacity, in_registers, over_row, bracket)
    if pairwise:
        search = functools.partial(lax.cond, count <= pairwise, each_pair, search)
    _, hi_key = search((float_key(lo), float_key(hi)))
    out_ref[row] = key_float(hi_key)


# The split path: a program sums SPLIT_PER chunks of SPLIT_CHUNK logits on SPLIT_CHUNK / 256 warps
# (all its loads issued before it waits for the bracket). Four chunks a program was best or within the
# runs' spread at every row count measured (bench/NOTES.md, "top-p at small batch").
SPLIT_CHUNK = 1024
SPLIT_PER = 4
DIGIT_BITS = 4  # bits of the key settled per pass (divides 32)
SLOTS = 1 << DIGIT_BITS  # slot 0: a chunk's total; slot i >= 1: its mass above pivot i (ascending)
KEY_INF = 0x7F800000  # float_key(+inf): no row value is above it
# At most this many rows take the split path, more one program per row. The split path's time grows
# with the rows, the per-row path's does not until the rows outnumber the SMs; 48 keeps flat rows on
# their faster path, a real model's rows would gain from ~24 (bench/NOTES.md, "top-p over the values
# near the threshold").
SPLIT_MAX_ROWS = 48


def _slot_pivots(hi, level):
    """[SLOTS] int32: the bracket (hi - 2^level, hi]'s lower end, then the SLOTS - 1 keys that cut it
    into SLOTS equal parts, ascending (level a multiple of DIGIT_BITS in [DIGIT_BITS, 32]; keys wrap
    modulo 2^32 on the way, the results are in range)."""
    step = jnp.left_shift(jnp.int32(1), level - DIGIT_BITS)
    return hi - (SLOTS - jnp.arange(SLOTS, dtype=jnp.int32)) * step


def _settle(hi, level, top_p, local_max, partials):
    """The bracket's top after the pass at `level`, from its programs' partial sums (local_max [W],
    partials [SLOTS, W], W >= the row's programs, the padding max -inf and sums 0): the smallest
    pivot whose mass is < top_p * Z, else hi. A program's sums are relative to its own max; each is
    scaled by exp(its max - the row's max), and every slot sums them in the same order."""
    scale = jnp.exp(local_max - jnp.max(local_max))
    masses = jnp.sum(partials * scale[None, :], axis=1)
    slot = jnp.arange(SLOTS)
    target = top_p * jnp.sum(jnp.where(slot == 0, masses, 0.0))
    return jnp.min(jnp.where((slot > 0) & (masses < target), _slot_pivots(hi, level), hi))


def _load_partials(max_ref, partials_ref, row, splits: int):
    """A row's local maxima [W] and partial sums [SLOTS, W] (W: splits padded to a power of two)."""
    width = max(16, next_pow2(splits))
    ok = jnp.arange(width) < splits
    local_max = plgpu.load(max_ref.at[row, pl.ds(0, width)], mask=ok, other=-jnp.inf)
    partials = plgpu.load(partials_ref.at[row, pl.ds(0, SLOTS), pl.ds(0, width)], mask=ok[None, :], other=0.0)
    return local_max, partials


def _split_kernel(*refs, chunk: int, per: int, splits: int, first: bool):
    """One program: chunks [split * per, (split + 1) * per) of a row (lanes past V masked). The
    first pass finds the chunks' max and tests the whole key range; a later pass first settles the
    previous pass's bracket (every program of the row alike; program 0 writes it). Then each slot's
    sum over the chunks."""
    if first:
        logits_ref, inv_temperature_ref, max_out, partials_out = refs
    else:
        (logits_ref, inv_temperature_ref, top_p_ref, hi_ref, level_ref, max_ref, partials_ref,
         hi_out, partials_out) = refs
    row, split = pl.program_id(0), pl.program_id(1)
    inv_temperature = inv_temperature_ref[row]
    V = logits_ref.shape[1]

    def load(i):
        start = (split * per + i) * chunk
        cols = start + jnp.arange(chunk)
        x = plgpu.load(logits_ref.at[row, pl.ds(start, chunk)], mask=cols < V, other=-jnp.inf)
        return x.astype(jnp.float32) * inv_temperature

    xs = [load(i) for i in range(per)]  # first: the loads do not wait for the bracket
    if first:
        hi, level = jnp.int32(KEY_INF), jnp.int32(32)
        local_max = jnp.max(functools.reduce(jnp.maximum, xs))
        max_out[row, split] = local_max
    else:
        level = level_ref[0]
        local_max = max_ref[row, split]
        partials = _load_partials(max_ref, partials_ref, row, splits)
        hi = _settle(hi_ref[row], level + DIGIT_BITS, top_p_ref[row], *partials)

        @pl.when(split == 0)
        def _():
            hi_out[row] = hi

    safe_max = jnp.where(local_max == -jnp.inf, 0.0, local_max)  # chunks of -inf only: e = 0
    # slot 0 counts every value above -inf (the -inf values add e = 0 anyway): the total
    values = jnp.where(jnp.arange(SLOTS) == 0, -jnp.inf, key_float(_slot_pivots(hi, level)))[:, None]
    acc = jnp.zeros((SLOTS, chunk), jnp.float32)
    for x in xs:
        acc += jnp.where(x[None, :] > values, jnp.exp(x - safe_max)[None, :], 0.0)
    plgpu.store(partials_out.at[row, pl.ds(0, SLOTS), split], jnp.sum(acc, axis=1))


def _final_kernel(top_p_ref, hi_ref, max_ref, partials_ref, out_ref, *, splits: int):
    row = pl.program_id(0)
    partials = _load_partials(max_ref, partials_ref, row, splits)
    hi = _settle(hi_ref[row], jnp.int32(DIGIT_BITS), top_p_ref[row], *partials)
    out_ref[row] = key_float(hi)


def top_p_threshold_split(logits, inv_temperature, top_p, *, interpret: bool = False, chunk: int = SPLIT_CHUNK,
                          per: int = SPLIT_PER):
    """The split path (same contract as top_p_threshold_reference): each row over cdiv(V, chunk *
    per) programs; 32 / DIGIT_BITS passes of SLOTS - 1 pivots and a final settle, one launch each."""
    R, V = logits.shape
    chunk = min(chunk, next_pow2(V))
    per = min(per, pl.cdiv(V, chunk))
    splits = pl.cdiv(V, chunk * per)
    inv_temperature, top_p = _per_row(inv_temperature, R), _per_row(top_p, R)
    params = plgpu.CompilerParams(num_warps=max(1, chunk // 256), num_stages=1)

    def call(kernel, grid, out_shape, *args):
        return pl.pallas_call(kernel, grid=grid, in_specs=[pl.no_block_spec] * len(args),
                              out_specs=jax.tree.map(lambda _: pl.no_block_spec, out_shape), out_shape=out_shape,
                              compiler_params=params, interpret=interpret, name="top_p_threshold_split")(*args)

    kernel = functools.partial(_split_kernel, chunk=chunk, per=per, splits=splits)
    partials = jax.ShapeDtypeStruct((R, SLOTS, splits), jnp.float32)
    local_max, sums = call(functools.partial(kernel, first=True), (R, splits),
                           (jax.ShapeDtypeStruct((R, splits), jnp.float32), partials), logits, inv_temperature)
    hi = jnp.full((R,), KEY_INF, jnp.int32)  # the top of the first pass's bracket
    for level in range(32 - DIGIT_BITS, 0, -DIGIT_BITS):
        hi, sums = call(functools.partial(kernel, first=False), (R, splits),
                        (jax.ShapeDtypeStruct((R,), jnp.int32), partials),
                        logits, inv_temperature, top_p, hi, jnp.full((1,), level, jnp.int32), local_max, sums)
    return call(functools.partial(_final_kernel, splits=splits), (R,), jax.ShapeDtypeStruct((R,), jnp.float32),
                top_p, hi, local_max, sums)


def top_p_threshold_per_row(logits, inv_temperature, top_p, *, interpret: bool = False, chunk: int = CHUNK,
                            capacity: int = CAPACITY, pairwise: int = PAIRWISE):
    """The one-program-per-row path (same contract as top_p_threshold_reference); `pairwise` (a power
    of two >= 16, at most `capacity`; 0: no pairwise step) and `capacity` are the held values' limits
    of its two steps."""
    if pairwise > capacity:
        raise ValueError(f"pairwise {pairwise} must not exceed capacity {capacity}")
    R, V = logits.shape
    threshold, _ = pl.pallas_call(
        functools.partial(_kernel, chunk=min(chunk, next_pow2(V)), capacity=capacity, pairwise=pairwise,
                          barrier=not interpret),
        grid=(R,),
        in_specs=[pl.no_block_spec] * 3,
        out_specs=[pl.no_block_spec] * 2,
        out_shape=[jax.ShapeDtypeStruct((R,), jnp.float32), jax.ShapeDtypeStruct((R, capacity + 1), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="top_p_threshold",
    )(logits, _per_row(inv_temperature, R), _per_row(top_p, R))
    return threshold


def top_p_threshold_pallas(logits, inv_temperature, top_p, *, interpret: bool = False):
    """The Pallas kernel of top_p_threshold_reference (same contract): the split path for at most
    SPLIT_MAX_ROWS rows, else one program per row."""
    path = top_p_threshold_split if logits.shape[0] <= SPLIT_MAX_ROWS else top_p_threshold_per_row
    return path(logits, inv_temperature, top_p, interpret=interpret)
