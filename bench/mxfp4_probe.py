"""What bounds the MXFP4 experts kernel's row blocks: a minimal product in variants, on the GPU.

    PYTHONPATH=. python3 bench/mxfp4_probe.py [--rows 16,64,128] [--out DIR] [--tiny]

One Pallas-Triton product x [M, K] @ W^T over an MXFP4 matrix W [N, K] (bytes [N, K/2], scales
[N, K/32]; N = 32 x 5,760 columns, K = 3,072: gpt-oss-20b's 32 experts' gate/up columns), a grid of
column blocks, a loop over K, as pallas_kernels/moe.py's row blocks stream an expert. Variants read the
same bytes and decode less, to tell the decode's arithmetic from the loads:
- `bytes`: the kernel's own decode (`mxfp4.decode`: both nibbles, the scale, interleaved; with
  `mxfp4.PLACED_DECODE` each code decoded in a Triton kernel by placing its bits, `mxfp4.code_values`:
  exact only where float32 subnormals are kept, which `max_rel_err` tells);
- `exact`: `bytes` with `mxfp4.exact_values` whatever the flag (`mxfp4.e2m1`'s arithmetic, no subnormals:
  the decode before 2026-12-03 midday);
- `low`: the low nibble of each byte decoded and scaled (half the arithmetic; x's first K/2 columns);
- `raw`: each byte converted to bf16 as it is (no decoding);
- `split`: the kernel's decode without its interleave: the low codes times x's even columns, the high
  codes times its odd ones (x's tile split by a reshape), two products;
- `asm`: the decode in inline PTX (`DECODE_PTX`), packed bf16 integer tricks a byte pair at a time, the
  low and high codes multiplied with x's even and odd columns (two products, nothing interleaved).
- `paired`: the kernel's decode with `moe.PAIRED_DECODE` (`mxfp4.paired_weights`: a byte's two codes into
  one bf16x2 word in inline PTX, the product taken as W^T x^T, the weights the matrix unit's register
  operand);
- `words`: the same product from the bytes re-packed as `mxfp4.pack_words` words (done once, outside the
  timing), a word's 8 codes decoded into 4 bf16x2 words by rotations and masks (`mxfp4.word_weights`).
The floor is W's bytes over the copy bandwidth measured in the same run. Writes DIR/mxfp4_probe.json
and prints a table last (--tiny: a CPU smoke test of this script, small shapes in interpret mode,
which runs no PTX: `asm` left out). Tile offsets along K in packed units come from `moe.packed_offset`,
as in the kernel.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from bench import common
from pallas_kernels.moe import packed_offset
from pallas_kernels.mxfp4 import (MXFP4_GROUP, code_values, decode, exact_values, pack_words, paired_weights,
                                  per_byte, scale_power, word_weights)

COLUMNS, DEPTH = 32 * 5760, 3072  # N, K
VARIANTS = ("bytes", "exact", "low", "raw", "split", "paired", "words", "asm")
EXACT = ("bytes", "exact", "split", "paired", "words", "asm")  # the variants that compute the product
# Four MXFP4 bytes ($2) and each one's scale byte ($3) to the bf16 values of their four low codes
# (DECODE_PTX[0]) or high codes ([1]) ($0, $1: two a register). A code s e1 e0 m placed as
# bf16 bits s << 15 | e1 e0 m << 6 is 2^-126 times its value (e = 0: a subnormal m 2^-127), so one
# multiply by 2^126 (0x7E80) decodes two codes at once and one by 2^(scale - 127) (the scale's byte
# << 7) scales them; both exact. (Pallas lowers an asm of one result only: two calls.)
HALF_PTX = """
prmt.b32 a, c, 0, {lanes};
prmt.b32 f, $3, 0, {lanes};
shl.b32 f, f, 7;
shl.b32 t, a, 6;
shl.b32 u, a, 12;
and.b32 t, t, 0x01C001C0;
and.b32 u, u, 0x80008000;
or.b32 a, t, u;
fma.rn.bf16x2 a, a, two126, nz;
mul.rn.bf16x2 {out}, a, f;"""  # elements `lanes` (byte lanes of c and of the scales) into register `out`


def decode_ptx(high: bool) -> str:
    """DECODE_PTX's low (high=False) or high codes."""
    return ("{\n.reg .b32 c, f, a, t, u, two126, nz;\nmov.b32 two126, 0x7E807E80;\nmov.b32 nz, 0x80008000;\n"
            + ("shr.u32 c, $2, 4;" if high else "mov.b32 c, $2;") + "\nand.b32 c, c, 0x0F0F0F0F;"
            + HALF_PTX.format(lanes="0x4140", out="$0") + HALF_PTX.format(lanes="0x4342", out="$1") + "\n}")


DECODE_PTX = (decode_ptx(False), decode_ptx(True))
TILES = ((64, 128), (128, 64))  # (columns, K step)


