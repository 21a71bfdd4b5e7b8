"""One MoE layer's routed experts: the Pallas kernel against XLA's grouped product and the bytes floor.

    PYTHONPATH=. python3 bench/moe.py [--format bf16|mxfp4] [--model qwen3-30b-a3b|gpt-oss-20b]
        [--rows 1,8,32,128] [--decodes paired,words,words-two,scale-words] [--stages 3,4] [--warps 4,8]
        [--word-columns 32,64] [--one-row-programs 256,512] [--one-row-down-programs 256,512]
        [--one-row-down-step 8192,16384] [--tiles-in-flight 1,2]
        [--fused-columns 32:256,64:256] [--fused-step 4096,8192] [--fused-warps 4,8]
        [--implementations reference,split_k,fused] [--out DIR] [--tiny]

With bf16 experts at Qwen3-30B-A3B's shapes (D 2048, F 768, 128 experts, 8 routed a row), or MXFP4 experts (random
codes and scales, pallas_kernels.mxfp4.MXFP4) at gpt-oss-20b's (D = F = 2880, 32 experts, 4 routed a row), or either
format at the other model's shapes (`--model`), and T rows with random routing, it times up to five implementations
as the decoder's layer scan would call them, at a traced layer of the stacks: the kernel's four forms (row blocks
through the matrix unit; one row at a time in registers; row blocks of wide column blocks with K split among
programs; float stacks only: gate/up and down in one call, F split among programs; `rule` names the one the kernel
picks at T) and the reference (lax.ragged_dot; MXFP4 dequantized first). The floor is the routed experts' bytes
(MXFP4: packed bytes and scales): the distinct experts hit times one expert's bytes, over the copy bandwidth
measured in the same run. Each timed call is one of REPEATS in a scan, each with its own routing and alternating
between the two layers of the stacks, so no call finds its experts in L2. On a GPU each timed call is then traced
once more: `<form>_kernel_us` is the device time of the experts kernels alone (moe_gate_up, moe_down, moe_fused),
`<form>_busy_us` of all the call's kernels, a layer each, and `<form>_kernels` each kernel's (name, µs, count) a
layer; the wall time also holds the scan's own per-item work and gaps, which a model's layer pays once for all its
kernels. Every kernel form's outputs are checked against the reference first (`max_rel_err`). MXFP4's `--decodes`:
each row count is timed with each decode of the codes in the kernels (`exact`: `mxfp4.e2m1`; `placed`:
`mxfp4.PLACED_DECODE`, the codes' bits placed, exact only where float32 subnormals are kept: `max_rel_err` tells;
`paired`: `placed`, and the row blocks' bf16 products through `moe.PAIRED_DECODE`, a byte's two codes into one
bf16x2 word in inline PTX; `words`: the stacks re-packed once as `mxfp4.to_words` words, which the row-block and
one-row forms read, a word's 8 codes into 4 bf16x2 words, one multiply each (the random scales are at most 128:
`MXFP4.small_scales`); `words-two`: the same with two multiplies, as scales above 128 take; `scale-words`: `words`
with the scales four to a word, `mxfp4.pack_scales`), in this process, the compiled programs dropped between them.
Writes DIR/moe.json (mxfp4: moe_mxfp4.json; with --model its name after the format's, moe_gpt-oss-20b.json; --tiny:
moe_tiny.json / moe_mxfp4_tiny.json, small shapes on the CPU, the kernel in interpret mode: a smoke test of this
script) and prints a table last.
"""
from __future__ import annotations

import argparse
import itertools
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench import common
from bench.profile_step import busy_ns, device_events, top
import pallas_kernels as kernels
from pallas_kernels import moe, mxfp4
from pallas_kernels.moe import default_form, moe_experts_pallas
from pallas_kernels.mxfp4 import MXFP4

