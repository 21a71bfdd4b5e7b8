"""Serving under load, through HTTP: requests arriving at fixed rates (Poisson) against
`python -m jaxspec.serve`, per method, continuous batching against static batching.

    PYTHONPATH=. python3 bench/serve_load.py [--model smollm2] [--configs plain:continuous,vegas:static,...]
        [--slots 16] [--kv-pages N | --kv-rows R] [--page-size 128] [--rates 1,2,4,8] [--requests 16] [--repeats 3]
        [--prompt-tokens 7000 | 1000,7000] [--new 256,1024] [--ignore-eos] [--shared-document] [--tiny] [--out DIR] [--tag T]
        [--plot-from JSON ...]

A config is method:batching[:chunk[:shrink[:slots]]] (slots: this config's, default --slots). For each,
one server process (`python -m jaxspec.serve --method M --batching B --slots S [--prefill-chunk C]
[--shrink] [--kv-pages N --page-size P]`, gamma 6 and ratio 0.07 for a fixed method; `auto` refines
the planner's choice as it serves) is started, warmed up (its admissions compiled for the prompts' length, then one
request) and driven by this process over HTTP/1.0 with streamed /v1/completions (prompt token ids,
every chunk carrying its token ids) at each rate, --repeats times (the server process stays up
across rates and repeats). Every config at one rate serves the same requests on the same arrival
schedule, so configs compare on one workload. Repeat r samples with seeds r x requests + i (a
process repeats its texts bit for bit under one seed), so the spread covers the sampled texts as well
as timing. Static batching is the server admitting only
when every slot is free (all that wait, in one prefill), so a batch holds its slots until its longest
request ends: the static batch of `generate` placed on the arrival timeline.

Requests: real-text continuation prompts of about --prompt-tokens tokens (N, or LOW,HIGH: uniform per
request, the same lengths for every config), a different document each, with the chat template. Each
run starts from other documents and the warm-up from one no run reads, so no run finds its prompts in
the prefix cache. max_tokens is uniform in --new; sampling T 0.7 / top-p 0.95 (seeds above). Per run:
throughput (completion tokens over first arrival to last token), time to first token (arrival to the
first streamed token), inter-token latency (each chunk's gap spread over its tokens), end-to-end
latency, and tokens per iteration (from the requests' usage). Per (config, rate): the median of the
repeats and their spread (max - min). Writes DIR/serve_load_<device><tag>.json after every run, a plot
of throughput and TTFT against offered load (DIR/serve_load_<device><tag>.png), and prints the table
last. This process runs on the CPU (it only tokenizes and times); the server has the device.

Paged KV cache: every config gets the same pool (equal cache memory): `--kv-pages N` pages (0: each
server's default), or `--kv-rows R`, the pages of R rows of the run's max_len. Configs that differ only
in slots then compare a pool capped by slots (slots x max_len pages, a batch of whole rows) against one
that holds as many requests as their tokens fit. Per run also: requests held at once (the most whose
first and last tokens overlap), preemptions (the server's counter over the run) and prompt tokens read
from the prefix cache. A reasoning-style load is short prompts and long outputs (`--prompt-tokens 200
--new 2048,8192`), with `--ignore-eos` so that every request runs to its max_tokens (as vLLM's
benchmarks do) and the load is the one scheduled. `--shared-document`: every prompt is one document (a
new one each run) and a different closing line, so later requests read the document from the prefix
cache (their time to first token against the first one's: ttft_first_s, ttft_rest_p50_s).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the client only tokenizes: the server has the accelerator

import argparse
import asyncio
import json
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

from bench import common
from jaxspec import corpus
from jaxspec.loaders import load_model
from jaxspec.runner import encode_prompts
from jaxspec.serving.scheduler import row_pages

SAMPLING = dict(temperature=0.7, top_p=0.95)
GAMMA, RATIO = 6, 0.07
START_TIMEOUT_S = 900


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def prompts(tokenizer, n: int, prompt_tokens: tuple[int, int], shared: bool = False, run: int = 0) -> list[list[int]]:
    """n chat prompts for run number `run`, each of about a length drawn uniformly from `prompt_tokens`
    (low, high; seeded by the run, so every config gets the same lengths): a different document each,
    or (`shared`) one document of `high` tokens with a different closing line each. Each run starts
    from other documents, so no run reads an earlier one's prompts from the prefix cache."""
    low, high = prompt_tokens
    if shared:
        document = corpus.long_prompt(tokenizer, high - 16, task="question", offset=run)
        texts = [f"{document}\n\nAnswer in {i + 2} sentences." for i in range(n)]
    else:
        lengths = np.random.default_rng(run).integers(low, high + 1, n)
        texts = [corpus.long_prompt(tokenizer, int(lengths[i]), task="continue", offset=3 * i + run) for i in range(n)]
    batch = encode_prompts(tokenizer, texts, chat=True)
    return [batch.ids[i, : batch.lengths[i]].tolist() for i in range(n)]