def product(variant: str, M: int, N: int, K: int, bn: int, bk: int, interpret: bool = False):
    """The probe's pallas_call for `variant`: float32 [M, N]."""
    def kernel(x_ref, c_ref, s_ref, o_ref):
        cols = pl.ds(pl.program_id(0) * bn, bn)

        def step(i, acc):
            k0 = i * bk
            scales = s_ref[cols, pl.ds(packed_offset(k0, MXFP4_GROUP), bk // MXFP4_GROUP)]
            transposed = lambda w: lax.dot_general(w, x_ref[:, pl.ds(k0, bk)], (((1,), (1,)), ((), ())),
                                                   preferred_element_type=jnp.float32)
            if variant == "words":
                return acc + transposed(word_weights(c_ref[cols, pl.ds(packed_offset(k0, 8), bk // 8)], scales))
            codes = c_ref[cols, pl.ds(packed_offset(k0, 2), bk // 2)]
            if variant == "paired":
                return acc + transposed(paired_weights(codes, scales))
            product = lambda a, b: lax.dot_general(a, b.astype(a.dtype), (((1,), (1,)), ((), ())),
                                                   preferred_element_type=jnp.float32)
            if variant == "asm":
                low, high = (plgpu.elementwise_inline_asm(
                    ptx, args=[codes, per_byte(scales)], constraints="=r,=r,r,r", pack=4,
                    result_shape_dtypes=[jax.ShapeDtypeStruct((bn, bk // 2), jnp.bfloat16)])[0] for ptx in DECODE_PTX)
                even, odd = x_ref[:, pl.ds(k0, bk // 2, 2)], x_ref[:, pl.ds(k0 + 1, bk // 2, 2)]
                return acc + product(even, low) + product(odd, high)
            if variant == "bytes":
                return acc + product(x_ref[:, pl.ds(k0, bk)], decode(codes, per_byte(scale_power(scales))))
            power, ints = per_byte(scale_power(scales)), codes.astype(jnp.int32)
            if variant == "exact":
                return acc + product(x_ref[:, pl.ds(k0, bk)], decode(codes, power, exact_values))
            if variant == "split":
                even, odd = lax.unstack(x_ref[:, pl.ds(k0, bk)].reshape(M, bk // 2, 2), axis=2)
                return (acc + product(even, code_values(ints, high=False) * power)
                        + product(odd, code_values(ints, high=True) * power))
            w = codes.astype(jnp.float32)  # raw
            if variant == "low":
                w = exact_values(ints, high=False) * power
            return acc + product(x_ref[:, pl.ds(packed_offset(k0, 2), bk // 2)], w)

        if variant in ("paired", "words"):  # W^T x^T
            o_ref[:, cols] = lax.fori_loop(0, K // bk, step, jnp.zeros((bn, M), jnp.float32)).T
        else:
            o_ref[:, cols] = lax.fori_loop(0, K // bk, step, jnp.zeros((M, bn), jnp.float32))

    return lambda x, c, s: pl.pallas_call(
        kernel, grid=(N // bn,), in_specs=[pl.no_block_spec] * 3, out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3), interpret=interpret)(x, c, s)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="16,64,128")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU, interpret mode")
    args = p.parse_args()
    N, K = (256, 256) if args.tiny else (COLUMNS, DEPTH)
    blocks = jax.random.randint(jax.random.key(0), (N, K // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    scales = jax.random.randint(jax.random.key(1), (N, K // MXFP4_GROUP), 118, 124, jnp.int32).astype(jnp.uint8)
    words = lax.bitcast_convert_type(pack_words(blocks), jnp.int32)
    rates = common.measure_rates(args.tiny)
    floor_s = (blocks.nbytes + scales.nbytes) / (rates["copy_GBps"] * 1e9)
    rows = []
    for M in (int(r) for r in args.rows.split(",")):
        x = jax.random.normal(jax.random.key(2), (M, K), jnp.float32).astype(jnp.bfloat16)
        w = decode(blocks, jnp.repeat(scale_power(scales), MXFP4_GROUP // 2, axis=-1))
        reference = jnp.dot(x.astype(jnp.float32), w.T)
        del w
        for variant in VARIANTS[:-1] if args.tiny else VARIANTS:  # interpret mode runs no PTX
            for bn, bk in TILES:
                f = jax.jit(product(variant, M, N, K, bn, bk, args.tiny))
                codes = words if variant == "words" else blocks
                out = f(x, codes, scales)
                err = (float(jnp.max(jnp.abs(out - reference)) / jnp.max(jnp.abs(reference))) if variant in EXACT
                       else None)
                seconds = common.seconds_per_call(f, x, codes, scales)
                rows.append(dict(rows=M, variant=variant, columns=bn, k_step=bk, us=seconds * 1e6,
                                 floor_us=floor_s * 1e6, over_floor=seconds / floor_s, max_rel_err=err))
                print(rows[-1], flush=True)
                common.write_json(args.out / ("mxfp4_probe_tiny.json" if args.tiny else "mxfp4_probe.json"), dict(common.run_info(), rates=rates, rows=rows))
    print(common.markdown_table(rows, [("rows", "rows", "d"), ("variant", "variant", "s"), ("columns", "columns", "d"),
                              ("K step", "k_step", "d"), ("µs", "us", ".1f"), ("x floor", "over_floor", ".2f")]))


if __name__ == "__main__":
    main()
