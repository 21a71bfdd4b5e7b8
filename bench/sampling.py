"""What sampling costs per step (issue 13): jaxspec.decoding.sampling on [rows, vocab] logits, against
greedy's argmax and the bytes floor, and a sort-free top-p threshold prototype.

    PYTHONPATH=. python3 bench/sampling.py [--rows 32,128,224,896] [--vocabs 49152,151936] [--tiny] [--out DIR]

Rows: a draft step samples B rows, the verification processes B x (drafts + 1) rows (SmolLM2 at
batch 32 / 128, chain of 6: 224 / 896). Logits bf16, normal x 3 (a peaked distribution: T 0.7,
top-p 0.95 keeps tens of tokens). Timed (bench.common.seconds_per_call, jitted, median of 3 runs):
  argmax        greedy's token choice
  sort          jnp.sort of the float32 row (what top-p without top-k does first)
  cutoff        sampling.cutoff: the kept-token threshold and log-normaliser (sorts for top-p)
  process       sampling.process_logits: the float32 probabilities [rows, V]
  sample        sampling.sample: process + the Gumbel draw
  bisect        a prototype: the same top-p threshold by 32 bisection steps over the float32 bit
                patterns (each one masked mass sum over the row), checked equal to cutoff's
Floor: read the bf16 logits once and write float32 probabilities once, over the copy bandwidth
measured in the same run. Writes DIR/sampling_<device>.json and prints a table.
"""
from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench import common
from jaxspec.decoding import sampling

CFG = sampling.SamplingConfig(temperature=0.7, top_p=0.95)


def ordered_key(x):
    """float32 -> int32 with the same order (negative floats flip their magnitude bits)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def bisect_cutoff(logits, cfg: sampling.SamplingConfig):
    """The top-p threshold of sampling.cutoff (no top-k, no min-p) without a sort: the smallest
    tempered value v such that the mass of tokens above v is < top_p, by bisection on ordered keys."""
    x = sampling.tempered(logits, cfg)
    top = jnp.max(x, axis=-1, keepdims=True)
    e = jnp.exp(x - top)
    total = jnp.sum(e, axis=-1, keepdims=True)
    key = ordered_key(x)
    lo = jnp.min(key, axis=-1, keepdims=True)          # predicate false below: mass above lo >= top_p
    hi = jnp.max(key, axis=-1, keepdims=True)          # true at the top: nothing above it

    def step(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)        # floor((lo + hi) / 2) without int32 overflow
        above = jnp.sum(jnp.where(key > mid, e, 0.0), axis=-1, keepdims=True)
        ok = above < cfg.top_p * total
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    _, hi = lax.fori_loop(0, 32, step, (lo, hi))
    return jnp.min(jnp.where(key >= hi, x, jnp.inf), axis=-1, keepdims=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="32,128,224,896")
    p.add_argument("--vocabs", default="49152,151936")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    args = p.parse_args()
    rows_list = [8] if args.tiny else [int(r) for r in args.rows.split(",")]
    vocabs = [512] if args.tiny else [int(v) for v in args.vocabs.split(",")]
    rates = common.measure_rates(args.tiny)
    result = common.run_info() | {"rates": rates, "config": vars(CFG), "rows": []}
    fns = {
        "argmax": jax.jit(lambda x: jnp.argmax(x, axis=-1)),
        "sort": jax.jit(lambda x: jnp.sort(x.astype(jnp.float32), axis=-1)),
        "cutoff": jax.jit(functools.partial(sampling.cutoff, cfg=CFG)),
        "process": functools.partial(sampling.process_logits, cfg=CFG),
        "sample": functools.partial(sampling.sample, jax.random.key(0), cfg=CFG),
        "bisect": jax.jit(functools.partial(bisect_cutoff, cfg=CFG)),
    }
    for V in vocabs:
        for R in rows_list:
            x = (3 * jax.random.normal(jax.random.key(R + V), (R, V), jnp.float32)).astype(jnp.bfloat16)
            want, got = fns["cutoff"](x)[0], fns["bisect"](x)
            same = bool(np.array_equal(np.asarray(want), np.asarray(got)))
            floor_us = R * V * (2 + 4) / (rates["copy_GBps"] * 1e9) * 1e6
            row = {"rows": R, "vocab": V, "floor_us": floor_us, "bisect_equals_cutoff": same}
            for name, f in fns.items():
                row[f"{name}_us"] = common.seconds_per_call(f, x) * 1e6
            result["rows"].append(row)
            print(f"V={V} rows={R}: " + ", ".join(f"{n} {row[f'{n}_us']:.0f} us" for n in fns)
                  + f", floor {floor_us:.1f} us, bisect == cutoff: {same}", flush=True)
    device = "cpu" if jax.default_backend() == "cpu" else jax.devices()[0].device_kind.split()[1].lower()
    common.write_json(args.out / f"sampling_{device}.json", result)
    columns = [("vocab", "vocab", "d"), ("rows", "rows", "d")] + [(f"{n} us", f"{n}_us", ".0f") for n in fns] + [
        ("floor us", "floor_us", ".1f"), ("bisect ok", "bisect_equals_cutoff", "")]
    print(common.markdown_table(result["rows"], columns))


if __name__ == "__main__":
    main()
