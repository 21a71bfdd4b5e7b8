"""What sampling costs per step (issue 13): jaxspec.decoding.sampling on [rows, vocab] float32 logits
(the LM head's output), against greedy's argmax, the sort-based cutoff it replaced, and the bytes floor.

    PYTHONPATH=. python3 bench/sampling.py [--rows 32,128,224,896] [--vocabs 49152,151936] [--tiny] [--out DIR]

Rows: a draft step samples B rows, the verification processes B x (drafts + 1) rows (SmolLM2 at
batch 32 / 128, chain of 6: 224 / 896). Logits normal x 3 (a peaked distribution: T 0.7, top-p 0.95
keeps tens of tokens). Timed (bench.common.seconds_per_call, jitted, median of 3 runs):
  argmax        greedy's token choice
  sort cutoff   the cutoff before issue 13: sort the row, cumulative sum, first index past top_p
  cutoff ref    sampling.cutoff on the reference backend (the nucleus search in jnp)
  cutoff        sampling.cutoff on the pallas backend (pallas_kernels/top_p.py)
  process       sampling.process_logits (pallas): the float32 probabilities [rows, V]
  sample        sampling.sample (pallas): process + the Gumbel draw
The three thresholds are compared: rows equal, and where the kernel's differs from the reference's,
how near the row was to a tie: |M(t) - top_p Z| / Z in float64 at the lower of the two thresholds
(M(t): the mass above t; rounding-level means the two summation orders met a near-tie). Floor: read
the float32 logits once and write float32 probabilities once, over the copy bandwidth measured in
the same run. Writes DIR/sampling_<device>.json and prints a table.
"""
from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from jaxspec.decoding import sampling

CFG = sampling.SamplingConfig(temperature=0.7, top_p=0.95)


def sort_cutoff(logits, cfg: sampling.SamplingConfig):
    """The top-p threshold as jaxspec computed it before issue 13: sort, cumulative mass, the last
    value whose mass before it is < top_p."""
    candidates = sampling.tempered(jnp.flip(jnp.sort(logits, axis=-1), axis=-1), cfg)
    probs = jax.nn.softmax(candidates, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    return jnp.min(jnp.where(mass_before < cfg.top_p, candidates, jnp.inf), axis=-1, keepdims=True)


def near_tie_gap(logits, a, b, cfg: sampling.SamplingConfig) -> float:
    """The largest float64 |M(t) - top_p Z| / Z over rows where thresholds a and b differ, at
    t = min(a, b); 0 when none differ."""
    x = np.asarray(sampling.tempered(logits, cfg), np.float64)
    a, b = np.ravel(a), np.ravel(b)
    gaps = [0.0]
    for r in np.flatnonzero(a != b):
        e = np.exp(x[r] - x[r].max())
        gaps.append(abs(e[x[r] > min(a[r], b[r])].sum() - cfg.top_p * e.sum()) / e.sum())
    return float(max(gaps))


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
        "sort_cutoff": jax.jit(functools.partial(sort_cutoff, cfg=CFG)),
        "cutoff_ref": jax.jit(lambda x: sampling.cutoff(x, CFG, "reference")[0]),
        "cutoff": jax.jit(lambda x: sampling.cutoff(x, CFG, "pallas")[0]),
        "process": functools.partial(sampling.process_logits, cfg=CFG, backend="pallas"),
        "sample": functools.partial(sampling.sample, jax.random.key(0), cfg=CFG, backend="pallas"),
    }
    for V in vocabs:
        for R in rows_list:
            x = 3 * jax.random.normal(jax.random.key(R + V), (R, V), jnp.float32)
            got = {n: np.asarray(fns[n](x)) for n in ("sort_cutoff", "cutoff_ref", "cutoff")}
            floor_us = R * V * (4 + 4) / (rates["copy_GBps"] * 1e9) * 1e6
            row = {"rows": R, "vocab": V, "floor_us": floor_us,
                   "pallas_equals_ref": int(np.sum(got["cutoff"] == got["cutoff_ref"])),
                   "pallas_equals_sort": int(np.sum(got["cutoff"] == got["sort_cutoff"])),
                   "mismatch_gap": near_tie_gap(x, got["cutoff"], got["cutoff_ref"], CFG)}
            for name, f in fns.items():
                row[f"{name}_us"] = common.seconds_per_call(f, x) * 1e6
            result["rows"].append(row)
            print(f"V={V} rows={R}: " + ", ".join(f"{n} {row[f'{n}_us']:.0f} us" for n in fns)
                  + f", floor {floor_us:.1f} us, rows equal to ref / sort: {row['pallas_equals_ref']} / "
                    f"{row['pallas_equals_sort']} (gap {row['mismatch_gap']:.1e})", flush=True)
    device = "cpu" if jax.default_backend() == "cpu" else jax.devices()[0].device_kind.split()[1].lower()
    common.write_json(args.out / f"sampling_{device}.json", result)
    columns = [("vocab", "vocab", "d"), ("rows", "rows", "d")] + [(f"{n} us", f"{n}_us", ".0f") for n in fns] + [
        ("floor us", "floor_us", ".1f"), ("= ref", "pallas_equals_ref", "d"), ("= sort", "pallas_equals_sort", "d"), ("gap", "mismatch_gap", ".0e")]
    print(common.markdown_table(result["rows"], columns))


if __name__ == "__main__":
    main()
