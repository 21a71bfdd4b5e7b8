"""Plain decoding step time against its floor: the baseline the kernels and speculation are measured by.

    PYTHONPATH=. python3 bench/decode.py [--backends reference,pallas] [--grid 1x4096,...] [--smollm2]
                                         [--tiny] [--out DIR]

Qwen3-8B shapes, random bf16 weights (latency only): for each batch x context a cache of random keys
and values stands in for the prompt, and the engine's plain decode loop runs; time per step is set
against the floor (weights + KV read + logits) / measured copy bandwidth. With --smollm2, real
SmolLM2-135M weights and real prompts run end to end through `jaxspec.generate.run_generation`.
Writes DIR/decode.json and prints a markdown table last.
"""

from __future__ import annotations

import argparse
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from jaxspec.models import decoder
from jaxspec.models.config import ModelConfig
from jaxspec.runner import decode_fns, encode_prompts, run_generation
from jaxspec.models.kvcache import cache_bytes, cache_slots
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import SpecConfig, spec_from_settings
from jaxspec.decoding.tree import MAX_TREE_ROWS

GRID = [(1, 4096), (4, 4096), (16, 4096), (1, 32768), (4, 32768), (16, 32768), (1, 131072)]
TINY_CFG = ModelConfig(
    model_type="qwen3", vocab_size=1024, hidden_size=128, num_layers=2, num_heads=8, num_kv_heads=2,
    head_dim=64, intermediate_size=256, qk_norm=True, dtype="bfloat16",
)
STEPS = 16  # decode iterations per timed call
MEMORY_FRACTION = 0.85  # of the device's memory a configuration may plan to use


def time_decode(params, cfg, spec: SpecConfig, batch: int, context: int, max_len: int, cache):
    """(seconds per plain decode step at `context`, the cache back), from a random cache standing in
    for the prompt; the cache is donated through the run and handed back for the next context."""
    _, decode = decode_fns(cfg, spec, SamplingConfig(), max_len)
    state = common.random_state(params, cfg, spec, cache, context, max_len)
    state = jax.block_until_ready(decode(params, state, max_iterations=jnp.int32(STEPS)))  # compile + warm up
    times = []
    for _ in range(3):
        t = time.perf_counter()
        state = jax.block_until_ready(decode(params, state, max_iterations=jnp.int32(STEPS)))
        times.append((time.perf_counter() - t) / STEPS)
    assert not bool(state.done.any()), "rows finished during timing"
    return float(np.median(times)), state.cache


def qwen3_rows(args, rates: dict, save) -> list[dict]:
    cfg = TINY_CFG if args.tiny else common.QWEN3_8B
    params = decoder.init_params(cfg, jax.random.key(0))
    weight_bytes = common.tree_bytes(params)
    device_bytes = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit", 1 << 62)
    rows = []
    for backend in args.backends:
        spec = spec_from_settings(backend=backend)
        for batch in sorted({b for b, _ in args.grid}):
            contexts = sorted(c for b, c in args.grid if b == batch)
            max_len = contexts[-1] + 4 * STEPS + 8
            slots = cache_slots(max_len + MAX_TREE_ROWS)
            if weight_bytes + cache_bytes(cfg, batch, slots) > MEMORY_FRACTION * device_bytes:
                rows += [dict(model=cfg.model_type, backend=backend, batch=batch, context=c, skipped="memory") for c in contexts]
                continue
            cache = common.random_cache(cfg, batch, slots, jax.random.key(batch))
            for context in contexts:
                row = dict(model="qwen3-8b" if not args.tiny else "tiny-qwen3", backend=backend, batch=batch, context=context)
                try:
                    step, cache = time_decode(params, cfg, spec, batch, context, max_len, cache)
                    floor = common.step_floor_s(cfg, weight_bytes, batch, context, rates["copy_GBps"])
                    row.update(step_ms=step * 1e3, floor_ms=floor * 1e3, ratio_to_floor=step / floor, tokens_per_s=batch / step)
                except Exception as e:  # one failing configuration must not end the run
                    row["error"] = "".join(traceback.format_exception_only(e)).strip().splitlines()[0][:300]
                    cache = common.random_cache(cfg, batch, slots, jax.random.key(batch))  # it may have been donated
                print(row, flush=True)
                rows.append(row)
                save(rows)
            del cache
    return rows


def smollm2_rows(args, rates: dict) -> list[dict]:
    """Real weights, real prompts: plain greedy decoding through the CLI's own path."""
    from jaxspec import corpus
    from jaxspec.loaders import load_model

    cfg, params, tokenizer = load_model(args.smollm2_model, dtype="bfloat16")
    weight_bytes = common.tree_bytes(params)
    rows = []
    for backend in args.backends:
        for batch_size in (1, 4, 16):
            prompts = [corpus.long_prompt(tokenizer, 2000, offset=i) for i in range(batch_size)]
            batch = encode_prompts(tokenizer, prompts, chat=True)
            new = 256
            max_len = int(batch.lengths.max()) + new
            spec = spec_from_settings(backend=backend)
            run = run_generation(params, cfg, batch, spec=spec, sampling=SamplingConfig(), max_len=max_len, max_new_tokens=new, stop_ids=())
            steps = int(np.asarray(run.output.length - run.output.prompt_len).max()) - 1
            step = run.decode_s / steps
            context = int(batch.lengths.mean()) + new // 2
            floor = common.step_floor_s(cfg, weight_bytes, batch_size, context, rates["copy_GBps"])
            row = dict(model="smollm2-135m", backend=backend, batch=batch_size, context=context, step_ms=step * 1e3,
                       floor_ms=floor * 1e3, ratio_to_floor=step / floor, tokens_per_s=batch_size / step, compile_s=run.compile_s)
            print(row, flush=True)
            rows.append(row)
    return rows


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="reference,pallas", type=lambda s: s.split(","))
    p.add_argument("--grid", default=None, type=lambda s: [tuple(int(x) for x in item.split("x")) for item in s.split(",")])
    p.add_argument("--smollm2", dest="smollm2_model", nargs="?", const="smollm2", default=None,
                   help="also run SmolLM2 end to end (optionally a path to its GGUF)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke test of this script")
    p.add_argument("--out", default=str(common.RESULTS))
    args = p.parse_args()
    args.grid = args.grid or ([(2, 256), (2, 1024)] if args.tiny else GRID)
    return args


def main():
    args = parse_args()
    result = common.run_info() | {"rates": common.measure_rates(args.tiny)}
    path = Path(args.out) / "decode.json"
    rows = qwen3_rows(args, result["rates"], lambda rows: common.write_json(path, result | {"rows": rows}))
    if args.smollm2_model:
        rows += smollm2_rows(args, result["rates"])
    result["rows"] = rows
    common.write_json(path, result)
    print(f"\n{result['device']}, copy {result['rates']['copy_GBps']:.0f} GB/s, {result['date']}")
    print(common.markdown_table(rows, [
        ("model", "model", "s"), ("backend", "backend", "s"), ("B", "batch", "d"), ("context", "context", "d"),
        ("ms/step", "step_ms", ".2f"), ("floor ms", "floor_ms", ".2f"), ("x floor", "ratio_to_floor", ".2f"),
        ("tok/s", "tokens_per_s", ".0f"), ("note", "skipped", "s"),
    ]))


if __name__ == "__main__":
    main()
