"""MXFP4, gpt-oss's released expert format, kept packed on the device: the stack (`MXFP4`), its
decodes and its re-packings.

A weight is a 4-bit e2m1 code (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) times a power of two
shared by MXFP4_GROUP values of K (a uint8 exponent with bias 127): 4.25 bits a weight. The stack
keeps the checkpoint's layout (rows are output columns, two codes a byte) or re-packs it for the
experts kernel (`pallas_kernels.moe`): the codes as words whose 8 codes a thread decodes with
rotations and masks alone (`to_words`), the scales four to a word (`pack_scales`).

Each decode has a jnp form, exact on every platform (`e2m1`, `decode`, `dequantize`), and, where a
Triton kernel gains from it, a primitive whose Triton lowering takes fewer instructions a weight:
the codes' bits placed into floats (`code_values`), Triton's scaled dot (`mxfp4_dot`: private API,
as pinned), and inline PTX decoding a byte or a word into bf16x2 operand registers (`paired_values`,
`word_values`). Outside Triton each primitive lowers to its jnp form.
"""
import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu
from jax.extend.core import Primitive
from jax.interpreters import mlir
# Pallas-Triton has no public way to emit Triton's scaled dot (`mxfp4_dot` below): its lowering registry
# and Triton dialect bindings, as pinned (jax 0.11.2). Registering touches only our own primitives.
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering

MXFP4_GROUP = 32  # values of K per scale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXFP4:
    """A stack of matrices W [..., K, N] (x @ W) in MXFP4, gpt-oss's released expert form kept packed:
    blocks [..., N, K/2] uint8, row n holding W[:, n] two e2m1 codes a byte (even k in the low nibble,
    odd k in the high one), and scales [..., N, K/32] uint8, W[k, n] = e2m1 x 2^(scale - 127) for
    each MXFP4_GROUP values of K. Rows are output columns, as in the checkpoint: a kernel's tile of
    [columns, K step / 2] bytes is contiguous along K (the checkpoint's blocks reshaped, no re-pack).
    Or blocks [..., N, K/8] uint32: the same codes as `pack_words` words (`to_words`), which the row-block
    (`word_weights`) and one-row (`moe.group_view`) forms read. `small_scales` (static): every scale is
    between 1 and 128, as whoever packed the words found (`to_words`); their outputs then take one
    multiply instead of two (`word_factors`). A stack of words may hold its scales four to a uint32 word
    (`pack_scales`: [..., N, ceil(K/128)]), as `load_model` has `to_words` pack them where each device
    holds whole rows of K."""

    blocks: jax.Array
    scales: jax.Array
    small_scales: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The matrices' shape [..., K, N], as a float stack's."""
        *lead, N, n = self.blocks.shape
        return (*lead, n * (8 if self.words else 2), N)

    @property
    def words(self) -> bool:
        """Whether blocks holds `pack_words` words (uint32) rather than the checkpoint's bytes."""
        return self.blocks.dtype == jnp.uint32

    def byte_scales(self):
        """The scales as the checkpoint's bytes [..., N, K/32] (`pack_scales` undone)."""
        if self.scales.dtype == jnp.uint8:
            return self.scales
        return unpack_scales(self.scales, self.shape[-2] // MXFP4_GROUP)


def has_packed(tree) -> bool:
    """Whether any leaf of `tree` (a params pytree) is an MXFP4 stack."""
    return any(isinstance(x, MXFP4) for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, MXFP4)))


def e2m1(codes):
    """float32 values of 4-bit e2m1 codes (int32 0..15: sign, 2-bit exponent, 1-bit mantissa):
    0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, built as float32 bits (a kernel has no tables):
    exponent and mantissa shifted into place over a bias of 126, the two subnormal codes (0, 0.5)
    set apart, the sign moved to bit 31."""
    magnitude = codes & 7
    bits = jnp.where(magnitude < 2, magnitude * (126 << 23), (magnitude << 22) + (126 << 23))
    return lax.bitcast_convert_type(bits | ((codes & 8) << 28), jnp.float32)


