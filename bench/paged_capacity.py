"""A projection: requests a server holds at once on a reasoning load, a paged KV pool against slots of
the whole context (Qwen3-8B shapes on one H200 by default; no device is used).

    PYTHONPATH=. python3 bench/paged_capacity.py [--model qwen3-8b] [--memory-gib 139] [--prompt 200]
        [--new 2048,20480] [--page-size 128] [--slots 256] [--requests 2000] [--out DIR]

The KV pool is serve's default: KV_MEMORY_FRACTION of the memory left after the bf16 weights. Slots of
the whole context (prompt + the longest output, plus a draft tree) hold pool // row requests, however
short they are. The paged pool is simulated with the server's allocator (`serving.pages.PagePool`)
under the scheduler's rules, a decode step at a time, every running request one token a step: a
saturated queue of requests (the prompt, an output length uniform in --new) is admitted in order
while the pool has the pages of its prompt and its next --horizon tokens (and a draft tree beyond
them) and a page for each running request still growing; before each step every running request is grown to cover its next --horizon tokens, earliest
admitted first, and the most recently admitted is preempted (its pages freed, re-queued first with
the tokens it has) while the pool lacks them. Reports the median and 10th percentile of requests
held at once while requests wait, after the first have finished (so long and short ones mix),
preemptions per request, and the tokens prefilled again per token generated (a preemption's cost). A projection: no model runs, the speed of a step is not modelled (it would
not change who is held, only how fast), and prefix caching is off (distinct prompts).
"""

from __future__ import annotations

import argparse
import collections
import math
from pathlib import Path

import jax
import numpy as np

from bench import common
from jaxspec.decoding.tree import MAX_TREE_ROWS
from jaxspec.models import decoder, kvcache
from jaxspec.serve import KV_MEMORY_FRACTION
from jaxspec.serving.pages import PagePool
from jaxspec.serving.scheduler import row_pages

MODELS = {"qwen3-8b": common.QWEN3_8B}


def weight_bytes(cfg) -> int:
    leaves = jax.tree.leaves(decoder.param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple))
    return sum(math.prod(s) for s in leaves) * 2  # bf16


def simulate(pool: PagePool, prompt: int, outputs: list[int], slots: int, horizon: int) -> dict:
    """Runs the saturated queue to its end; returns the held-at-once series and the preemptions."""
    need = lambda tokens, total: pool.pages_for(min(tokens + horizon, total) + MAX_TREE_ROWS)
    growing = lambda: sum(len(pages) < need(prompt + outputs[j], prompt + outputs[j]) for j, (pages, *_) in running.items())
    waiting = collections.deque((i, 0) for i in range(len(outputs)))  # (request, tokens it has)
    running: dict[int, list] = {}  # request: [pages, tokens it has, admission order]
    held, preemptions, recomputed, order, finished = [], 0, 0, 0, 0
    while waiting or running:
        while waiting and len(running) < slots:  # admission in order, while the pool has the pages
            i, have = waiting[0]
            wanted = need(prompt + have, prompt + outputs[i])
            if pool.available < wanted + growing():
                break
            pages = pool.allocate(wanted)
            waiting.popleft()
            running[i], order = [pages, have, order], order + 1
        for i in sorted(running, key=lambda i: running[i][2]):  # growth, earliest admitted first
            while i in running:
                pages, have, _ = running[i]
                more = need(prompt + have, prompt + outputs[i]) - len(pages)
                got = pool.allocate(more) if more > 0 else []
                if got is not None:
                    pages += got
                    break
                victim = max(running, key=lambda j: running[j][2])
                pool.release(running[victim][0])
                waiting.appendleft((victim, running.pop(victim)[1]))
                preemptions, recomputed = preemptions + 1, recomputed + prompt + waiting[0][1]
        if finished >= slots // 4 and waiting:  # saturated, past the start (when every request began together)
            held.append(len(running))
        for i in list(running):  # one decode step
            running[i][1] += 1
            if running[i][1] >= outputs[i]:
                pool.release(running.pop(i)[0])
                finished += 1
    return {"held": held, "preemptions": preemptions, "recomputed": recomputed}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=list(MODELS), default="qwen3-8b")
    p.add_argument("--memory-gib", type=float, default=139.0, help="device memory (an H200: about 139 GiB)")
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--new", default="2048,20480", type=lambda s: tuple(int(x) for x in s.split(",")))
    p.add_argument("--page-size", type=int, default=kvcache.DEFAULT_PAGE_SIZE)
    p.add_argument("--slots", type=int, default=256, help="rows of the paged server's state")
    p.add_argument("--horizon", type=int, default=2 * (2 * 7 + 1), help="tokens a row may write before the host sees them (the scheduler's: two segments of "
                        "two vegas iterations at gamma 6)")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--tiny", action="store_true", help="a CPU smoke run: 200 requests")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    args = p.parse_args()
    if args.tiny:
        args.requests = 200
    cfg = MODELS[args.model]
    weights = weight_bytes(cfg)
    free = args.memory_gib * 2**30 - weights
    num_pages = int(KV_MEMORY_FRACTION * free / kvcache.page_bytes(cfg, args.page_size))
    row = row_pages(args.prompt + args.new[1], args.page_size)
    outputs = np.random.default_rng(0).integers(args.new[0], args.new[1] + 1, args.requests).tolist()
    sim = simulate(PagePool(num_pages, args.page_size, prefix_cache=False), args.prompt, outputs, args.slots,
                   args.horizon)
    held = np.asarray(sim["held"])
    result = {**common.run_info(), "projection": True, "model": args.model, "memory_gib": args.memory_gib,
              "weight_gib": weights / 2**30, "kv_pages": num_pages, "page_size": args.page_size,
              "prompt": args.prompt, "new": args.new, "requests": args.requests, "slots": args.slots,
              "held_by_slots": (num_pages - 1) // row, "held_paged_median": float(np.median(held)),
              "held_paged_p10": float(np.percentile(held, 10)),
              "preemptions_per_request": sim["preemptions"] / args.requests,
              "recomputed_per_generated": sim["recomputed"] / sum(outputs)}
    common.write_json(args.out / f"paged_capacity_{args.model}.json", result)
    print(f"PROJECTION, {args.model} on {args.memory_gib:g} GiB: {num_pages} pages of {args.page_size} tokens "
          f"({weights / 2**30:.1f} GiB of weights)")
    print(common.markdown_table([result], [("slots of the context", "held_by_slots", "d"),
                                           ("paged, median held", "held_paged_median", ".0f"),
                                           ("paged, p10 held", "held_paged_p10", ".0f"),
                                           ("preemptions / request", "preemptions_per_request", ".2f"),
                                           ("tokens prefilled again / generated", "recomputed_per_generated", ".3f")]))


if __name__ == "__main__":
    main()