def schedule(n: int, new: tuple[int, int], rate: float, seed: int) -> tuple[list[int], list[float]]:
    """(max_tokens, arrival offsets in seconds) of n requests."""
    rng = np.random.default_rng(seed)
    max_tokens = rng.integers(new[0], new[1] + 1, n).tolist()
    return max_tokens, np.cumsum(rng.exponential(1.0 / rate, n)).tolist()


class Server:
    """`python -m jaxspec.serve` in a child process, its log in a file."""

    def __init__(self, model: str, config: str, slots: int, max_len: int, warm_up_tokens: int, log: Path,
                 kv_pages: int = 0, page_size: int = 128):
        self.port = free_port()
        method, batching, chunk, shrink, own_slots = (config.split(":") + ["0", "", ""])[:5]
        if shrink not in ("", "shrink"):
            raise SystemExit(f"config {config!r}: the fourth field is 'shrink' or nothing")
        slots = int(own_slots or slots)
        fixed = [] if method in ("plain", "auto") else ["--gamma", str(GAMMA), "--ratio", str(RATIO)]
        command = [sys.executable, "-m", "jaxspec.serve", "--model", model, "--method", method, *fixed,
                   "--batching", batching, "--prefill-chunk", chunk, "--slots", str(slots), "--max-len", str(max_len),
                   "--port", str(self.port), "--queue", "10000", "--warm-up-tokens", str(warm_up_tokens)]
        command += ["--shrink"] if shrink else []
        command += ["--kv-pages", str(kv_pages), "--page-size", str(page_size)]
        self.log = log
        env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR", "/tmp/jaxspec_jit_cache")}
        env.pop("JAX_PLATFORMS")  # the server takes the accelerator
        start = time.perf_counter()
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"), env=env)
        while not self.healthy():
            if self.process.poll() is not None or time.perf_counter() - start > START_TIMEOUT_S:
                self.stop()
                raise SystemExit(f"the server did not start; its log:\n{log.read_text()[-3000:]}")
            time.sleep(1.0)
        self.start_s = time.perf_counter() - start
        self.device = next((line.removeprefix("device: ") for line in log.read_text().splitlines()
                            if line.startswith("device: ")), "unknown")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def model_info(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=10) as r:
            return json.loads(r.read())["data"][0]["jaxspec"]

    def metric(self, name: str) -> float:
        """A counter or gauge (without labels) from /metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return 0.0

    def stop(self) -> None:
        """SIGTERM: the server drains and exits."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def request(port: int, ids: list[int], max_tokens: int, seed: int, at: float, t0: float, ignore_eos: bool) -> dict:
    """One streamed completion sent at t0 + at: its arrival, each chunk's (time, tokens), its usage."""
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    body = json.dumps({"prompt": ids, "max_tokens": max_tokens, "seed": seed, "stream": True, "ignore_eos": ignore_eos,
                       "stream_options": {"include_usage": True}, **SAMPLING}).encode()
    arrival = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    chunks, usage = [], None
    while line := await reader.readline():
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(f"request failed: {event['error']}")
        if event.get("choices"):
            chunks.append((time.perf_counter(), len(event["choices"][0].get("token_ids", []))))
        if event.get("usage"):
            usage = event["usage"]
    writer.close()
    if status != 200 or usage is None:
        raise RuntimeError(f"HTTP {status} without a complete stream")
    return {"arrival": arrival, "chunks": chunks, "usage": usage}


async def load(port: int, ids, max_tokens, arrivals, first_seed: int = 0, ignore_eos: bool = False) -> list[dict]:
    """Sends request i (seed first_seed + i) at arrivals[i]; returns their records."""
    t0 = time.perf_counter()
    return await asyncio.gather(*(request(port, x, n, first_seed + i, at, t0, ignore_eos)
                                  for i, (x, n, at) in enumerate(zip(ids, max_tokens, arrivals))))