def scale_power(scales):
    """float32 2^(scale - 127) of uint8 MXFP4 scales, from the exponent bits (scale 255 is inf, as a
    poisoned scale should be; 0 decodes as 0, not 2^-127)."""
    return lax.bitcast_convert_type(scales.astype(jnp.int32) << 23, jnp.float32)


def decode(blocks, power, values=None):
    """float32 [..., 2n]: the values of MXFP4 bytes `blocks` [..., n] (the low nibble's code first)
    times each byte's power of two `power` [..., n] (`scale_power` of its scale); `values`: the codes'
    decode (default `code_values`; bench/mxfp4_probe.py times `exact_values` beside it)."""
    codes, values = blocks.astype(jnp.int32), values or code_values
    pairs = jnp.stack([values(codes, high=False) * power, values(codes, high=True) * power], axis=-1)
    return pairs.reshape(*blocks.shape[:-1], 2 * blocks.shape[-1])


code_values_p = Primitive("mxfp4_code_values")
# On: checked on an H200 (exact there: Triton keeps float32 subnormals; gpt-oss-20b emits the same tokens
# with it as with `exact_values`; the one-row form 78 -> 67 us: bench/NOTES.md). False: `exact_values` everywhere.
PLACED_DECODE = True


def code_values(codes, high: bool):
    """float32 values of the low (high: the high) e2m1 codes of MXFP4 bytes `codes` (int32 0..255).
    With PLACED_DECODE, inside a Triton kernel by placing the code's bits (`_placed_values`: the
    one-row loops' instructions a weight 11 -> 8, their bound: bench/NOTES.md), elsewhere `e2m1`."""
    return code_values_p.bind(codes, high=high) if PLACED_DECODE else exact_values(codes, high)


def exact_values(codes, high: bool):
    """`code_values` by `e2m1`: exact on every platform."""
    return e2m1(codes >> 4 if high else codes & 15)


def _placed_values(codes, high: bool):
    """`exact_values` with a code s e1 e0 m placed as float32 bits s << 31 | e1 e0 m << 22 (2^-126
    times its value), then one multiply by 2^126: exact where float32 subnormals are kept (the code
    0.5 is placed as 2^-127), as Triton keeps them; the CPU flushes them, hence `exact_values` there."""
    shift = 18 if high else 22
    bits = ((codes << shift) & 0x01C00000) | ((codes << shift + 6) & jnp.int32(-(1 << 31)))
    return lax.bitcast_convert_type(bits, jnp.float32) * jnp.float32(2.0 ** 126)


code_values_p.def_abstract_eval(lambda codes, high: jax.core.ShapedArray(codes.shape, jnp.float32))
code_values_p.def_impl(exact_values)
mlir.register_lowering(code_values_p, mlir.lower_fun(exact_values, multiple_results=False))
triton_lowering.register_lowering(code_values_p)(triton_lowering.lower_fun(_placed_values, multiple_results=False))


mxfp4_dot_p = Primitive("mxfp4_dot")


def mxfp4_dot(acc, x, codes, scales):
    """Inside a kernel: float32 acc [M, N] + x [M, K] (bf16) times the MXFP4 tile of bytes codes [N, K/2]
    and scales [N, K/32] (rows are output columns, as `MXFP4` stores them). On the GPU, Triton's
    scaled dot (tt.dot_scaled: its own e2m1 -> bf16 conversion, then the matrix unit); in interpret
    mode, `decode` and a float32 product."""
    return mxfp4_dot_p.bind(acc, x, codes, scales)


