"""moe_experts (pallas_kernels/moe.py): the routed-experts kernel in interpret mode and its ragged_dot
reference against a float64 loop over each token's experts, at layer 1 of 3-layer stacks, fresh random
inputs (gate/up products large enough that gpt-oss's clamps bite). The kernel also gets poisoned stacks:
NaN in every other layer and in every expert no token routes to, which it must never read. Interpret
mode fills unwritten kernel outputs with NaN, so a row the kernel forgot shows too. Both again with
MXFP4 stacks (random codes and scales, F = 64: whole scale groups), against the loop over their
dequantized weights; poisoned there by scale 255 (inf after decoding)."""
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.extend.core import jaxprs_in_params

import pallas_kernels
from pallas_kernels import moe, mxfp4
from pallas_kernels.moe import moe_experts_pallas
from pallas_kernels.mxfp4 import MXFP4, dequantize

L, LAYER, E, K, D, F = 3, 1, 8, 2, 96, 48  # D: a 64-row loop step and a 32-row tail step; F: three 16-column blocks


def make_inputs(seed: int, T: int, dtype, biased: bool, experts=range(E)):
    """(x, expert_ids, expert_weights, w_gate_up, w_down, b_gate_up, b_down): rows routed to K
    distinct experts among `experts`, router weights normalised, stacks and x in `dtype`."""
    keys = jax.random.split(jax.random.key(seed), 7)
    experts = np.asarray(experts)
    choice = jnp.argsort(jax.random.uniform(keys[0], (T, len(experts))), axis=1)[:, :K]
    ids = jnp.asarray(experts)[choice].astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(keys[1], (T, K)), axis=1)
    x = jax.random.normal(keys[2], (T, D), dtype)
    w_gate_up = (4 / D ** 0.5 * jax.random.normal(keys[3], (L, E, D, 2 * F))).astype(dtype)
    w_down = (F ** -0.5 * jax.random.normal(keys[4], (L, E, F, D))).astype(dtype)
    b_gate_up = jax.random.normal(keys[5], (L, E, 2 * F), dtype) if biased else None
    b_down = jax.random.normal(keys[6], (L, E, D), dtype) if biased else None
    return x, ids, weights, w_gate_up, w_down, b_gate_up, b_down


def loop_float64(x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, activation: str):
    """The definition, token by token in float64 (the activations rounded to x's dtype, as both
    implementations feed them to the down product)."""
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    bf16 = x.dtype == jnp.bfloat16
    F = w_down.shape[-2]
    x, weights, w_gate_up, w_down = f64(x), f64(weights), f64(w_gate_up[LAYER]), f64(w_down[LAYER])
    out = np.zeros(x.shape)
    for t, j in np.ndindex(*ids.shape):
        e = int(ids[t, j])
        h = x[t] @ w_gate_up[e] + (0 if b_gate_up is None else f64(b_gate_up[LAYER, e]))
        g, u = h[:F], h[F:]
        if activation == "silu":
            a = g / (1 + np.exp(-g)) * u
        else:
            g, u = np.minimum(g, 7.0), np.clip(u, -7.0, 7.0)
            a = (u + 1) * g / (1 + np.exp(-1.702 * g))
        if bf16:
            a = a.astype(ml_dtypes.bfloat16).astype(np.float64)
        y = a @ w_down[e] + (0 if b_down is None else f64(b_down[LAYER, e]))
        out[t] += weights[t, j] * y
    return out


# The reference, the kernel's four forms (fused: float stacks only), and its row blocks through mxfp4_dot
# (moe.SCALED_DOT: here its interpret-mode form, so this checks what the kernel hands it, not Triton's
# conversion) and through paired_weights (moe.PAIRED_DECODE: likewise its exact form; the products transposed).
# MXFP4 stacks also as words (mxfp4.to_words: row blocks through word_weights, its exact form here, and the
# one-row form through moe.group_view's columns), and as words of small scales (MXFP4.small_scales: one
# multiply), and with their scales four to a word (mxfp4.pack_scales).
IMPLEMENTATIONS = ("reference", "row_blocks", "one_row", "split_k", "fused", "scaled dot", "paired decode")
WORD_IMPLEMENTATIONS = ("word decode", "word one row", "small word decode", "small word one row",
                        "scale-word decode", "scale-word one row")
PACKED_IMPLEMENTATIONS = (*(i for i in IMPLEMENTATIONS if i != "fused"), *WORD_IMPLEMENTATIONS)  # fused: floats