def measure(records: list[dict]) -> dict:
    ttft, itl, latency, per_iteration, tokens = [], [], [], [], 0
    held = [(min(t for t, k in r["chunks"] if k), r["chunks"][-1][0]) for r in records]  # first to last token
    at_once = max(sum(a <= t <= b for a, b in held) for t, _ in held)
    for r in records:
        stamps = [(t, k) for t, k in r["chunks"] if k]
        ttft.append(stamps[0][0] - r["arrival"])
        latency.append(stamps[-1][0] - r["arrival"])
        itl += [gap for (t0, _), (t1, k) in zip(stamps, stamps[1:]) for gap in [(t1 - t0) / k] * k]
        tokens += r["usage"]["completion_tokens"]
        per_iteration.append(r["usage"]["jaxspec"]["tokens_per_iteration"])
    seconds = max(r["chunks"][-1][0] for r in records) - min(r["arrival"] for r in records)
    return {
        "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_ms": percentile(itl, 50) * 1e3, "itl_p99_ms": percentile(itl, 99) * 1e3,
        "latency_p50_s": percentile(latency, 50), "latency_p99_s": percentile(latency, 99),
        "tokens_per_iteration": statistics.mean(per_iteration), "held_at_once": at_once,
        "cached_tokens": sum(r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in records),
        "ttft_first_s": ttft[0], "ttft_rest_p50_s": percentile(ttft[1:], 50),
    }