def per_byte(groups, units: int = MXFP4_GROUP // 2):
    """[columns, units n]: each of groups [columns, n] (an MXFP4 scale a group, or its power) for each of
    its group's `units` (its MXFP4_GROUP // 2 bytes, or 4 `pack_words` words), by a broadcast and a
    reshape (a kernel has no repeat)."""
    columns, n = groups.shape
    return jnp.broadcast_to(groups[:, :, None], (columns, n, units)).reshape(columns, n * units)


def decoded_dot(acc, x, codes, scales):
    """mxfp4_dot by `decode` in registers and x's dtype's product (the kernels' own path without it)."""
    w = decode(codes, per_byte(scale_power(scales))).astype(x.dtype)
    return acc + lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _mxfp4_dot_triton(ctx, acc, x, codes, scales):
    [out] = ctx.avals_out
    return tt_dialect.dot_scaled(ir.RankedTensorType.get(out.shape, ir.F32Type.get()), x,
                                 tt_dialect.trans(codes, (1, 0)), acc, tt_dialect.ScaleDotElemType.BF16,
                                 tt_dialect.ScaleDotElemType.E2M1, False, b_scale=scales, lhs_k_pack=True,
                                 rhs_k_pack=True)


mxfp4_dot_p.def_abstract_eval(lambda acc, x, codes, scales: jax.core.ShapedArray(acc.shape, jnp.float32))
mxfp4_dot_p.def_impl(decoded_dot)
mlir.register_lowering(mxfp4_dot_p, mlir.lower_fun(decoded_dot, multiple_results=False))
triton_lowering.register_lowering(mxfp4_dot_p)(_mxfp4_dot_triton)


paired_values_p = Primitive("mxfp4_paired_values")


def paired_values(codes, factors):
    """int32 [..., n]: each MXFP4 byte of `codes` [..., n] (uint8) as two bf16 values in one word, its
    low code's in the low half, each times the byte's power of two 2^(scale - 127), which `factors`
    [..., n] int32 hold as bf16 bits in both halves (`pair_factors`). Inside a Triton kernel by inline
    PTX (`PAIRED_PTX`), elsewhere by `e2m1`."""
    return paired_values_p.bind(codes, factors)


def pair_factors(scales):
    """int32 [..., n]: `paired_values`' factors of uint8 MXFP4 scales, 2^(scale - 127) as bf16 bits in
    both halves (scale 0 decodes as 0 and 255 as inf, as `scale_power`)."""
    return scales.astype(jnp.int32) * 0x00800080  # s << 7 | s << 23 (no carries): one multiply-add with word_factors


def _exact_pair(low, high, factors, small: bool = False):
    """int32: e2m1 codes low and high (int32) times 2^(scale - 127) of `factors` (`pair_factors`, or with
    `small` `word_factors`' 2^(scale - 1)) as one bf16x2 word, low in the low half, by `e2m1`: exact on
    every platform (every such weight is a bf16)."""
    power = scale_power(lax.shift_right_logical(factors, 7) & 255) * (2.0 ** -126 if small else 1.0)
    half = lambda code: lax.bitcast_convert_type((e2m1(code) * power).astype(jnp.bfloat16), jnp.uint16)
    return half(low).astype(jnp.int32) | (half(high).astype(jnp.int32) << 16)


def _paired_exact(codes, factors):
    """`paired_values` by `e2m1`."""
    c = codes.astype(jnp.int32)
    return _exact_pair(c & 15, c >> 4, factors)


def _pair_ptx(j: int) -> str:
    """Byte j of the four in $4 to the bf16x2 word $j: its codes s e1 e0 m (low nibble, and the high one
    brought down in u = $4 >> 4) placed as bf16 bits s << 15 | e1 e0 m << 6 in each half by one byte
    permute, two shifts and two masks (2^-126 times their value: the code 0.5 a subnormal, which bf16
    arithmetic keeps), then times 2^126 and the byte's factor $(5 + j). The other bytes the permute
    brings in land outside the masks."""
    select = j | j << 4 | (4 + j) << 8 | (4 + j) << 12
    return (f"prmt.b32 v, $4, u, {select:#x};\nshl.b32 a, v, 6;\nshl.b32 b, v, 12;\n"
            f"and.b32 b, b, 0x80008000;\nand.b32 a, a, 0x01C001C0;\nor.b32 a, a, b;\n"
            f"mul.rn.bf16x2 a, a, two126;\nmul.rn.bf16x2 ${j}, a, ${5 + j};")


PAIRED_PTX = ("{\n.reg .b32 u, v, a, b, two126;\nmov.b32 two126, 0x7E807E80;\nshr.u32 u, $4, 4;\n"
              + "\n".join(_pair_ptx(j) for j in range(4)) + "\n}")


def _paired_ptx(codes, factors):
    [pairs] = plgpu.elementwise_inline_asm(PAIRED_PTX, args=[codes, factors], constraints="=r,=r,=r,=r,r,r,r,r,r",
                                           pack=4, result_shape_dtypes=[jax.ShapeDtypeStruct(codes.shape, jnp.int32)])
    return pairs


paired_values_p.def_abstract_eval(lambda codes, factors: jax.core.ShapedArray(codes.shape, jnp.int32))
paired_values_p.def_impl(_paired_exact)
mlir.register_lowering(paired_values_p, mlir.lower_fun(_paired_exact, multiple_results=False))
triton_lowering.register_lowering(paired_values_p)(triton_lowering.lower_fun(_paired_ptx, multiple_results=False))


def _split_pairs(pairs):
    """bf16 [columns, 2n]: the two halves of each bf16x2 word of pairs [columns, n] (int32), low first."""
    half = lambda bits: lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.bfloat16)
    low, high = half(pairs), half(lax.shift_right_logical(pairs, 16))
    return jnp.stack([low, high], axis=-1).reshape(pairs.shape[0], 2 * pairs.shape[1])