def run(implementation: str, inputs, activation: str):
    x, ids, weights, w_gate_up, w_down, b_gate_up, b_down = inputs
    if implementation in WORD_IMPLEMENTATIONS:
        small, scale_words = implementation.startswith("small"), implementation.startswith("scale-word")
        w_gate_up, w_down = (mxfp4.to_words(w, small, scale_words) for w in (w_gate_up, w_down))
    args = (x, ids, weights, w_gate_up, w_down, jnp.int32(LAYER))
    options = dict(b_gate_up=b_gate_up, b_down=b_down, activation=activation)
    if implementation == "reference":
        return np.asarray(pallas_kernels.moe_experts(*args, **options, backend="reference"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe, "SCALED_DOT", implementation == "scaled dot")
        patch.setattr(moe, "PAIRED_DECODE", implementation == "paired decode")
        form = ("one_row" if implementation.endswith("one row") else "row_blocks" if implementation in
                ("scaled dot", "paired decode") or implementation.endswith("word decode") else implementation)
        return np.asarray(moe_experts_pallas(*args, **options, interpret=True, form=form))


@pytest.mark.parametrize("T, activation, biased, dtype, experts", [
    (1, "silu", False, jnp.bfloat16, range(E)),     # a decode step: 2 slots
    (5, "gpt_oss", True, jnp.float32, range(E)),    # slots past the distinct experts hit
    (64, "silu", True, jnp.float32, range(E)),      # a verification's rows, 16 an expert: 32-row blocks
    (64, "gpt_oss", False, jnp.bfloat16, range(E)),
    (130, "gpt_oss", True, jnp.bfloat16, (0, 3, 5)),  # ~87 rows an expert: two 64-row blocks each
])
def test_moe_experts_equal_float64_loop(T, activation, biased, dtype, experts):
    inputs = make_inputs(T, T, dtype, biased, experts)
    want = loop_float64(*inputs, activation)
    scale = np.abs(want).max()
    tol = 1e-5 if dtype == jnp.float32 else 4e-3
    for implementation in IMPLEMENTATIONS:
        got = run(implementation, inputs, activation)
        assert got.shape == (T, D) and got.dtype == np.float32, f"{implementation}: shape {got.shape} dtype {got.dtype}"
        assert np.isfinite(got).all(), f"{implementation}: non-finite output"
        err = np.abs(got - want).max() / scale
        assert err < tol, f"{implementation} T={T} {activation} biased={biased}: max error {err:.2e} of the largest output"


@pytest.mark.parametrize("T", [1, 5, 64])
def test_moe_kernel_never_reads_unrouted_experts(T):
    """NaN in every layer but LAYER and in every expert of LAYER no row routes to (weights and biases):
    the kernel's output is finite and equal to the clean stacks' output."""
    inputs = make_inputs(100 + T, T, jnp.bfloat16, True, experts=(1, 4, 6, 7))
    x, ids, weights, *stacks = inputs
    routed = np.zeros((L, E), bool)
    routed[LAYER, np.unique(np.asarray(ids))] = True
    poison = lambda a: jnp.where(routed.reshape(L, E, *[1] * (a.ndim - 2)), a, jnp.nan)
    for implementation in IMPLEMENTATIONS[1:]:
        clean = run(implementation, inputs, "gpt_oss")
        poisoned = run(implementation, (x, ids, weights, *map(poison, stacks)), "gpt_oss")
        assert np.isfinite(poisoned).all(), f"{implementation} T={T}: read an unrouted expert or another layer (NaN out)"
        np.testing.assert_array_equal(poisoned, clean, err_msg=f"{implementation} T={T}: poisoned stacks changed the output")


F_PACKED = 64  # MXFP4 stacks: K a multiple of the 32-value scale groups


def packed_inputs(seed: int, T: int, dtype, biased: bool, experts=range(E)):
    """make_inputs with MXFP4 stacks [L, E, D, 2 F_PACKED] and [L, E, F_PACKED, D]: random codes,
    scales 2^-5..2^-2 (gate/up products large enough that gpt-oss's clamps bite)."""
    x, ids, weights, *_ = make_inputs(seed, T, dtype, biased, experts)
    rng = np.random.default_rng(seed)
    stack = lambda K, N, lo: MXFP4(jnp.asarray(rng.integers(0, 256, (L, E, N, K // 2), dtype=np.uint8)),
                                   jnp.asarray(rng.integers(lo, lo + 4, (L, E, N, K // 32), dtype=np.uint8)))
    keys = jax.random.split(jax.random.key(seed + 1), 2)
    b_gate_up = jax.random.normal(keys[0], (L, E, 2 * F_PACKED), dtype) if biased else None
    b_down = jax.random.normal(keys[1], (L, E, D), dtype) if biased else None
    return x, ids, weights, stack(D, 2 * F_PACKED, 122), stack(F_PACKED, D, 121), b_gate_up, b_down


@pytest.mark.parametrize("T, activation, dtype", [
    (1, "gpt_oss", jnp.bfloat16), (5, "silu", jnp.float32), (64, "gpt_oss", jnp.float32), (64, "silu", jnp.bfloat16)])
def test_moe_experts_mxfp4_equal_float64_loop(T, activation, dtype):
    inputs = packed_inputs(T, T, dtype, True)
    x, ids, weights, w_gate_up, w_down, *biases = inputs
    want = loop_float64(x, ids, weights, dequantize(w_gate_up), dequantize(w_down), *biases, activation)
    scale = np.abs(want).max()
    tol = 1e-5 if dtype == jnp.float32 else 4e-3
    for implementation in PACKED_IMPLEMENTATIONS:
        got = run(implementation, inputs, activation)
        assert got.shape == (T, D) and np.isfinite(got).all(), f"{implementation}: shape {got.shape} or non-finite output"
        err = np.abs(got - want).max() / scale
        assert err < tol, f"{implementation} T={T} {activation}: max error {err:.2e} of the largest output"


def test_placed_code_values_equal_e2m1_where_subnormals_do_not_matter(monkeypatch):
    """The placed decode (`mxfp4.PLACED_DECODE`, inside Triton kernels) of every byte's low and high
    code equals `e2m1` of that code: exactly for every code but +-0.5, and for those (placed as
    2^-127) either exactly or as the CPU's flushed 0. With the flag on, the kernel in
    interpret mode runs the exact decode (the primitive's own lowering) and still equals the loop."""
    codes = jnp.arange(256, dtype=jnp.int32)
    for high in (False, True):
        nibbles = np.asarray(codes >> 4 if high else codes & 15)
        exact = np.asarray(mxfp4.e2m1(jnp.asarray(nibbles)))
        placed = np.asarray(jax.jit(mxfp4._placed_values, static_argnums=1)(codes, high))
        half = (nibbles & 7) == 1
        np.testing.assert_array_equal(placed[~half], exact[~half])
        assert ((placed[half] == exact[half]) | (placed[half] == 0)).all()
    monkeypatch.setattr(mxfp4, "PLACED_DECODE", True)
    inputs = packed_inputs(7, 1, jnp.float32, True)
    x, ids, weights, w_gate_up, w_down, *biases = inputs
    want = loop_float64(x, ids, weights, dequantize(w_gate_up), dequantize(w_down), *biases, "gpt_oss")
    got = run("one_row", inputs, "gpt_oss")
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_paired_values_hold_each_bytes_two_weights():
    """`paired_values` (its exact form, which the CPU runs) of every byte at scales 0 (zero), 1, 100,
    127 (one), 200 and 255 (inf): the low half the low code's weight, the high half the high code's,
    as bf16 bits of `decode`'s float32 values (every one a bf16), NaN where the scale is inf and the
    codes +-0; and the words split into K's order (`paired_weights`) equal `decode` of the tile."""
    codes = jnp.tile(jnp.arange(256, dtype=jnp.int32), 6).astype(jnp.uint8)
    scales = jnp.repeat(jnp.asarray([0, 1, 100, 127, 200, 255], jnp.int32), 256).astype(jnp.uint8)
    pairs = np.asarray(mxfp4.paired_values(codes, mxfp4.pair_factors(scales))).view(np.uint32)
    want = np.asarray(mxfp4.decode(codes, mxfp4.scale_power(scales))).reshape(-1, 2)
    for half, shift in ((0, 0), (1, 16)):
        got = ((pairs >> shift) & 0xFFFF).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(got, want[:, half])
    assert np.isnan(want).sum() == 64 and not want[np.asarray(scales) == 0].any()  # the checks above bite
    rng = np.random.default_rng(3)
    tile = jnp.asarray(rng.integers(0, 256, (16, 64), dtype=np.uint8))
    tile_scales = jnp.asarray(rng.integers(110, 130, (16, 4), dtype=np.uint8))
    got = np.asarray(mxfp4.paired_weights(tile, tile_scales)).astype(np.float32)
    np.testing.assert_array_equal(got, np.asarray(mxfp4.decode(tile, mxfp4.per_byte(mxfp4.scale_power(tile_scales)))))


E2M1 = np.asarray([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def run_ptx(ptx: str, args: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The few PTX instructions `mxfp4.PAIRED_PTX` and `mxfp4.WORD_PTX` use, run in numpy over uint32
    registers: `args` the operands' registers ("$4": ...), returns every register after the last
    instruction. prmt.b32 d, a, b, s: byte i of d is byte (s >> 4i) & 7 of b:a; shf.r.wrap.b32 d, a, b,
    n: the low word of b:a >> (n mod 32); mul.rn.bf16x2 in float32 (the products here are of powers of
    two: exact, subnormals kept, as the GPU keeps them)."""
    regs = {k: v.astype(np.uint32) for k, v in args.items()}
    shape = next(iter(regs.values())).shape
    value = lambda x: regs[x] if x in regs else np.uint32(int(x, 0))
    halves = lambda w: np.stack([w & 0xFFFF, w >> 16], -1).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)

    def word(h):
        bits = h.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
        return bits[..., 0] | bits[..., 1] << np.uint32(16)

    def prmt(a, b, select):
        byte = lambda i: int(select) >> 4 * i & 7
        return sum(((a if byte(i) < 4 else b) >> np.uint32(8 * (byte(i) & 3)) & np.uint32(255)) << np.uint32(8 * i)
                   for i in range(4))

    funnel = lambda a, b, n: ((a >> n) | (b << (np.uint32(32) - n))) if n else a  # shf.r.wrap: b:a >> n
    ops = {"mov.b32": lambda a: a + np.zeros(shape, np.uint32), "shr.u32": lambda a, n: a >> n,
           "shf.r.wrap.b32": lambda a, b, n: funnel(a, b, n % 32),
           "shl.b32": lambda a, n: a << n, "and.b32": lambda a, b: a & b, "or.b32": lambda a, b: a | b,
           "prmt.b32": prmt, "mul.rn.bf16x2": lambda a, b: word(halves(a) * halves(b))}
    for line in ptx.splitlines():
        line = line.strip().rstrip(";")
        if not line or line[0] in "{}." :
            continue
        op, operands = line.split(None, 1)
        dest, *sources = [x.strip() for x in operands.split(",")]
        regs[dest] = ops[op](*map(value, sources)).astype(np.uint32)
    return regs


def test_paired_ptx_holds_each_bytes_two_weights():
    """The inline PTX itself (run in numpy: interpret mode runs the exact form instead) gives every
    byte's two weights bit for bit, at scales 1, 100, 127 and 200: float64 e2m1 values times
    2^(scale - 127) as bf16, subnormals included (the code 0.5 at scale 1: 2^-127, which the GPU keeps
    and the CPU's exact form flushes), and the exact form's words wherever no subnormal arises."""
    codes = np.tile(np.arange(256, dtype=np.uint8), 4)
    scales = np.repeat(np.asarray([1, 100, 127, 200], np.uint8), 256)
    factors = np.asarray(mxfp4.pair_factors(jnp.asarray(scales))).view(np.uint32).reshape(-1, 4)
    regs = run_ptx(mxfp4.PAIRED_PTX, {"$4": codes.view(np.uint32), **{f"${5 + j}": factors[:, j] for j in range(4)}})
    got = np.stack([regs[f"${j}"] for j in range(4)], -1).reshape(-1)
    bits = lambda nibbles: (E2M1[nibbles] * 2.0 ** (scales.astype(np.float64) - 127)).astype(ml_dtypes.bfloat16).view(
        np.uint16).astype(np.uint32)
    np.testing.assert_array_equal(got, bits(codes & 15) | bits(codes >> 4) << np.uint32(16))
    exact = np.asarray(mxfp4.paired_values(jnp.asarray(codes), mxfp4.pair_factors(jnp.asarray(scales)))).view(np.uint32)
    np.testing.assert_array_equal(got[scales > 1], exact[scales > 1])


def test_word_weights_equal_decode():
    """Bytes re-packed as words (`pack_words`) and decoded in K's order (`word_weights`, its exact form)
    equal `decode` of the bytes bit for bit, at scales 0 (zero), 1, 100, 127 (one), 200 and 255 (inf:
    NaN for the codes +-0) and at random bytes and scales; and the words hold each code once: every
    one of the 32 bits of a word is set by exactly one code (a word of all-ones codes is all ones,
    of a single code's bits a single field)."""
    rng = np.random.default_rng()
    scale_set = np.asarray([0, 1, 100, 127, 200, 255], np.uint8)
    tiles = [(np.tile(np.arange(256, dtype=np.uint8), (6, 1)), np.repeat(scale_set[:, None], 16, axis=1)),
             (rng.integers(0, 256, (16, 64), dtype=np.uint8), rng.integers(100, 140, (16, 4), dtype=np.uint8))]
    for blocks, scales in tiles:
        words = jax.lax.bitcast_convert_type(mxfp4.pack_words(jnp.asarray(blocks)), jnp.int32)
        got = np.asarray(mxfp4.word_weights(words, jnp.asarray(scales))).astype(np.float32)
        want = np.asarray(mxfp4.decode(jnp.asarray(blocks), mxfp4.per_byte(mxfp4.scale_power(jnp.asarray(scales)))))
        np.testing.assert_array_equal(got, want)
    assert np.isnan(want).sum() == 0 and np.isnan(got).sum() == 0  # the random tile
    np.testing.assert_array_equal(np.asarray(mxfp4.unpack_words(mxfp4.pack_words(jnp.asarray(blocks)))), blocks)
    stack = MXFP4(jnp.asarray(blocks[None]), jnp.asarray(scales[None]))
    words = mxfp4.to_words(stack, scale_words=True)
    assert words.shape == stack.shape == (1, 128, 16) and words.words and words.scales.shape == (1, 16, 1)
    np.testing.assert_array_equal(np.asarray(dequantize(words)), np.asarray(dequantize(stack)))
    for leaf in ("blocks", "scales"):
        np.testing.assert_array_equal(np.asarray(getattr(mxfp4.to_bytes(words), leaf)),
                                      np.asarray(getattr(stack, leaf)))
    ones = np.asarray(mxfp4.pack_words(jnp.full((1, 16), 255, jnp.uint8)))
    assert (ones == 0xFFFFFFFF).all()
    for k in range(32):  # code k alone set to 15: 4 bits in its word, none in the others
        single = np.zeros(16, np.uint8)
        single[k // 2] = 15 << 4 * (k % 2)
        bits = [bin(int(w)).count("1") for w in np.asarray(mxfp4.pack_words(jnp.asarray(single[None])))[0]]
        assert sorted(bits) == [0, 0, 0, 4], (k, bits)


def test_float_stacks_take_the_fused_form_at_one_row_only():
    """Float stacks: one row (a decode step) through the fused form where D takes its whole down steps
    (Qwen3-30B-A3B's 2048; not gpt-oss-20b's 2880: split K), up to SPLIT_ROWS split K, more row blocks;
    MXFP4 stacks through the fused form are an error."""
    forms = [moe.default_form(rows, False, 2048) for rows in (1, 2, moe.SPLIT_ROWS, moe.SPLIT_ROWS + 1)]
    assert forms == ["fused", "split_k", "split_k", "row_blocks"], forms
    assert moe.default_form(1, False, 2880) == "split_k"
    x, ids, weights, w_gate_up, w_down, *_ = packed_inputs(6, 1, jnp.bfloat16, False)
    with pytest.raises(ValueError, match="'fused' MoE kernel form reads float stacks"):
        moe_experts_pallas(x, ids, weights, w_gate_up, w_down, jnp.int32(LAYER), interpret=True, form="fused")


def test_words_take_row_blocks_and_the_one_row_form():
    """A stack of words goes where bytes go (one row: the one-row form; more: row blocks); the split-K
    form is an error. The one-row form's rows by `group_view` (a view, no copy): output j of word t of
    group g multiplies columns 32 g + 8 j + 2 t and the next (the pair 4 j + t), at [g, 8 j + 2 t] and
    the next."""
    x, ids, weights, w_gate_up, w_down, *_ = packed_inputs(5, 1, jnp.bfloat16, False)
    assert moe.default_form(1, True, 2880) == "one_row" and moe.default_form(2, True, 2880) == "row_blocks"
    with pytest.raises(ValueError, match="row-block and one-row forms, not 'split_k'"):
        moe_experts_pallas(x, ids, weights, mxfp4.to_words(w_gate_up), mxfp4.to_words(w_down), jnp.int32(LAYER),
                           interpret=True, form="split_k")
    K = 96
    grouped = np.asarray(moe.group_view(jnp.arange(2 * K).reshape(2, K)))
    g, j, t, half = np.meshgrid(*map(np.arange, (K // 32, 4, 4, 2)), indexing="ij")
    for row in range(2):
        np.testing.assert_array_equal(grouped[row, g, 8 * j + 2 * t + half], row * K + 32 * g + 8 * j + 2 * t + half)


def test_scale_words_hold_four_groups_and_feed_every_step():
    """`pack_scales`: group 4w + b in byte b of word w (a last word's missing groups 0), `unpack_scales`
    its inverse. At K = 288 (row blocks: two 128-weight steps, whose scales are whole words, and a
    32-weight tail, a word's first byte; one row: a masked 512-weight step) and 160 (a 128 step and a
    tail), the kernels through scale words equal the loop in float64 and the same words with byte scales."""
    rng = np.random.default_rng(11)
    scales = rng.integers(0, 256, (3, 9), dtype=np.uint8)
    words = np.asarray(mxfp4.pack_scales(jnp.asarray(scales)))
    assert words.shape == (3, 3) and words.dtype == np.uint32
    for g in range(9):
        np.testing.assert_array_equal(words[:, g // 4] >> np.uint32(8 * (g % 4)) & 255, scales[:, g])
    assert (words[:, 2] >> 8 == 0).all()
    np.testing.assert_array_equal(np.asarray(mxfp4.unpack_scales(jnp.asarray(words), 9)), scales)
    Dw, Fw, T = 288, 160, 64
    keys = jax.random.split(jax.random.key(12), 3)
    stack = lambda K, N, lo: MXFP4(jnp.asarray(rng.integers(0, 256, (L, E, N, K // 2), dtype=np.uint8)),
                                   jnp.asarray(rng.integers(lo, lo + 6, (L, E, N, K // 32), dtype=np.uint8)))
    w_gate_up, w_down = stack(Dw, 2 * Fw, 120), stack(Fw, Dw, 121)
    for rows in (1, T):
        x = jax.random.normal(keys[0], (rows, Dw), jnp.float32)
        ids = jnp.argsort(jax.random.uniform(keys[1], (rows, E)), axis=1)[:, :K].astype(jnp.int32)
        weights = jax.nn.softmax(jax.random.normal(keys[2], (rows, K)), axis=1)
        want = loop_float64(x, ids, weights, dequantize(w_gate_up), dequantize(w_down), None, None, "gpt_oss")
        got = {scale_words: np.asarray(moe_experts_pallas(
            x, ids, weights, *(mxfp4.to_words(w, True, scale_words) for w in (w_gate_up, w_down)), jnp.int32(LAYER),
            activation="gpt_oss", interpret=True)) for scale_words in (True, False)}
        assert np.abs(got[True] - want).max() / np.abs(want).max() < 1e-5, rows
        np.testing.assert_array_equal(got[True], got[False], err_msg=f"{rows} rows")


def test_word_ptx_holds_each_words_eight_weights():
    """The inline PTX of `word_values` itself (run in numpy; interpret mode runs the exact form), each of
    the four outputs over words of random codes, gives the bf16x2 words bit for bit: float64 e2m1 values
    times 2^(scale - 127) as bf16 at scales 1 (subnormals, which the GPU keeps), 100, 127 and 200, in the
    layout `word_weights` reorders (output j of word t is the pair 4 j + t of its group); and with one
    multiply (`small`) at scales 1, 100, 127 and 128 (factors 2^(scale - 1): 1 and 128 the bounds). Each asm reads
    one word and one factor and writes one output: elementwise, as Triton's packing requires (an asm
    whose outputs took different words' rotations would compute garbage in a kernel)."""
    rng = np.random.default_rng()
    blocks = rng.integers(0, 256, (4, 64), dtype=np.uint8)  # a row per scale, 4 groups each
    words = np.asarray(mxfp4.pack_words(jnp.asarray(blocks)))  # [4, 16]
    codes = np.stack([blocks & 15, blocks >> 4], -1).reshape(4, 4, 4, 4, 2)  # [row, group, j, t, half]
    for small, scales in ((False, [1, 100, 127, 200]), (True, [1, 100, 127, 128])):
        scales = np.asarray(scales, np.uint8)
        factors = np.asarray(mxfp4.word_factors(jnp.asarray(scales), small)).view(np.uint32)[:, None]
        for ptx in mxfp4.WORD_PTX[small]:
            assert re.findall(r"\$\d", ptx) and set(re.findall(r"\$\d", ptx)) == {"$0", "$1", "$2"}, ptx
        got = np.stack([run_ptx(ptx, {"$1": words, "$2": np.broadcast_to(factors, words.shape)})["$0"]
                        for ptx in mxfp4.WORD_PTX[small]], -1).reshape(4, 4, 4, 4)  # [row, group, t, j]
        power = 2.0 ** (scales.astype(np.float64) - 127)[:, None, None, None, None]
        bits = (E2M1[codes] * power).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
        np.testing.assert_array_equal(got, np.swapaxes(bits[..., 0] | bits[..., 1] << np.uint32(16), 2, 3),
                                      err_msg=f"small={small}")


@pytest.mark.parametrize("T", [1, 5, 64])
def test_moe_kernel_never_reads_unrouted_mxfp4_experts(T):
    """Scale 255 (inf once decoded) in every layer but LAYER and in every expert of LAYER no row
    routes to: the kernel's output is finite and equal to the clean stacks' output."""
    inputs = packed_inputs(200 + T, T, jnp.bfloat16, True, experts=(0, 2, 5))
    x, ids, weights, w_gate_up, w_down, *biases = inputs
    routed = np.zeros((L, E, 1, 1), bool)
    routed[LAYER, np.unique(np.asarray(ids))] = True
    poison = lambda w: MXFP4(w.blocks, jnp.where(routed, w.scales, jnp.uint8(255)))
    for implementation in PACKED_IMPLEMENTATIONS[1:]:
        clean = run(implementation, inputs, "gpt_oss")
        poisoned = run(implementation, (x, ids, weights, poison(w_gate_up), poison(w_down), *biases), "gpt_oss")
        assert np.isfinite(poisoned).all(), f"{implementation} T={T}: read an unrouted expert or another layer"
        np.testing.assert_array_equal(poisoned, clean, err_msg=f"{implementation} T={T}: poisoned scales changed the output")


def test_k_steps_cover_k_in_powers_of_two():
    """A loop step that does not divide K (gpt-oss's 2880) leaves static tail steps that end at K."""
    assert moe.k_steps(2880, 256) == (11, [(2816, 64)])
    assert moe.k_steps(2880, 512) == (5, [(2560, 256), (2816, 64)])
    assert moe.k_steps(96, 64) == (1, [(64, 32)]) and moe.k_steps(2048, 64) == (32, [])


def test_a_decode_rows_expert_ids_are_its_slots():
    """A decode step's row hands the kernels its expert ids [1, k] as they are (`moe._slot`): slot s is
    assignment s, empty where the id is -1 (its expert is then read by no program); routed slots [3, S]
    are read as `_slots` wrote them."""
    def kernel(slots_ref, out_ref):
        s = pl.program_id(0)
        for i, v in enumerate(moe._slot(slots_ref)):
            out_ref[s, i] = v

    def slots_read(slots):
        return pl.pallas_call(kernel, grid=(slots.shape[1],), in_specs=[pl.no_block_spec], out_specs=pl.no_block_spec,
                              out_shape=jax.ShapeDtypeStruct((slots.shape[1], 3), jnp.int32), interpret=True)(slots)

    rng = np.random.default_rng()
    ids = rng.choice(E, 6, replace=False)
    ids[rng.choice(6, 2, replace=False)] = -1
    want = [[max(e, 0), s, s + (e >= 0)] for s, e in enumerate(ids)]
    assert np.asarray(slots_read(jnp.asarray(ids[None], jnp.int32))).tolist() == want
    routed = moe._slots(jnp.asarray(rng.integers(0, 3, E), jnp.int32), 5)
    assert np.array_equal(slots_read(routed), np.asarray(routed).T)


def staged(jaxpr):
    """The equations a jaxpr stages, its nested jaxprs' included, but not inside the kernels (a
    pallas_call is one equation)."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name != "pallas_call":
            for sub in jaxprs_in_params(eqn.params):
                yield from staged(sub)


@pytest.mark.parametrize("form", ["fused", "split_k", "one_row"])
def test_a_decode_rows_order_is_a_constant(form):
    """A decode step's row needs no routing: its tokens and positions are known when tracing, so the call
    stages no iota or pad outside its kernels (on a GPU, a pad kernel a layer), and its output is still
    the float64 definition's."""
    x, ids, weights, w_gate_up, w_down, _, _ = make_inputs(np.random.default_rng().integers(1 << 30), 1,
                                                           jnp.float32, False)
    call = lambda *a: moe_experts_pallas(*a, LAYER, interpret=True, form=form)
    names = {eqn.primitive.name for eqn in staged(jax.make_jaxpr(call)(x, ids, weights, w_gate_up, w_down).jaxpr)}
    data_pads = {"pad"} if form == "split_k" else set()  # split K pads its activations for down's row block
    assert "pallas_call" in names and not names & ({"iota", "pad"} - data_pads)
    want = loop_float64(x, ids, weights, w_gate_up, w_down, None, None, "silu")
    assert np.abs(call(x, ids, weights, w_gate_up, w_down) - want).max() < 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("down_programs", [1, 512])
def test_one_row_downs_own_column_blocks(monkeypatch, down_programs):
    """The one-row form's down call takes its own target of programs (`moe.ONE_ROW_DOWN_PROGRAMS`): with
    one, its column blocks are wider than gate/up's (32 against 16 columns here), and the output is still
    the float64 definition's."""
    monkeypatch.setattr(moe, "ONE_ROW_DOWN_PROGRAMS", down_programs)
    inputs = make_inputs(np.random.default_rng().integers(1 << 30), 1, jnp.float32, True)
    x, ids, weights, w_gate_up, w_down, b_gate_up, b_down = inputs
    call = lambda *a: moe_experts_pallas(*a, LAYER, b_gate_up=b_gate_up, b_down=b_down, activation="gpt_oss",
                                         interpret=True, form="one_row")
    grids = [eqn.params["grid_mapping"].grid for eqn in staged(jax.make_jaxpr(call)(*inputs[:5]).jaxpr)
             if eqn.primitive.name == "pallas_call"]
    assert grids == [(K, F // 16, 1), (K, D // (32 if down_programs == 1 else 16), 1)]  # gate/up's, then down's
    got = call(*inputs[:5])
    want = loop_float64(x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, "gpt_oss")
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("down_step", [512, 8192])
def test_one_row_downs_own_step(monkeypatch, down_step):
    """The one-row form's down call takes its own weights a loop step (`moe.ONE_ROW_DOWN_STEP_ELEMENTS`):
    at 512, 32 of K a step at 16 columns, so down's K of 48 takes a whole step and a masked one where
    8,192 takes one masked step of 64, and gate/up keeps ROW_STEP_ELEMENTS; the output is the float64
    definition's either way."""
    monkeypatch.setattr(moe, "ONE_ROW_DOWN_STEP_ELEMENTS", down_step)
    steps, row_step = [], moe.row_step

    def recorded(*args):  # each call's (K, columns, elements, step)
        steps.append((*args, row_step(*args)))
        return steps[-1][-1]

    monkeypatch.setattr(moe, "row_step", recorded)
    inputs = make_inputs(np.random.default_rng().integers(1 << 30), 1, jnp.float32, True)
    x, ids, weights, w_gate_up, w_down, b_gate_up, b_down = inputs
    got = moe_experts_pallas(*inputs[:5], LAYER, b_gate_up=b_gate_up, b_down=b_down, activation="gpt_oss",
                             interpret=True, form="one_row")
    assert steps == [(D, 16, moe.ROW_STEP_ELEMENTS, 128), (F, 16, down_step, 32 if down_step == 512 else 64)]
    want = loop_float64(x, ids, weights, w_gate_up, w_down, b_gate_up, b_down, "gpt_oss")
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("T", [1, 5, 64])
def test_dropped_assignments_add_nothing(T):
    """An assignment with id -1 (another device's expert) is left out: the output equals the float64
    loop over the kept assignments alone, and the kernel never reads a dropped expert's stacks
    (poisoned; XLA's grouped product, the reference, multiplies every expert, so it gets them clean)."""
    inputs = make_inputs(300 + T, T, jnp.float32, True)
    x, ids, weights, w_gate_up, w_down, b_gate_up, b_down = inputs
    dropped = jnp.asarray(np.random.default_rng(T).random(ids.shape) < 0.4)
    kept_ids = jnp.where(dropped, -1, ids)
    want = loop_float64(x, ids, jnp.where(dropped, 0.0, weights), w_gate_up, w_down, b_gate_up, b_down, "gpt_oss")
    kept = np.zeros((L, E), bool)
    kept[LAYER, np.unique(np.asarray(ids)[~np.asarray(dropped)])] = True
    poison = lambda a: jnp.where(kept.reshape(L, E, *[1] * (a.ndim - 2)), a, jnp.nan)
    for implementation in IMPLEMENTATIONS:
        stacks = (w_gate_up, w_down, b_gate_up, b_down)
        stacks = stacks if implementation == "reference" else tuple(map(poison, stacks))
        got = run(implementation, (x, kept_ids, weights, *stacks), "gpt_oss")
        assert np.isfinite(got).all(), f"{implementation} T={T}: read a dropped expert (NaN out)"
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-5, f"{implementation} T={T}: max error {err:.2e} with dropped assignments"