expert_shape = lambda cfg: dict(D=cfg.hidden_size, F=cfg.moe.expert_size, E=cfg.moe.num_experts, k=cfg.moe.top_k)
MODELS = {"qwen3-30b-a3b": common.QWEN3_30B_A3B, "gpt-oss-20b": common.GPT_OSS_20B}
SHAPES = {"bf16": expert_shape(common.QWEN3_30B_A3B), "mxfp4": expert_shape(common.GPT_OSS_20B)}  # each format's model
TINY = dict(D=64, F=32, E=8, k=2)
LAYERS = 2
REPEATS = 8


def routing(key, repeats: int, T: int, E: int, k: int):
    """(expert_ids [repeats, T, k] int32, k distinct random experts a row; router weights [repeats, T, k])."""
    k1, k2 = jax.random.split(key)
    ids = jnp.argsort(jax.random.uniform(k1, (repeats, T, E)), axis=-1)[..., :k].astype(jnp.int32)
    return ids, jax.nn.softmax(jax.random.normal(k2, (repeats, T, k)), axis=-1)


KERNELS = ("moe_gate_up", "moe_down", "moe_fused")  # the experts kernels' names in a trace (moe._slot_call)
IMPLEMENTATIONS = {"reference": "XLA", "row_blocks": "row-block kernel", "one_row": "one-row kernel",
                   "split_k": "split-K kernel", "fused": "fused kernel"}


def experts(implementation: str, *args, stages: int = 3, warps: int = 4):
    """One layer's routed experts by XLA's grouped product, or the kernel in one of its forms (`stages`:
    its pipeline's; `warps`: num_warps, which narrow row blocks of words leave at NARROW_WORD_WARPS)."""
    if implementation == "reference":
        return kernels.moe_experts(*args, backend="reference")
    return moe_experts_pallas(*args, interpret=kernels.interpret_default(), form=implementation, num_stages=stages,
                              num_warps=warps)


def layer_fn(implementation: str, stages: int, warps: int):
    """A jitted scan of one MoE layer's experts per (layer, routing) item; returns the outputs' sum."""
    @jax.jit
    def run(x, ids, weights, w_gate_up, w_down):
        def body(total, item):
            layer, ids, weights = item
            out = experts(implementation, x, ids, weights, w_gate_up, w_down, layer, stages=stages, warps=warps)
            return total + out.sum(), None

        layers = jnp.arange(ids.shape[0], dtype=jnp.int32) % LAYERS
        return lax.scan(body, jnp.float32(0), (layers, ids, weights))[0]

    return run