def paired_weights(codes, scales):
    """bf16 [columns, 2n]: the weights of MXFP4 bytes codes [columns, n] and their scales [columns, n/16]
    in K's order, by `paired_values` (the two halves of each word split and joined again: compiled,
    the words are the matrix unit's operand registers as they are)."""
    return _split_pairs(paired_values(codes, per_byte(pair_factors(scales))))


# MXFP4 words (`pack_words`): each scale group's 32 codes re-packed into 4 uint32 words so that a thread
# of a row block loads whole words and decodes a word's 8 codes into the 4 bf16x2 operand registers it
# holds for the matrix unit, with no byte permutes: output j of a word is
#   (rotr(word, magnitude_j) & WORD_MAGNITUDE) | (rotr(word, sign_j) & WORD_SIGN),
# the codes s e1 e0 m of its two halves placed as bf16 bits s << 15 | e1 e0 m << 6 (2^-126 times their
# values, as `paired_values`). The rotations below tile the word's 32 bits with the 8 codes' fields and
# need 5 distinct nonzero ones (none tiles with one rotation an output). Word t of a group holds the
# code pairs (2p, 2p + 1) with p = 4 j + t: Hopper's register operand gives lane t of a quad the pairs
# t and t + 4 of each 16 of K, so the words' reorder into K's order (`word_weights`) is a relabelling of
# registers once compiled (sm_90 SASS of a warpgroup's product: no shuffles, no shared-memory round trip;
# mma.sync's, below 64 columns, takes one).
WORD_ROTATIONS = ((0, 4), (3, 3), (6, 6), (9, 5))  # (magnitude_j, sign_j): right rotations for output j
WORD_MAGNITUDE, WORD_SIGN = 0x01C001C0, 0x80008000


