"""Serving under load: requests arriving at a fixed rate (Poisson), continuous batching against today's
static batches, per method.

    PYTHONPATH=. python3 bench/serve_load.py [--model smollm2] [--methods plain,vegas] [--slots 16]
        [--rate 2.0] [--requests 32] [--prompt-tokens 7000] [--new 256,1024] [--static] [--tiny] [--out DIR]

Requests: real-text continuation prompts of about --prompt-tokens tokens (a different document each,
chat template), max_tokens uniform in --new, sampling T 0.7 / top-p 0.95, seeds 0.., arrival gaps
exponential at --rate requests/s (the same schedule for every run). Continuous: the serving
`Scheduler` in this process (the HTTP layer adds no device work), each request submitted at its
arrival time; time to first token, inter-token latency (each streamed chunk's gap spread over its
tokens) and end-to-end latency per request. Static (--static): the same requests in arrival order in
batches of --slots through `run_generation` (the generate path): a batch starts when its last
request has arrived and the previous batch has ended, and holds every row until its longest ends;
its first tokens come at the end of its prefill. Throughput: generated tokens over the time from the
first arrival to the last finish. Writes DIR/serve_load_<device>.json and prints a table last.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import jax
import numpy as np

from bench import common
from jaxspec import corpus
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import SpecConfig
from jaxspec.loaders import load_model
from jaxspec.runner import Batch, encode_prompts, run_generation
from jaxspec.serving.scheduler import Request, Scheduler

SAMPLING = SamplingConfig(temperature=0.7, top_p=0.95)
GAMMA, RATIO = 6, 0.07


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def workload(tokenizer, n: int, prompt_tokens: int, new: tuple[int, int], rate: float, seed: int = 0):
    """(prompt ids, max_tokens, arrival offsets in seconds) of n requests."""
    rng = np.random.default_rng(seed)
    texts = [corpus.long_prompt(tokenizer, prompt_tokens, task="continue", offset=3 * i) for i in range(n)]
    batch = encode_prompts(tokenizer, texts, chat=True)
    ids = [batch.ids[i, : batch.lengths[i]].tolist() for i in range(n)]
    max_tokens = rng.integers(new[0], new[1] + 1, n).tolist()
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n)).tolist() if rate > 0 else [0.0] * n
    return ids, max_tokens, arrivals


def run_continuous(params, cfg, tokenizer, spec: SpecConfig, slots: int, max_len: int, ids, max_tokens, arrivals) -> dict:
    scheduler = Scheduler(params, cfg, tokenizer, spec, slots=slots, max_len=max_len, queue_limit=len(ids))
    scheduler.warm_up(max(len(x) for x in ids))
    scheduler.start()
    records = [dict(chunks=[], done=threading.Event()) for _ in ids]

    def listener(i):
        def on(delta):
            records[i]["chunks"].append((time.perf_counter(), len(delta.token_ids)))
            if delta.finish_reason is not None:
                records[i]["stats"] = delta.stats
                records[i]["done"].set()
        return on

    start = time.perf_counter()
    for i, (x, n, at) in enumerate(zip(ids, max_tokens, arrivals)):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        records[i]["arrival"] = time.perf_counter()
        scheduler.submit(Request(tuple(x), n, SAMPLING, seed=i), listener(i))
    for r in records:
        r["done"].wait()
    scheduler.stop()
    ttft, itl, latency, tokens, per_iteration = [], [], [], 0, []
    for r in records:
        stamps = [t for t, k in r["chunks"] if k]
        ttft.append(stamps[0] - r["arrival"] if stamps else 0.0)
        latency.append(r["chunks"][-1][0] - r["arrival"])
        previous = None
        for t, k in r["chunks"]:
            if k and previous is not None:
                itl += [(t - previous) / k] * k
            previous = t if k else previous
        tokens += r["stats"].completion_tokens
        if r["stats"].iterations:
            per_iteration.append((r["stats"].accepted + r["stats"].iterations) / r["stats"].iterations)
    end = max(r["chunks"][-1][0] for r in records)
    first = min(r["arrival"] for r in records)
    return summary("continuous", spec, tokens, end - first, ttft, itl, latency, per_iteration)


def run_static(params, cfg, tokenizer, spec: SpecConfig, slots: int, max_len: int, ids, max_tokens, arrivals) -> dict:
    """Today's static batches, timed for real, placed on the arrival timeline."""
    clock, tokens, ttft, latency, itl = 0.0, 0, [], [], []
    for b0 in range(0, len(ids), slots):
        rows = list(range(b0, min(b0 + slots, len(ids))))
        lengths = np.asarray([len(ids[i]) for i in rows], np.int32)
        batch_ids = np.zeros((len(rows), lengths.max()), np.int32)
        for j, i in enumerate(rows):
            batch_ids[j, : lengths[j]] = ids[i]
        new = max(max_tokens[i] for i in rows)
        run = run_generation(params, cfg, Batch(batch_ids, lengths), spec=spec, sampling=SAMPLING, max_len=max_len,
                             max_new_tokens=new, stop_ids=tokenizer.eos_token_ids, seed=b0)
        begin = max(clock, max(arrivals[i] for i in rows))
        clock = begin + run.prefill_s + run.decode_s
        out = run.generated()
        for j, i in enumerate(rows):
            produced = min(len(out[j]), max_tokens[i])
            tokens += produced
            ttft.append(begin + run.prefill_s - arrivals[i])
            latency.append(clock - arrivals[i])
            itl += [run.decode_s / max(new - 1, 1)] * max(produced - 1, 0)
    return summary("static", spec, tokens, clock - arrivals[0], ttft, itl, latency, [])