def traced_us(fn, args, repeats: int) -> dict:
    """{kernel_us, busy_us, kernels}: a timed item's device time in the experts kernels and in all its kernels,
    and every kernel's (name, µs, count) an item, from one traced call (GPU only: the CPU's trace holds host
    threads)."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(fn(*args))
        events = [e for line, line_events in device_events(trace_dir).items() if line.startswith("Stream")
                  for e in line_events]
    kernel_ns = sum(duration for name, _, duration in events if name.startswith(KERNELS))
    return {"kernel_us": kernel_ns / repeats / 1e3, "busy_us": busy_ns(events) / repeats / 1e3,
            "kernels": top(events, repeats, len(events))}


def random_stacks(fmt: str, shape: dict):
    """(w_gate_up, w_down) of LAYERS layers: standard-normal bf16, or MXFP4 (common.random_mxfp4)."""
    D, F, E = shape["D"], shape["F"], shape["E"]

    def stack(key, K, N):
        if fmt == "bf16":
            return common.random_layers(key, (LAYERS, E, K, N), jnp.bfloat16)
        return common.random_mxfp4(key, (LAYERS, E, K, N))

    return stack(jax.random.key(0), D, 2 * F), stack(jax.random.key(1), F, D)


def time_rows(T: int, shape: dict, repeats: int, stacks, bw: float, stages: int, warps: int, chosen) -> dict:
    """One row count's times of each `chosen` implementation that reads `stacks` (MXFP4: not the fused
    form; words: nor split K), checked against the reference first."""
    packed = isinstance(stacks[0], MXFP4)
    words = packed and stacks[0].words
    implementations = tuple(i for i in IMPLEMENTATIONS if i in chosen + ["reference"]
                            and not (packed and i == "fused") and not (words and i == "split_k"))
    D, E, k = shape["D"], shape["E"], shape["k"]
    x = jax.random.normal(jax.random.key(T), (T, D), jnp.bfloat16)
    ids, weights = routing(jax.random.key(1000 + T), repeats, T, E, k)
    layer = jnp.int32(1)
    want = experts("reference", x, ids[0], weights[0], *stacks, layer)
    errors = [float(jnp.abs(experts(i, x, ids[0], weights[0], *stacks, layer) - want).max() / jnp.abs(want).max())
              for i in implementations[1:]]
    distinct = float(np.mean([len(np.unique(np.asarray(i))) for i in ids]))
    expert_bytes = sum(a.nbytes for a in jax.tree.leaves(stacks)) / (LAYERS * E)
    floor_us = distinct * expert_bytes / (bw * 1e9) * 1e6
    rule = default_form(T, isinstance(stacks[0], MXFP4), D)
    row = {"rows": T, "distinct_experts": distinct, "floor_us": floor_us, "max_rel_err": max(errors), "rule": rule}
    for implementation in implementations:
        fn, args = layer_fn(implementation, stages, warps), (x, ids, weights, *stacks)
        us = common.seconds_per_call(fn, *args) / repeats * 1e6
        row |= {f"{implementation}_us": us, f"{implementation}_over_floor": us / floor_us}
        if jax.default_backend() == "gpu":
            traced = traced_us(fn, args, repeats)
            row |= {f"{implementation}_busy_us": traced["busy_us"], f"{implementation}_kernels": traced["kernels"]}
            if implementation != "reference":  # XLA's grouped product runs no experts kernel
                row |= {f"{implementation}_kernel_us": traced["kernel_us"],
                        f"{implementation}_kernel_over_floor": traced["kernel_us"] / floor_us}
    return row


DECODES = ("exact", "placed", "paired", "words", "words-two", "scale-words")


def main():
    ints = lambda text: [int(n) for n in text.split(",")]  # a comma-separated sweep
    pairs = lambda text: [tuple(int(n) for n in pair.split(":")) for pair in text.split(",")]  # of a:b pairs
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--format", choices=tuple(SHAPES), default="bf16",
                   help="the experts' format (and model: bf16 Qwen3-30B-A3B, mxfp4 gpt-oss-20b)")
    p.add_argument("--model", choices=tuple(MODELS), default=None,
                   help="the experts' shapes of this model instead of the format's own (e.g. gpt-oss-20b's unquantized "
                        "experts: --format bf16 --model gpt-oss-20b)")
    p.add_argument("--rows", default="1,8,32,128", help="token rows T, comma-separated")
    p.add_argument("--decodes", default="paired", type=lambda s: s.split(","),
                   help="MXFP4: the kernels' decodes to time, of placed (mxfp4.PLACED_DECODE), exact, paired "
                        "(moe.PAIRED_DECODE, the default), words, words-two and scale-words (mxfp4.to_words "
                        "stacks: no split-K form; one multiply an output, or two; scales four to a word)")
    p.add_argument("--stages", default="3", type=ints,
                   help="the kernels' pipeline stages to time, comma-separated (num_stages)")
    p.add_argument("--warps", default="4", type=ints,
                   help="the kernels' warps a program to time, comma-separated (num_warps)")
    p.add_argument("--word-columns", default="32", type=ints,
                   help="words: the narrowest column blocks to time, comma-separated (moe.WORD_MIN_COLUMNS)")
    p.add_argument("--one-row-programs", default=str(moe.ONE_ROW_PROGRAMS), type=ints,
                   help="the one-row form's programs at least, comma-separated (moe.ONE_ROW_PROGRAMS)")
    p.add_argument("--one-row-down-programs", default=str(moe.ONE_ROW_DOWN_PROGRAMS), type=ints,
                   help="the one-row form's down programs at least, comma-separated (moe.ONE_ROW_DOWN_PROGRAMS)")
    p.add_argument("--one-row-down-step", default=str(moe.ONE_ROW_DOWN_STEP_ELEMENTS), type=ints,
                   help="the one-row form's down weights of a column block a loop step, comma-separated "
                        "(moe.ONE_ROW_DOWN_STEP_ELEMENTS)")
    p.add_argument("--row-step-elements", default=str(moe.ROW_STEP_ELEMENTS), type=ints,
                   help="the one-row form's gate/up weights of a column block a loop step, comma-separated "
                        "(moe.ROW_STEP_ELEMENTS; down's: --one-row-down-step)")
    p.add_argument("--tiles-in-flight", default=str(moe.ROW_TILES_IN_FLIGHT), type=ints,
                   help="the one-row form's column blocks' tiles loading ahead, comma-separated "
                        "(moe.ROW_TILES_IN_FLIGHT)")
    p.add_argument("--split-columns", default=f"{moe.SPLIT_GATE_UP_COLUMNS}:{moe.SPLIT_DOWN_COLUMNS}",
                   type=pairs,
                   help="the split-K form's column blocks, gate/up:down pairs, comma-separated "
                        "(moe.SPLIT_GATE_UP_COLUMNS, moe.SPLIT_DOWN_COLUMNS)")
    p.add_argument("--split-programs", default=str(moe.SPLIT_PROGRAMS), type=ints,
                   help="the split-K form's programs about, comma-separated (moe.SPLIT_PROGRAMS)")
    p.add_argument("--fused-columns", default=f"{moe.FUSED_COLUMNS}:{moe.FUSED_DOWN_COLUMNS}",
                   type=pairs,
                   help="the fused form's columns of F a program and down's columns a step, F:D pairs, "
                        "comma-separated (moe.FUSED_COLUMNS, moe.FUSED_DOWN_COLUMNS)")
    p.add_argument("--fused-step", default=str(moe.FUSED_STEP_ELEMENTS), type=ints,
                   help="the fused form's gate weights a loop step, comma-separated (moe.FUSED_STEP_ELEMENTS)")
    p.add_argument("--fused-warps", default=str(moe.FUSED_WARPS), type=ints,
                   help="the fused form's warps a program, comma-separated (moe.FUSED_WARPS; --warps: the others')")
    p.add_argument("--implementations", default=",".join(IMPLEMENTATIONS), type=lambda s: s.split(","),
                   help=f"which to time, comma-separated, of {', '.join(IMPLEMENTATIONS)} (the reference always: "
                        "the check)")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--tiny", action="store_true", help="small shapes on the CPU: a smoke test of this script")
    args = p.parse_args()
    if unknown := set(args.decodes) - set(DECODES):
        p.error(f"unknown decodes {sorted(unknown)}: {', '.join(DECODES)}")
    if unknown := set(args.implementations) - set(IMPLEMENTATIONS):
        p.error(f"unknown implementations {sorted(unknown)}: {', '.join(IMPLEMENTATIONS)}")
    model_shape = expert_shape(MODELS[args.model]) if args.model else SHAPES[args.format]
    shape, repeats = (TINY, 2) if args.tiny else (model_shape, REPEATS)
    rows = [1, 8] if args.tiny else [int(r) for r in args.rows.split(",")]
    result = common.run_info() | {"format": args.format, "shape": shape, "layers": LAYERS, "repeats": repeats,
                                  "rates": common.measure_rates(args.tiny), "rows": []}
    stacks = random_stacks(args.format, shape)
    name = ("moe" + ("_mxfp4" if args.format == "mxfp4" else "") + (f"_{args.model}" if args.model else "")
            + ("_tiny" if args.tiny else ""))
    path = args.out / f"{name}.json"
    decodes = args.decodes if args.format == "mxfp4" else ["exact"]
    for T in rows:
        for decode in decodes:
            mxfp4.PLACED_DECODE, moe.PAIRED_DECODE = decode in ("placed", "paired"), decode == "paired"
            words = decode in ("words", "words-two", "scale-words")
            timed = tuple(mxfp4.to_words(w, small_scales=decode != "words-two", scale_words=decode == "scale-words")
                          for w in stacks) if words else stacks
            sweep = itertools.product(args.word_columns if words else [None], args.stages, args.warps,
                                      args.one_row_programs, args.one_row_down_programs, args.tiles_in_flight,
                                      args.row_step_elements, args.one_row_down_step,
                                      args.split_columns, args.split_programs, args.fused_columns, args.fused_step,
                                      args.fused_warps)
            for (columns, stages, warps, programs, down_programs, in_flight, row_step, down_step, split,
                 split_programs, *fused) in sweep:
                moe.ONE_ROW_PROGRAMS, moe.ONE_ROW_DOWN_PROGRAMS = programs, down_programs
                moe.ROW_TILES_IN_FLIGHT, moe.ROW_STEP_ELEMENTS = in_flight, row_step
                moe.ONE_ROW_DOWN_STEP_ELEMENTS = down_step
                (moe.SPLIT_GATE_UP_COLUMNS, moe.SPLIT_DOWN_COLUMNS), moe.SPLIT_PROGRAMS = split, split_programs
                (moe.FUSED_COLUMNS, moe.FUSED_DOWN_COLUMNS), moe.FUSED_STEP_ELEMENTS, moe.FUSED_WARPS = fused
                if columns:
                    moe.WORD_MIN_COLUMNS = columns
                jax.clear_caches()
                row = time_rows(T, shape, repeats, timed, result["rates"]["copy_GBps"], stages, warps,
                                args.implementations)
                result["rows"].append({"decode": decode, "word_columns": columns, "stages": stages, "warps": warps,
                                       "one_row_programs": programs, "one_row_down_programs": down_programs,
                                       "tiles_in_flight": in_flight,
                                       "row_step_elements": row_step, "one_row_down_step": down_step,
                                       "split_columns": f"{split[0]}:{split[1]}",
                                       "split_programs": split_programs, "fused_columns": "{}:{}".format(*fused[0]),
                                       "fused_step": fused[1], "fused_warps": fused[2]} | row)
                print(result["rows"][-1], flush=True)
                common.write_json(path, result)
    print(common.markdown_table(result["rows"], [
        ("T", "rows", "d"), ("decode", "decode", "s"), ("word columns", "word_columns", "d"), ("stages", "stages", "d"),
        ("warps", "warps", "d"), ("one-row programs", "one_row_programs", "d"),
        ("one-row down programs", "one_row_down_programs", "d"),
        ("tiles in flight", "tiles_in_flight", "d"), ("gate/up row step", "row_step_elements", "d"),
        ("one-row down step", "one_row_down_step", "d"),
        ("split columns", "split_columns", "s"), ("split programs", "split_programs", "d"),
        ("fused columns", "fused_columns", "s"), ("fused step", "fused_step", "d"), ("fused warps", "fused_warps", "d"),
        ("experts hit", "distinct_experts", ".1f"), ("floor µs", "floor_us", ".1f"),
        *[c for i, name in IMPLEMENTATIONS.items()
          for c in ((f"{name} µs", f"{i}_us", ".1f"), (f"{name} / floor", f"{i}_over_floor", ".2f"),
                    *([] if i == "reference" else [("its kernels µs", f"{i}_kernel_us", ".1f"),
                                                   ("kernels / floor", f"{i}_kernel_over_floor", ".2f")]),
                    ("busy µs", f"{i}_busy_us", ".1f"))],
        ("rule", "rule", "s"), ("max rel err", "max_rel_err", ".1e")]))


if __name__ == "__main__":
    main()