def pack_words(blocks):
    """uint32 [..., n/4]: MXFP4 bytes [..., n] (n a multiple of 16: whole scale groups) as `word_weights`
    reads them (the layout above)."""
    codes = blocks.astype(jnp.uint32)
    codes = jnp.stack([codes & 15, codes >> 4], axis=-1)  # [..., n, 2]: pair p's codes 2p, 2p + 1
    codes = codes.reshape(*blocks.shape[:-1], blocks.shape[-1] // 16, 4, 4, 2)  # [..., group, j, t, half]
    rotl = lambda x, n: (x << n) | (x >> (32 - n)) if n else x
    words = 0
    for j, (magnitude, sign) in enumerate(WORD_ROTATIONS):
        for half in range(2):
            c = codes[..., j, :, half]
            words = words | rotl((c & 7) << (6 + 16 * half), magnitude) | rotl((c >> 3) << (15 + 16 * half), sign)
    return words.reshape(*blocks.shape[:-1], blocks.shape[-1] // 4).astype(jnp.uint32)


def pack_scales(scales):
    """uint32 [..., ceil(G/4)]: MXFP4 scales [..., G] (uint8) four to a word, group 4w + b in byte b (a
    last word's missing groups 0). A row block's 128 weights of K a step then take one 4-byte scale
    word a column, which Triton copies asynchronously ahead of the step like the codes; as bytes, the
    step's [64 columns, 4] scales are 2 bytes a thread, too few for an async copy, so each step waited
    on a plain load: a third of the row blocks' stall samples on an H100 (ncu; bench/NOTES.md)."""
    bytes_ = jnp.pad(scales, [(0, 0)] * (scales.ndim - 1) + [(0, -scales.shape[-1] % 4)]).astype(jnp.uint32)
    b = bytes_.reshape(*scales.shape[:-1], -1, 4)
    return b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24


def unpack_scales(words, groups: int):
    """uint8 [..., groups]: the scales of `pack_scales` words: its inverse."""
    b = jnp.stack([lax.shift_right_logical(words, jnp.uint32(8 * i)) & 255 for i in range(4)], axis=-1)
    return b.reshape(*words.shape[:-1], -1)[..., :groups].astype(jnp.uint8)


word_values_p = Primitive("mxfp4_word_values")


def word_values(words, factors, j: int, small: bool = False):
    """int32 [..., n]: bf16x2 word j (0..3) of each MXFP4 word of `words` [..., n] (int32, `pack_words`'
    bits), its two values times their group's 2^(scale - 127), from `factors` [..., n] (`word_factors`).
    Inside a Triton kernel by inline PTX (`WORD_PTX[small][j]`: one or two rotations, a mask-and-or,
    two bf16x2 multiplies, or one with `small`), elsewhere by `e2m1`."""
    return word_values_p.bind(words, factors, j=j, small=small)


def word_factors(scales, small: bool = False):
    """int32 [..., n]: `word_values`' factors of uint8 MXFP4 scales as bf16 bits in both halves:
    `pair_factors`' 2^(scale - 127), or with `small` (every scale between 1 and 128) 2^(scale - 1),
    which also takes the placed codes' 2^126: each half's exponent field 126 more."""
    return pair_factors(scales) + (0x3F003F00 if small else 0)


def _word_codes(words, j: int):
    """int32 [..., n, 2]: the codes (s e1 e0 m) of each word's output j, low half first."""
    rotr = lambda x, n: lax.shift_right_logical(x, n) | (x << (32 - n)) if n else x
    magnitude, sign = WORD_ROTATIONS[j]
    bits = (rotr(words, magnitude) & WORD_MAGNITUDE) | (rotr(words, sign) & jnp.int32(WORD_SIGN - (1 << 32)))
    return jnp.stack([(lax.shift_right_logical(bits, 6 + 16 * h) & 7) | (lax.shift_right_logical(bits, 12 + 16 * h) & 8)
                      for h in range(2)], axis=-1)


def _word_exact(words, factors, j: int, small: bool):
    """`word_values` by `e2m1`."""
    codes = _word_codes(words, j)
    return _exact_pair(codes[..., 0], codes[..., 1], factors, small)


def _word_ptx_text(j: int, small: bool) -> str:
    """Output j ($0) of the word $1 times the factor $2 (with `small`, one multiply: the factor holds
    2^126 too). One asm a word and output, not one with four outputs: an asm must be elementwise, since
    Triton packs a thread's elements in its layout's order."""
    magnitude, sign = WORD_ROTATIONS[j]
    rotate = lambda dest, n: f"shf.r.wrap.b32 {dest}, $1, $1, {n};" if n else f"mov.b32 {dest}, $1;"
    if magnitude == sign:
        place = [rotate("a", magnitude), f"and.b32 a, a, {WORD_MAGNITUDE | WORD_SIGN:#x};"]
    else:
        place = [rotate("a", magnitude), rotate("b", sign), f"and.b32 a, a, {WORD_MAGNITUDE:#x};",
                 f"and.b32 b, b, {WORD_SIGN:#x};", "or.b32 a, a, b;"]
    registers, normalize = ((".reg .b32 a, b;", []) if small else
                            (".reg .b32 a, b, two126;", ["mov.b32 two126, 0x7E807E80;", "mul.rn.bf16x2 a, a, two126;"]))
    return "\n".join(["{", registers, *place, *normalize, "mul.rn.bf16x2 $0, a, $2;", "}"])


WORD_PTX = tuple(tuple(_word_ptx_text(j, small) for j in range(4)) for small in (False, True))


def _word_ptx(words, factors, j: int, small: bool):
    [values] = plgpu.elementwise_inline_asm(WORD_PTX[small][j], args=[words, factors], constraints="=r,r,r", pack=1,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, jnp.int32)])
    return values


