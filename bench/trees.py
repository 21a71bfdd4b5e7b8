"""Draft trees against chains on SmolLM2 (real weights): end-to-end decode speed and tokens per
iteration per method and shape, and the verify pass against its floor as the node count grows.

    PYTHONPATH=. python3 bench/trees.py [--part e2e|verify|both] [--batches 1,8,32]
        [--methods vegas,stream,ngram] [--shapes chain:6,chain:15,bfs:3,2,1,dfs:3,2,1]
        [--prompt-tokens 7000] [--new 256] [--repeats 3] [--tiny] [--out DIR] [--tag T]

e2e: one prefill per batch of real-text prompts (a different document per row, continuation request,
chat template), then plain and every (method, shape) in one process, sampling (T 0.7, top-p 0.95) as
the headline and greedy beside it, each repeated with seeds 0.. (median and spread); degeneration is
the share of repeated 4-grams in the outputs. Every method at ratio 0.07 (bench/kv_bound.json). The
ideal speed-up is a projection: measured tokens per iteration x plain step floor / iteration floor,
the iteration floor being depth draft forwards over the selection (weights + K keys; none for ngram)
plus the verify pass (weights + every key + the rows' float32 logits).
verify: draft, verify and whole-iteration times of vegas at trees of 7 (chain), 16, 31 and 64 rows
on a random cache of the prompt length, against the verify pass's bytes and flops floors.
Writes DIR/trees_<part>_<device><tag>.json (after every row); prints the tables last.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp

from bench import common, e2e
from bench.e2e import spec_of, split_shapes
from bench.throughput import stage_times
from jaxspec.decoding.tree import MAX_TREE_ROWS
from jaxspec.loaders import load_model
from jaxspec.models.kvcache import cache_slots

VERIFY_SHAPES = ["chain:6", "bfs:3,2,1", "bfs:3,3,1,1", "bfs:7,1,1,1,1,1,1,1,1"]  # 7, 16, 31, 64 rows


def verify_part(args, cfg, params, rates, rows_out, save):
    backend = "reference" if args.tiny else "pallas"
    weight_bytes = common.tree_bytes(params)
    n_params = weight_bytes / jnp.dtype(cfg.dtype).itemsize
    context = args.prompt_tokens
    max_len = context + 64
    for batch_size in args.batches:
        for shape in VERIFY_SHAPES:
            spec = spec_of("vegas", shape, backend)
            cache = common.random_cache(cfg, batch_size, cache_slots(max_len + MAX_TREE_ROWS), jax.random.key(batch_size))
            state = common.random_state(params, cfg, spec, cache, context, max_len)
            times, state = stage_times(params, cfg, spec, max_len, state)
            del state
            rows = spec.shape.rows
            f = common.floors(cfg, weight_bytes, spec, batch_size, context, rates)
            attn_flops = 4 * batch_size * rows * context * cfg.num_heads * cfg.head_dim * cfg.num_layers
            flops_floor = (2 * n_params * batch_size * rows + attn_flops) / (rates["matmul_TFLOPs"] * 1e12)
            floor = max(f["verify_floor_s"], flops_floor)
            row = {"batch": batch_size, "context": context, "shape": shape, "rows": rows, **times,
                   "verify_bytes_floor_ms": f["verify_floor_s"] * 1e3, "verify_flops_floor_ms": flops_floor * 1e3,
                   "verify_x_floor": times["verify_ms"] / (floor * 1e3),
                   "draft_ms_per_forward": times["draft_ms"] / spec.shape.depth}
            rows_out.append(row)
            save()
            print(f"B={batch_size} {shape} ({rows} rows): verify {times['verify_ms']:.2f} ms = {row['verify_x_floor']:.2f}x floor "
                  f"(bytes {row['verify_bytes_floor_ms']:.2f}, flops {row['verify_flops_floor_ms']:.2f}), "
                  f"draft {times['draft_ms']:.2f} ms, iteration {times['iteration_ms']:.2f} ms", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("e2e", "verify", "both"), default="both")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--methods", default="vegas,stream,ngram")
    p.add_argument("--shapes", default="chain:6,chain:15,bfs:3,2,1,dfs:3,2,1")
    p.add_argument("--prompt-tokens", type=int, default=7000)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: float32, reference backend")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--tag", default="", help="suffix of the JSON file name")
    args = p.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.methods = args.methods.split(",")
    args.shapes = split_shapes(args.shapes)
    args.samplings, args.greedy_methods = list(common.SAMPLINGS), args.methods
    rates = common.measure_rates(args.tiny)
    cfg, params, tokenizer = load_model(args.model, dtype="float32" if args.tiny else "bfloat16")
    device = "cpu" if args.tiny else jax.devices()[0].device_kind.split()[1].lower()
    parts = ("e2e", "verify") if args.part == "both" else (args.part,)
    for part in parts:
        result = common.run_info() | {"rates": rates, "rows": []}
        path = args.out / f"trees_{part}_{device}{args.tag}.json"
        save = lambda: common.write_json(path, result)  # after every row: a cut-off run keeps what it measured
        if part == "e2e":
            e2e.run_rows(args, cfg, params, tokenizer, rates, result["rows"], save)
        else:
            verify_part(args, cfg, params, rates, result["rows"], save)
        print(table(part, result["rows"]))


def table(part: str, rows: list[dict]) -> str:
    if part == "verify":
        return common.markdown_table(rows, [
            ("B", "batch", "d"), ("shape", "shape", "s"), ("rows", "rows", "d"), ("verify ms", "verify_ms", ".2f"),
            ("bytes floor", "verify_bytes_floor_ms", ".2f"), ("flops floor", "verify_flops_floor_ms", ".2f"),
            ("x floor", "verify_x_floor", ".2f"), ("draft ms/forward", "draft_ms_per_forward", ".2f"),
            ("iteration ms", "iteration_ms", ".2f")])
    return e2e.table(rows)


if __name__ == "__main__":
    main()