def summary(mode: str, spec: SpecConfig, tokens: int, seconds: float, ttft, itl, latency, per_iteration) -> dict:
    return {
        "mode": mode, "method": spec.method, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50) * 1e3, "itl_p99_ms": percentile(itl, 99) * 1e3,
        "latency_p50_s": percentile(latency, 50), "latency_p99_s": percentile(latency, 99),
        "tokens_per_iteration": statistics.mean(per_iteration) if per_iteration else None,
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--methods", default="plain,vegas", type=lambda s: s.split(","))
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (0: all at once)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=7000)
    p.add_argument("--new", default="256,1024", type=lambda s: tuple(int(x) for x in s.split(",")))
    p.add_argument("--static", action="store_true", help="also run the same requests as static batches")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: 4 short requests")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    args = p.parse_args()
    gpu = jax.default_backend() == "gpu"
    if args.tiny:
        args.requests, args.prompt_tokens, args.new, args.slots, args.rate = 4, 200, (8, 16), 2, 20.0
    backend = "pallas" if gpu else "reference"
    cfg, params, tokenizer = load_model(args.model, dtype="bfloat16" if gpu else "float32")
    ids, max_tokens, arrivals = workload(tokenizer, args.requests, args.prompt_tokens, args.new, args.rate)
    max_len = max(len(x) for x in ids) + args.new[1]
    result = {**common.run_info(), "model": args.model, "slots": args.slots, "rate": args.rate, "requests": args.requests,
              "prompt_tokens": [len(x) for x in ids], "max_tokens": max_tokens, "rows": []}
    path = args.out / f"serve_load_{common.run_info()['device'].replace(' ', '_')}.json"
    for method in args.methods:
        spec = SpecConfig(backend=backend) if method == "plain" else SpecConfig(method=method, gamma=GAMMA, ratio=RATIO, backend=backend)
        spec = spec.validate()
        result["rows"].append(run_continuous(params, cfg, tokenizer, spec, args.slots, max_len, ids, max_tokens, arrivals))
        common.write_json(path, result)
        if args.static:
            result["rows"].append(run_static(params, cfg, tokenizer, spec, args.slots, max_len, ids, max_tokens, arrivals))
            common.write_json(path, result)
    print(common.markdown_table(result["rows"], [
        ("mode", "mode", "s"), ("method", "method", "s"), ("tok/s", "tokens_per_s", ".0f"), ("TTFT p50 s", "ttft_p50_s", ".2f"),
        ("TTFT p99 s", "ttft_p99_s", ".2f"), ("ITL p50 ms", "itl_p50_ms", ".2f"), ("ITL p99 ms", "itl_p99_ms", ".2f"),
        ("latency p50 s", "latency_p50_s", ".1f"), ("latency p99 s", "latency_p99_s", ".1f"),
        ("tokens/iter", "tokens_per_iteration", ".2f")]))


if __name__ == "__main__":
    main()