word_values_p.def_abstract_eval(lambda words, factors, j, small: jax.core.ShapedArray(words.shape, jnp.int32))
word_values_p.def_impl(_word_exact)
mlir.register_lowering(word_values_p, mlir.lower_fun(_word_exact, multiple_results=False))
triton_lowering.register_lowering(word_values_p)(triton_lowering.lower_fun(_word_ptx, multiple_results=False))


def word_weights(words, scales, small: bool = False):
    """bf16 [columns, 8n]: the weights of MXFP4 words [columns, n] (int32, `pack_words`) and their scales
    [columns, n/4] (`small`: all between 1 and 128) in K's order, by `word_values` (output j of a group's
    word t is the pair 4 j + t)."""
    columns, n = words.shape
    factors = per_byte(word_factors(scales, small), units=4)
    out = [word_values(words, factors, j, small) for j in range(4)]
    # [columns, group, t, j_low, j_high] (j = 2 j_high + j_low; Triton stacks on the last axis only)
    # -> [columns, group, j_high, j_low, t]
    pairs = jnp.stack([jnp.stack(out[:2], axis=-1), jnp.stack(out[2:], axis=-1)], axis=-1)
    return _split_pairs(jnp.transpose(pairs.reshape(columns, n // 4, 4, 2, 2), (0, 1, 4, 3, 2)).reshape(columns, 4 * n))


def _by_matrix(f, blocks):
    """f over a stack's blocks one matrix of its leading axis at a time (lax.map): pack_words' temporaries
    take 8 bytes a code byte."""
    return lax.map(f, blocks) if blocks.ndim > 2 else f(blocks)


def to_words(w: MXFP4, small_scales: bool = False, scale_words: bool = False) -> MXFP4:
    """The stack with its bytes re-packed as `pack_words` words (the same codes and scales);
    `small_scales`: the caller found every scale between 1 and 128 (`MXFP4.small_scales`); `scale_words`:
    the scales four to a word too (`pack_scales`: on an H100 row blocks 12% faster, the one-row form 9%
    slower; not where a device holds part of a row of K, whose words could straddle two devices)."""
    if w.words:
        return w
    return MXFP4(_by_matrix(pack_words, w.blocks), pack_scales(w.scales) if scale_words else w.scales, small_scales)


def to_bytes(w: MXFP4) -> MXFP4:
    """The stack with its words unpacked into the released bytes (`to_words`' inverse)."""
    return MXFP4(_by_matrix(unpack_words, w.blocks), w.byte_scales()) if w.words else w


def unpack_words(words):
    """uint8 [..., 4n]: the MXFP4 bytes of `pack_words` words [..., n] (uint32): its inverse."""
    signed = lax.bitcast_convert_type(words, jnp.int32)
    codes = jnp.stack([_word_codes(signed, j) for j in range(4)], axis=-2)  # [..., n, 4 (j), 2 (half)]
    codes = jnp.swapaxes(codes.reshape(*words.shape[:-1], words.shape[-1] // 4, 4, 4, 2), -3, -2)
    return (codes[..., 0] | (codes[..., 1] << 4)).reshape(*words.shape[:-1], 4 * words.shape[-1]).astype(jnp.uint8)


def dequantize(w: MXFP4):
    """float32 [..., K, N]: the matrices of an MXFP4 stack."""
    blocks = unpack_words(w.blocks) if w.words else w.blocks
    return jnp.swapaxes(decode(blocks, scale_power(jnp.repeat(w.byte_scales(), MXFP4_GROUP // 2, axis=-1))), -1, -2)
