"""NSA verification of draft-tree rows (SSV grouped kernel, pallas_kernels/nsa_grouped.py): time per
layer call by grouping mode against a bytes floor, for trees of 8, 16, 32 and 63 draft nodes.

    PYTHONPATH=. python3 bench/nsa_verify_kernel.py [--grid default|full|TREE@CONTEXT;...]
        [--models smollm2,nsa-1b] [--batches 1,8] [--modes vanilla,exact g4,...] [--noise 0.3]
        [--backend pallas|reference]
        [--budget SECONDS] [--tiny] [--out DIR]

Shapes (bf16, one layer's attention, two cache layers that the calls alternate): NSA SmolLM2 (9 q /
3 KV heads, head dim 64) and NSA-1B (32 q / 2 KV heads, head dim 64); block 16, S = 16 selected
blocks (nsa1b rule), window 128. Trees are BFS (TreeShape): "chainN" is N drafts in a chain,
"3,4,4" a branching per depth; the root sits at position context + 5 (mid-block), so the committed
prefix is context + 5 tokens; the cache is sized to the tree's end, a pool of 128-slot pages (the rows'
consecutive: `paging.contiguous_pages`).

Selection: queries = a shared random vector per (sequence, head) + noise x a per-row draw, so
adjacent rows' compressed scores, hence their blocks, overlap as real draft rows' do; idx comes from
those scores (nsa_tree_compressed + select_blocks). `overlap` = mean over (sequence, KV head, group)
of union size / (rows in the group x S): 1 means no two rows share a block.

Modes (--modes, default all): vanilla (group 1: each row its own program), exact groups of 4, 8, 16
(lossless), shared index groups of 8 (the group's first row's blocks); each "reuse" (idx given: the grouped selected +
window kernel alone, a reuse layer) and "refresh" (nsa_tree_attention: compressed branch, radix
select, grouped kernel); "jnp-cmp" modes (refresh only): the compressed branch on the jnp reference,
as before its Pallas kernels, for an A/B in one run. Each mode is checked before it is timed: exact modes against the vanilla
output (1e-2 of its largest magnitude), vanilla and shared against the jnp references (2e-2).

Timing: one jitted program of CALLS + 1 calls (a fori_loop of CALLS, each call's first element
summed so none is dropped or hoisted, plus one call whose output is checked), timed after its compile
run by bench.common.seconds_per_call (median of 3 runs of back-to-back programs). Floor: the unique
bytes the rows need, per sequence and KV head: the union over ALL rows of their selected blocks'
committed keys, the window span and the tree slots (k and v each), the compressed k and v of the
committed blocks (refresh only), plus q, gates and output; over the copy bandwidth measured in the
same run. `loaded MB`: the selected blocks' bytes the grid loads (the groups' union sizes x a
block's k and v; vanilla: every row's own blocks).

Grids (TREE@CONTEXT items, each for every model and batch, headline items first): default = the
branching trees of 63, 32, 16 and 8 nodes at 32K, then the 63-node tree at 8K and 64K; full = both
trees of each node count (a chain and a branching tree) at 8K, 16K, 32K, 64K. Items that would start
after --budget seconds (default 330: about 6 minutes with the rates) are skipped and listed.
Writes DIR/nsa_verify_kernel_<device>.json after every item and prints a markdown table last.
--tiny: one small tree at a 512-token context, batch 1, on the current backend (on a CPU the Pallas
kernel runs in interpret mode): a smoke test, not for time.
"""
from __future__ import annotations

import argparse
import functools
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench import common
import pallas_kernels as kernels
from jaxspec.decoding.tree import TreeShape
from pallas_kernels import paging
from pallas_kernels._common import interpret_default
from pallas_kernels.nsa_compressed import radix_topk, select_blocks
from pallas_kernels.nsa_grouped import group_schedule, nsa_grouped_pallas, nsa_tree_compressed

MODELS = {"smollm2": (9, 3, 64), "nsa-1b": (32, 2, 64)}  # (q heads, KV heads, head dim)
BLOCK, SELECTED, WINDOW, RULE = 16, 16, 128, "nsa1b"
ROOT_OFFSET = 5
K = 1024
TREES = {8: ("chain8", "2,3"), 16: ("chain16", "4,3"), 32: ("chain32", "2,3,4"), 63: ("chain63", "3,4,4")}
DEFAULT_GRID = [("3,4,4", 32 * K), ("2,3,4", 32 * K), ("4,3", 32 * K), ("2,3", 32 * K), ("3,4,4", 8 * K),
                ("3,4,4", 64 * K)]