def summarize(runs: list[dict]) -> list[dict]:
    """Per (config, rate): the median of every measure over the repeats, the spread of throughput."""
    out = []
    for key in dict.fromkeys((r["config"], r["rate"]) for r in runs):
        group = [r for r in runs if (r["config"], r["rate"]) == key]
        row = {"config": key[0], "rate": key[1], "repeats": len(group), "strategy": group[-1]["strategy"]}
        for name in ("tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_ms", "itl_p99_ms", "latency_p50_s",
                     "latency_p99_s", "tokens_per_iteration", "held_at_once", "preemptions", "cached_tokens",
                     "ttft_first_s", "ttft_rest_p50_s"):
            row[name] = statistics.median(r[name] for r in group)
        row["spread_tokens_per_s"] = max(r["tokens_per_s"] for r in group) - min(r["tokens_per_s"] for r in group)
        out.append(row)
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Throughput and TTFT p50 against offered load, one line per config (bars: the repeats' spread);
    nothing without matplotlib (the JSON and the table have every number)."""
    try:
        import matplotlib
    except ImportError:
        print(f"no plot ({path.name}): matplotlib is not installed")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for config in dict.fromkeys(r["config"] for r in rows):
        points = sorted((r["rate"], r["tokens_per_s"], r["spread_tokens_per_s"], r["ttft_p50_s"]) for r in rows
                        if r["config"] == config)
        rates = [p[0] for p in points]
        style = "--" if ":static" in config else "-"
        left.errorbar(rates, [p[1] for p in points], yerr=[p[2] / 2 for p in points], marker="o", capsize=3,
                      linestyle=style, label=config)
        right.plot(rates, [p[3] for p in points], marker="o", linestyle=style, label=config)
    left.set(xlabel="offered load (requests/s)", ylabel="throughput (generated tokens/s)", title=title)
    right.set(xlabel="offered load (requests/s)", ylabel="time to first token, p50 (s)", yscale="log", title=title)
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


TABLE = [("config", "config", "s"), ("strategy", "strategy", "s"), ("req/s", "rate", "g"), ("tok/s", "tokens_per_s", ".0f"),
         ("spread", "spread_tokens_per_s", ".0f"), ("TTFT p50 s", "ttft_p50_s", ".2f"), ("TTFT p99 s", "ttft_p99_s", ".2f"),
         ("ITL p50 ms", "itl_p50_ms", ".1f"), ("ITL p99 ms", "itl_p99_ms", ".1f"), ("latency p50 s", "latency_p50_s", ".1f"),
         ("tokens/iter", "tokens_per_iteration", ".2f"), ("held at once", "held_at_once", ".0f"),
         ("preemptions", "preemptions", ".0f"), ("cached tokens", "cached_tokens", ".0f"),
         ("TTFT first s", "ttft_first_s", ".2f"), ("TTFT rest p50 s", "ttft_rest_p50_s", ".2f")]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--configs", default="plain:continuous,vegas:continuous,auto:continuous,plain:static,vegas:static",
                   type=lambda s: s.split(","))
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--kv-pages", type=int, default=0, help="every server's KV pool (0: the server's default)")
    p.add_argument("--kv-rows", type=int, default=0, help="instead of --kv-pages: a pool of this many rows of max_len")
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="every request runs to its max_tokens (a fixed load)")
    p.add_argument("--shared-document", action="store_true", help="one document, a different closing line per prompt")
    p.add_argument("--rates", default="1,2,4,8", type=lambda s: [float(x) for x in s.split(",")], help="requests per second")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-tokens", default=(7000, 7000), help="N, or LOW,HIGH: each prompt's length uniform in it",
                   type=lambda s: tuple(int(x) for x in (s.split(",") * 2)[:2]))
    p.add_argument("--new", default="256,1024", type=lambda s: tuple(int(x) for x in s.split(",")))
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: 4 short requests, 2 slots, one rate, one repeat")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    p.add_argument("--tag", default="", help="suffix of the file names")
    p.add_argument("--plot-from", type=Path, nargs="+", default=None, help="plot the rows of these JSON files and exit")
    args = p.parse_args()
    if args.plot_from:
        rows = [row for f in args.plot_from for row in json.loads(f.read_text())["summary"]]
        plot(rows, args.out / f"serve_load{args.tag}.png", "SmolLM2, 16 slots, ~7K-token prompts")
        return
    if args.tiny:
        args.requests, args.prompt_tokens, args.new, args.slots, args.rates, args.repeats = 4, (200, 200), (8, 16), 2, [20.0], 1
    _, _, tokenizer = load_model(args.model, dtype="float32")
    runs = [(rate, repeat) for rate in args.rates for repeat in range(args.repeats)]
    ids = {k: prompts(tokenizer, args.requests, args.prompt_tokens, args.shared_document, run=k + 1) for k in range(len(runs))}
    longest_prompt = (args.prompt_tokens[1],) * 2
    warm_up = prompts(tokenizer, 1, longest_prompt, run=len(runs) + 3 * args.requests)  # in no run's prompts
    longest = max(len(x) for run in [*ids.values(), warm_up] for x in run)
    max_len = longest + args.new[1]
    if args.kv_rows:  # the pages of that many of the scheduler's rows, and the null page
        args.kv_pages = args.kv_rows * row_pages(max_len, args.page_size) + 1
    result = {**common.run_info(), "model": args.model, "slots": args.slots, "requests": args.requests,
              "rates": args.rates, "repeats": args.repeats, "prompt_tokens": [len(x) for x in ids[0]], "new": args.new,
              "kv_pages": args.kv_pages, "page_size": args.page_size, "shared_document": args.shared_document,
              "ignore_eos": args.ignore_eos,
              "servers": [], "runs": [], "summary": []}
    path = None
    for config in args.configs:
        method = config.split(":")[0]
        server = Server(args.model, config, args.slots, max_len, longest, Path(f"/tmp/serve_{config.replace(':', '_')}.log"),
                        args.kv_pages, args.page_size)
        try:
            result["device"], result["backend"] = server.device, "server"  # this process's own JAX runs on the CPU
            path = args.out / f"serve_load_{server.device.split(' (')[0].replace(' ', '_')}{args.tag}.json"
            asyncio.run(load(server.port, warm_up, [8], [0.0]))  # warm-up: one request of the real length
            result["servers"].append({"config": config, "start_s": server.start_s})
            for k, (rate, repeat) in enumerate(runs):
                max_tokens, arrivals = schedule(args.requests, args.new, rate, seed=0)
                preempted = server.metric("jaxspec_preemptions_total")
                run = measure(asyncio.run(load(server.port, ids[k], max_tokens, arrivals, repeat * args.requests, args.ignore_eos)))
                run["preemptions"] = server.metric("jaxspec_preemptions_total") - preempted
                strategy = server.model_info()
                run.update(config=config, rate=rate, repeat=repeat, strategy=strategy["method"] if method != "auto"
                           else f"auto: {strategy['method']}")
                if "auto" in strategy:  # the refinement's plan, switches and segments so far
                    run["auto"] = strategy["auto"]
                result["runs"].append(run)
                result["summary"] = summarize(result["runs"])
                common.write_json(path, result)
                print(f"{config} rate {rate:g} repeat {repeat}: {run['tokens_per_s']:.0f} tok/s, "
                      f"TTFT p50 {run['ttft_p50_s']:.2f} s", flush=True)
        finally:
            server.stop()
    plot(result["summary"], path.with_suffix(".png"), f"SmolLM2, {args.slots} slots, {'-'.join(map(str, sorted(set(args.prompt_tokens))))}-token prompts")
    print(common.markdown_table(result["summary"], TABLE))  # last


if __name__ == "__main__":
    main()