FULL_GRID = [(tree, c * K) for c in (8, 16, 32, 64) for trees in TREES.values() for tree in trees]
TINY_GRID = [("2,3", 512)]
MODES = [("vanilla", 1, False), ("exact g4", 4, False), ("exact g8", 8, False), ("exact g16", 16, False),
         ("shared g8", 8, True), ("vanilla jnp-cmp", 1, False), ("exact g4 jnp-cmp", 4, False)]
CALLS, LAYERS = 20, 2
PAGE = paging.DEFAULT_PAGE_SIZE
TOL_EXACT, TOL_REFERENCE = 1e-2, 2e-2


def parse_tree(text: str) -> TreeShape:
    if text.startswith("chain"):
        return TreeShape.chain(int(text[5:]))
    return TreeShape.parse(text, "bfs")


def parse_grid(text: str):
    if text == "default":
        return DEFAULT_GRID
    if text == "full":
        return FULL_GRID
    items = [item.split("@") for item in text.split(";")]
    return [(tree, int(context)) for tree, context in items]


def rel_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


# ---------------------------------------------------------------- inputs

def inputs(model: str, batch: int, context: int, tree: TreeShape, noise: float, seed: int) -> dict:
    """Random bf16 pools (LAYERS layers; k_cmp/v_cmp the block means) and their page table,
    correlated queries, gates after the sigmoid, the roots' slots, and the rows' own selection of
    layer 0 (idx)."""
    Hq, Hkv, Dh = MODELS[model]
    T = tree.rows
    first = context + ROOT_OFFSET
    R = -(-(first + T) // PAGE)
    keys = jax.random.split(jax.random.key(seed), 5)
    shape = (LAYERS, Hkv, (batch * R + 1) * PAGE, Dh)
    k, v = common.random_layers(keys[0], shape, jnp.bfloat16), common.random_layers(keys[1], shape, jnp.bfloat16)
    means = lambda x: common.block_means(x[:, None], BLOCK)[:, 0]  # a compressed pool's entries: its slots' means
    base = jax.random.normal(keys[2], (batch, 1, Hq, Dh), jnp.float32)
    q = (base + noise * jax.random.normal(keys[3], (batch, T, Hq, Dh), jnp.float32)).astype(jnp.bfloat16)
    state = {"q": q, "k": k, "v": v, "k_cmp": means(k), "v_cmp": means(v), "pages": paging.contiguous_pages(batch, R),
             "gates": jax.nn.sigmoid(jax.random.normal(keys[4], (batch, T, Hq, 3), jnp.float32)).astype(jnp.bfloat16),
             "first": jnp.full((batch,), first, jnp.int32)}

    @jax.jit
    def selection(s):
        _, weights, q_pos = nsa_tree_compressed(s["q"], s["k"], s["v"], s["k_cmp"], s["v_cmp"], s["pages"], 0,
                                                s["first"], tree.ancestors, page_size=PAGE, block_size=BLOCK,
                                                scale=Dh**-0.5)
        return select_blocks(weights, q_pos, block_size=BLOCK, block_counts=SELECTED, rule=RULE)

    return state | {"idx": selection(state)}


# ---------------------------------------------------------------- bytes

def schedule_stats(s: dict, tree: TreeShape, group: int, shared: bool) -> dict:
    """The mode's rows' blocks (row_idx), the groups' overlap and the selected bytes its grid loads."""
    sched = jax.jit(functools.partial(group_schedule, depth=tree.node_depth, group=group, shared=shared,
                                      block_size=BLOCK))(s["idx"], s["first"])
    count, T = np.asarray(sched.count), tree.rows
    g = sched.member.shape[-1]
    rows = np.minimum(g, T - np.arange(count.shape[-1]) * g)                    # rows per group
    Dh = s["q"].shape[-1]
    return {"row_idx": np.asarray(sched.row_idx), "overlap": float((count / (rows * SELECTED)).mean()),
            "loaded_MB": float(count.sum()) * BLOCK * 2 * Dh * 2 / 1e6}


def floor_bytes(s: dict, tree: TreeShape, row_idx: np.ndarray, reuse: bool) -> dict:
    """Unique bytes by part (see the module docstring)."""
    B, T, Hq, Dh = s["q"].shape
    Hkv = s["k"].shape[1]
    key = 2 * Dh * 2                                                             # k and v of one key, bf16
    first = np.asarray(s["first"])
    selected = window = 0
    for b, h in np.ndindex(B, Hkv):
        seen = np.zeros(first[b], bool)
        for c in np.unique(row_idx[b, :, h]):
            if c >= 0:
                seen[c * BLOCK : (c + 1) * BLOCK] = True                        # committed slots only
        lo = max(first[b] - WINDOW + 1, 0)                                       # the root is the shallowest row
        window += int(first[b] - lo)
        selected += int(seen[:lo].sum())
    parts = {"selected": selected * key, "window": window * key, "tree": B * Hkv * T * key,
             "q_gates_out": B * T * Hq * (2 * Dh + 3) * 2}
    if not reuse:
        parts["compressed"] = int((first // BLOCK).sum()) * Hkv * key
    return parts


# ---------------------------------------------------------------- timing

def timed_program(tree: TreeShape, group: int, shared: bool, reuse: bool, backend: str, jnp_compressed: bool):
    """jit(state) -> (sum of CALLS calls' first elements, one call's output [B, T, Hq, Dh]); calls
    alternate between the cache layers, so none is loop-invariant. jnp_compressed: the refresh
    layer's compressed branch on the jnp reference (the path before its Pallas kernels), the rest
    as nsa_tree_attention runs it."""
    def call(layer, s):
        Dh = s["q"].shape[-1]
        idx = s["idx"] if reuse else None
        if jnp_compressed:
            o_cmp, weights, q_pos = nsa_tree_compressed(s["q"], s["k"], s["v"], s["k_cmp"], s["v_cmp"], s["pages"],
                                                        layer, s["first"], tree.ancestors, page_size=PAGE,
                                                        block_size=BLOCK, scale=Dh**-0.5)
            topk = functools.partial(radix_topk, interpret=interpret_default())
            idx = select_blocks(weights, q_pos, block_size=BLOCK, block_counts=SELECTED, rule=RULE, topk=topk)
            return nsa_grouped_pallas(s["q"], s["k"], s["v"], s["pages"], layer, s["first"], tree.ancestors, idx,
                                      o_cmp, s["gates"], page_size=PAGE, group=group, shared=shared, block_size=BLOCK,
                                      window=WINDOW, scale=Dh**-0.5, interpret=interpret_default())
        return kernels.nsa_tree_attention(
            s["q"], s["k"], s["v"], s["k_cmp"], s["v_cmp"], s["pages"], layer, s["first"], tree.ancestors, s["gates"],
            idx, page_size=PAGE, group=group, shared=shared, block_size=BLOCK, block_counts=SELECTED,
            window=WINDOW, rule=RULE, scale=Dh**-0.5, backend=backend)[0]

    def run(s):
        body = lambda i, acc: acc + call(lax.rem(i, LAYERS), s)[0, 0, 0, 0].astype(jnp.float32)
        return lax.fori_loop(0, CALLS, body, jnp.float32(0)), call(0, s)

    return jax.jit(run)


def first_run(f, s) -> tuple[jax.Array, float]:
    """(the checked call's output, compile + first run seconds)."""
    start = time.perf_counter()
    _, out = jax.block_until_ready(f(s))
    return out, time.perf_counter() - start


def references(s: dict, tree: TreeShape) -> dict:
    """{(shared, reuse): layer 0's output on the reference backend} (groups of 8; exact groups are
    the per-row result whatever the group)."""
    @functools.partial(jax.jit, static_argnames=("shared", "reuse"))
    def reference(s, shared, reuse):
        Dh = s["q"].shape[-1]
        return kernels.nsa_tree_attention(
            s["q"], s["k"], s["v"], s["k_cmp"], s["v_cmp"], s["pages"], 0, s["first"], tree.ancestors, s["gates"],
            s["idx"] if reuse else None, page_size=PAGE, group=8, shared=shared, block_size=BLOCK,
            block_counts=SELECTED, window=WINDOW, rule=RULE, scale=Dh**-0.5, backend="reference")[0]

    return {(shared, reuse): reference(s, shared=shared, reuse=reuse)
            for shared in (False, True) for reuse in (True, False)}


def bench_item(result: dict, model: str, batch: int, context: int, tree_text: str, args, bandwidth: float):
    tree = parse_tree(tree_text)
    s = inputs(model, batch, context, tree, args.noise, seed=batch * 131 + context + tree.rows)
    refs = references(s, tree)
    modes = [m for m in MODES if m[0] in args.modes]
    stats = {mode: schedule_stats(s, tree, group, shared) for mode, group, shared in modes}
    base = {"model": model, "batch": batch, "context": context, "tree": tree_text, "nodes": tree.rows - 1,
            "depth": tree.depth}
    for reuse in (True, False):
        vanilla = None
        for mode, group, shared in modes:
            jnp_compressed = mode.endswith("jnp-cmp")
            if jnp_compressed and reuse:
                continue
            f = timed_program(tree, group, shared, reuse, args.backend, jnp_compressed)
            out, compile_s = first_run(f, s)
            if group == 1 or shared:
                error = {"err_vs_reference": rel_error(out, refs[(shared, reuse)])}
                ok = error["err_vs_reference"] < TOL_REFERENCE
            else:
                error = {"err_vs_vanilla": rel_error(out, vanilla["out"])}
                ok = error["err_vs_vanilla"] < TOL_EXACT
            seconds = common.seconds_per_call(f, s) / (CALLS + 1)
            if vanilla is None:
                vanilla = {"out": out, "us": seconds * 1e6}
            parts = floor_bytes(s, tree, stats[mode]["row_idx"], reuse)
            floor_us = sum(parts.values()) / (bandwidth * 1e9) * 1e6
            row = base | {"mode": mode, "group": group, "shared": shared, "reuse": reuse,
                          "layer": "reuse" if reuse else "refresh", "us": seconds * 1e6,
                          "speedup_vs_vanilla": vanilla["us"] / (seconds * 1e6), "floor_us": floor_us,
                          "x_floor": seconds * 1e6 / floor_us, "floor_bytes": parts, "compile_s": compile_s,
                          "overlap": None if group == 1 or shared else stats[mode]["overlap"],
                          "loaded_MB": stats[mode]["loaded_MB"], "checked": ok} | error
            result["rows"].append(row)
            overlap = "-" if row["overlap"] is None else f"{row['overlap']:.2f}"
            print(f"{model} B={batch} C={context} {tree_text} {row['layer']} {mode}: "
                  f"{row['us']:.1f} us ({row['speedup_vs_vanilla']:.2f}x vanilla, {row['x_floor']:.2f}x floor), "
                  f"overlap {overlap}, compile {compile_s:.1f} s{'' if ok else '  CHECK FAILED'}", flush=True)


# ---------------------------------------------------------------- main

def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", default="default", help="default | full | TREE@CONTEXT;... ('3,4,4@32768;chain8@8192')")
    p.add_argument("--models", default="smollm2,nsa-1b")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--modes", type=lambda text: text.split(","), default=[m[0] for m in MODES],
                   help="comma-separated, the first is the baseline (vanilla): " + ",".join(m[0] for m in MODES))
    p.add_argument("--noise", type=float, default=0.3, help="per-row query noise relative to the shared query")
    p.add_argument("--backend", default="pallas")
    p.add_argument("--budget", type=float, default=330.0, help="seconds; later items are skipped and listed")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    return p.parse_args()


def main():
    args = parse_args()
    grid = TINY_GRID if args.tiny else parse_grid(args.grid)
    batches = [1] if args.tiny else [int(b) for b in args.batches.split(",")]
    models = args.models.split(",")
    device = "cpu" if jax.default_backend() == "cpu" else jax.devices()[0].device_kind.split()[1].lower()
    path = args.out / f"nsa_verify_kernel_{device}.json"
    rates = common.measure_rates(args.tiny)
    result = common.run_info() | {
        "rates": rates, "rows": [], "errors": [], "skipped": [], "noise": args.noise, "calls": CALLS + 1,
        "nsa": {"block_size": BLOCK, "block_counts": SELECTED, "window": WINDOW, "rule": RULE},
        "models": {m: dict(zip(("q_heads", "kv_heads", "head_dim"), MODELS[m])) for m in models},
        "trees": {text: {"rows": parse_tree(text).rows, "branching": parse_tree(text).branching}
                  for text in dict.fromkeys(tree for tree, _ in grid)}}
    for text, info in result["trees"].items():
        print(f"tree {text}: {info['rows'] - 1} nodes, branching {info['branching']}", flush=True)
    start = time.perf_counter()
    for tree_text, context in grid:
        for model in models:
            for batch in batches:
                what = f"{model} B={batch} C={context} {tree_text}"
                if time.perf_counter() - start > args.budget:
                    result["skipped"].append(what)
                    continue
                try:
                    bench_item(result, model, batch, context, tree_text, args, rates["copy_GBps"])
                except Exception as e:  # noqa: BLE001  (one failure must not end the run)
                    message = "".join(traceback.format_exception_only(e)).strip()[:600]
                    result["errors"].append({"item": what, "error": message})
                    print(f"ERROR {what}: {message}", flush=True)
                common.write_json(path, result)
    result["total_s"] = time.perf_counter() - start
    common.write_json(path, result)
    print(f"\n{len(result['rows'])} rows, errors {len(result['errors'])}, skipped {len(result['skipped'])} "
          f"({', '.join(result['skipped']) or 'none'}); {result['total_s']:.0f} s; JSON: {path}\n")
    columns = [("model", "model", "s"), ("B", "batch", "d"), ("context", "context", "d"), ("tree", "tree", "s"),
               ("nodes", "nodes", "d"), ("layer", "layer", "s"), ("mode", "mode", "s"), ("us", "us", ".1f"),
               ("x vanilla", "speedup_vs_vanilla", ".2f"), ("floor us", "floor_us", ".1f"),
               ("x floor", "x_floor", ".2f"), ("overlap", "overlap", ".2f"), ("loaded MB", "loaded_MB", ".2f"),
               ("checked", "checked", "")]
    print(common.markdown_table(result["rows"], columns))


if __name__ == "__main__":
    main()
