"""End-to-end decode throughput of every method side by side, against the floor and a peer.

    PYTHONPATH=. python3 bench/throughput.py [--parts smollm2,qwen3,peer] [--tuned FILE] [--tiny] [--out DIR]

smollm2 (real SmolLM2-135M weights, bf16, pallas backend, greedy), two workloads on the same prompts
for every method at its tuned (gamma, ratio): (a) short chat prompts + 2048 new tokens at batch 16;
(b) long prompts of real text (2K-7.5K tokens) + 512 new tokens at batch 1 and 4. Per method: decode
tokens/s, tokens per iteration, acceptance by draft position and, for plain, the ratio to the floor.
qwen3 (Qwen3-8B shapes, random bf16 weights: latency only): a random KV cache stands in for the
prompt; per method and context (4K-32K, batch 1 or --qwen3-batch) the time of one iteration, its split into draft /
verify / select (each stage timed alone on the same state) and the selection overhead; then the
throughput each method WOULD reach with the tokens per iteration measured on SmolLM2 workload (b)
(a projection, labelled so). peer: transformers generate (torch, static cache, SDPA, bf16) with the
same SmolLM2 weights and prompts, plain greedy.
Writes DIR/throughput.json, DIR/throughput.md and PNG plots; prints the tables last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import functools
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from jaxspec import corpus, files
from jaxspec.decoding import engine
from jaxspec.models import decoder
from jaxspec.decoding.drafters import Drafter, make_drafter
from jaxspec.runner import Batch, decode_fns, encode_prompts, prefill_fn, run_generation
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import SpecConfig, spec_from_settings

METHODS = ("plain", "vegas", "all_rows", "last_accepted", "stream", "quest", "ngram")
DEFAULT_TUNING = {m: {"gamma": 6, "ratio": 0.07} for m in METHODS}
GREEDY = SamplingConfig()
SHORT_PROMPTS = [
    "Write a detailed essay on the history of the printing press and its effects on Europe.",
    "Explain step by step how a compiler turns source code into machine code.",
    "Tell a long story about a lighthouse keeper who finds a message in a bottle.",
    "Describe, with examples, how photosynthesis works in plants and algae.",
]
CONTEXTS = (4096, 8192, 16384, 32768)
STAGE_REPEATS = 8


@dataclasses.dataclass
class Workload:
    name: str
    batches: tuple[int, ...]
    new_tokens: int

    def prompts(self, tokenizer, batch: int) -> list[str]:
        if self.name == "a":
            return [SHORT_PROMPTS[i % len(SHORT_PROMPTS)] for i in range(batch)]
        lengths = (7500, 2000, 4000, 6000)
        return [corpus.long_prompt(tokenizer, lengths[i % 4], offset=11 * i) for i in range(batch)]


def spec_for(method: str, tuning: dict, backend: str, k_max: int | None = None, eagle=None) -> SpecConfig:
    """The method's SpecConfig at its tuned gamma, ratio and metric (the settings this benchmark takes
    from a tuned file; its other settings at their defaults); `eagle`: method eagle's head config."""
    choice = tuning[method] if method in tuning else DEFAULT_TUNING.get(method, {})
    tuned = {key: choice.get(key) for key in ("gamma", "ratio", "metric")}
    return spec_from_settings(method, tuned=tuned, backend=backend, k_max=k_max, eagle=eagle)


# ---------------------------------------------------------------- stage timing


def stage_fns(params, cfg, spec: SpecConfig, max_len: int, state: engine.DecodeState,
              sampling=GREEDY) -> tuple[dict, engine.DecodeState]:
    """The loop iteration and its draft / verify / select stages as functions that donate and return
    the state (so no stage pays for copying the cache): {name: (fn, iterations per call)}; and the
    state, through one verification when the method selects (its scores feed the select stage).
    The draft stage samples its drafts by `sampling`; verify is the target pass only (the
    acceptance, and with it the target's sampling, is in the iteration)."""
    static = spec.compiled(max_len)
    drafter = make_drafter(static, cfg, max_len)
    _, decode = decode_fns(cfg, spec, sampling, max_len)
    # One decode call of STAGE_REPEATS iterations (whole groups of select_every): the loop as it runs,
    # without per-call dispatch.
    repeats = static.whole_groups(STAGE_REPEATS)
    stages = {"iteration_ms": (lambda s: decode(params, s, max_iterations=jnp.int32(repeats)), repeats)}
    tree = static.shape
    rows = 1 if tree is None else tree.rows
    tokens = jnp.broadcast_to(engine.pending_tokens(state)[:, None], (state.length.shape[0], rows))
    if drafter is not None and drafter.uses_model:
        draft = jax.jit(lambda p, s: engine.draft(p, cfg, static, sampling, drafter, s, s.key)[2], donate_argnums=1)
        stages["draft_ms"] = (functools.partial(draft, params), 1)
    if drafter is not None and not drafter.uses_model:  # n-gram lookup, the EAGLE head: the tree's tokens kept

        @functools.partial(jax.jit, donate_argnums=1)
        def propose(p, s):
            drafted, _, cache, dstate = drafter.draft(p, s.tokens, s.length, s.done, s.cache, s.drafter, s.key,
                                                      engine.rules(sampling, s))
            return dataclasses.replace(s, cache=cache, drafter=dstate), drafted

        stages["draft_ms"] = (lambda s: propose(params, s)[0], 1)

    @functools.partial(jax.jit, donate_argnums=1)
    def verify(p, s):
        # The logits are returned so that the LM head is not compiled away.
        logits, cache, scores = engine.verify(p, cfg, static, drafter, s, tokens, tree)
        return dataclasses.replace(s, cache=cache), scores, logits

    stages["verify_ms"] = (lambda s: verify(params, s)[0], 1)
    if drafter is not None and type(drafter).after_verify is not Drafter.after_verify:  # it selects
        state, scores, _ = verify(params, state)
        zeros = jnp.zeros_like(state.length)
        path = jnp.zeros((state.length.shape[0], tree.depth + 1), jnp.int32)
        select = jax.jit(
            lambda s, scores: dataclasses.replace(
                s, drafter=drafter.after_verify(s.drafter, s.budget, scores, s.cache, s.length - 1, zeros, path)),
            donate_argnums=0,
        )
        stages["select_ms"] = (lambda s: select(s, scores), 1)
    return stages, state


def stage_times(params, cfg, spec: SpecConfig, max_len: int, state: engine.DecodeState) -> tuple[dict, engine.DecodeState]:
    """Milliseconds of one iteration and of its stages (`stage_fns`), each timed alone on `state`."""
    stages, state = stage_fns(params, cfg, spec, max_len, state)
    times = {}
    for name, (fn, per_call) in stages.items():
        calls = 1 if per_call > 1 else STAGE_REPEATS
        state = jax.block_until_ready(fn(state))  # compile and warm up
        start = time.perf_counter()
        for _ in range(calls):
            state = fn(state)
        jax.block_until_ready(state)
        times[name] = (time.perf_counter() - start) / (calls * per_call) * 1e3
    if "select_ms" in times:
        times["select_pct"] = 100 * times["select_ms"] / times["iteration_ms"]
    return times, state


# ---------------------------------------------------------------- SmolLM2, real weights


def smollm2_part(args, rates: dict, tuning: dict, result: dict) -> None:
    from jaxspec.loaders import load_model

    cfg, params, tokenizer = load_model(args.model, dtype="bfloat16")
    weight_bytes = common.tree_bytes(params)
    workloads = [Workload("a", (2,), 32), Workload("b", (1,), 48)] if args.tiny else [Workload("a", (16,), 2048), Workload("b", (1, 4), 512)]
    for workload in workloads:
        for batch_size in workload.batches:
            batch = encode_prompts(tokenizer, workload.prompts(tokenizer, batch_size), chat=True)
            max_len = int(batch.lengths.max()) + workload.new_tokens
            cache = prefill_fn(cfg, max_len, args.backend, 256)(params, jnp.asarray(batch.ids), jnp.asarray(batch.lengths))
            for method in args.methods:
                row = {"model": "smollm2-135m", "workload": workload.name, "batch": batch_size,
                       "prompt_tokens": int(batch.lengths.mean()), "new_tokens": workload.new_tokens, "method": method}
                guarded(row, lambda: row.update(smollm2_run(params, cfg, batch, cache, spec_for(method, tuning, args.backend),
                                                            max_len, workload.new_tokens, weight_bytes, rates)))
                result["rows"].append(row)
                common.write_json(args.out / "throughput.json", result)


def smollm2_run(params, cfg, batch: Batch, cache, spec: SpecConfig, max_len: int, new: int, weight_bytes: int, rates: dict) -> dict:
    run = run_generation(params, cfg, batch, spec=spec, sampling=GREEDY, max_len=max_len, max_new_tokens=new,
                         stop_ids=(), cache=jax.tree.map(jnp.copy, cache))
    stats = jax.device_get(run.output.stats)
    iterations = int(stats.iterations.sum())
    generated = np.asarray(run.output.length - run.output.prompt_len)
    out = {
        **spec.describe(),
        "decode_tokens_per_s": float(generated.sum() - len(generated)) / run.decode_s,
        "tokens_per_iteration": (int(stats.accepted.sum()) + iterations) / iterations,
        "acceptance_by_depth": (stats.accepted_by_depth.sum(0) / iterations).tolist(),
        "compile_s": run.compile_s,
    }
    if spec.method == "plain":
        steps = int(generated.max()) - 1
        context = int(batch.lengths.mean()) + new // 2
        floor = common.step_floor_s(cfg, weight_bytes, len(generated), context, rates["copy_GBps"])
        out |= {"step_ms": run.decode_s / steps * 1e3, "floor_ms": floor * 1e3, "ratio_to_floor": run.decode_s / steps / floor}
    return out


# ---------------------------------------------------------------- Qwen3-8B shapes, latency


def qwen3_part(args, rates: dict, tuning: dict, result: dict) -> None:
    from bench.decode import TINY_CFG

    cfg = TINY_CFG if args.tiny else common.QWEN3_8B
    params = decoder.init_params(cfg, jax.random.key(0))
    weight_bytes = common.tree_bytes(params)
    contexts = (512, 1024) if args.tiny else args.contexts
    batch_size = args.qwen3_batch
    max_len, slots, k_max = common.random_lengths(max(contexts))
    cache = common.random_cache(cfg, batch_size, slots, jax.random.key(1))
    for method in args.methods:
        spec = spec_for(method, tuning, args.backend, k_max=k_max if method != "plain" else None)
        for context in contexts:
            row = {"model": "qwen3-8b-shapes (random weights: latency only)", "workload": "latency", "batch": batch_size,
                   "context": context, **spec.describe()}

            def measure():
                nonlocal cache
                state = common.random_state(params, cfg, spec, cache, context, max_len)
                times, state = stage_times(params, cfg, spec, max_len, state)
                cache = state.cache  # the cache travelled through the stages (donated); reuse it
                row.update(times)
                if method == "plain":
                    floor = common.step_floor_s(cfg, weight_bytes, batch_size, context, rates["copy_GBps"]) * 1e3
                    row.update(floor_ms=floor, ratio_to_floor=row["iteration_ms"] / floor)

            guarded(row, measure)
            if cache.k.is_deleted():  # a failure left it donated
                cache = common.random_cache(cfg, batch_size, slots, jax.random.key(1))
            result["rows"].append(row)
            common.write_json(args.out / "throughput.json", result)
    earlier = json.loads(args.project_from.read_text())["rows"] if args.project_from else []
    sweep = json.loads(args.acceptance.read_text())["rows"] if args.acceptance else None
    project(result, earlier, sweep)


def project(result: dict, smollm2_rows: list[dict], sweep: list[dict] | None = None) -> None:
    """Qwen3-8B throughput = batch x tokens per iteration / iteration time, the tokens per iteration
    taken from SmolLM2 workload b at batch 1 (the method's tuned pair), or, given `sweep` (the rows of
    bench/acceptance.py), from its greedy row at the same (method, gamma, ratio); plain counts 1."""
    if sweep is None:
        measured = {r["method"]: r["tokens_per_iteration"] for r in result["rows"] + smollm2_rows
                    if r["model"] == "smollm2-135m" and r["workload"] == "b" and r["batch"] == 1 and "tokens_per_iteration" in r}
        lookup = lambda row: measured.get(row["method"])
    else:
        measured = {(r["method"], r["gamma"], r["ratio"]): r["tokens_per_iteration"] for r in sweep if r["sampling"] == "greedy"}
        lookup = lambda row: 1.0 if row["method"] == "plain" else measured.get((row["method"], row["gamma"], row["ratio"]))
    for row in result["rows"]:
        tokens = lookup(row) if row["workload"] == "latency" and "iteration_ms" in row else None
        if tokens is not None:
            row["projected_tokens_per_iteration"] = tokens
            row["projected_tokens_per_s"] = row["batch"] * tokens / row["iteration_ms"] * 1e3


# ---------------------------------------------------------------- peer: transformers


def peer_part(args, result: dict) -> None:
    """transformers generate, static cache, SDPA, bf16, greedy: workloads (a) and (b) at batch 1."""
    import torch
    import transformers

    from jaxspec.loaders import load_model, smollm2_path

    path = Path(args.model) if args.model != "smollm2" else smollm2_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    _, _, tokenizer = load_model(args.model, dtype="bfloat16")
    for workload in [w for w in (Workload("a", (16,), 2048), Workload("b", (1,), 512)) if w.name in args.peer_workloads]:
        batch_size = workload.batches[0]
        batch = encode_prompts(tokenizer, workload.prompts(tokenizer, batch_size), chat=True)
        row = {"model": "smollm2-135m", "workload": workload.name, "batch": batch_size, "method": "transformers (peer)",
               "prompt_tokens": int(batch.lengths.mean()), "new_tokens": workload.new_tokens}

        def measure():
            width = batch.ids.shape[1]  # left padding, as transformers expects for a decoder-only batch
            left = np.zeros_like(batch.ids)
            for b, n in enumerate(batch.lengths):
                left[b, width - n :] = batch.ids[b, :n]
            ids = torch.tensor(left, device="cuda")
            mask = torch.tensor(np.arange(width)[None] >= (width - batch.lengths)[:, None], device="cuda")

            def gen(n):
                torch.cuda.synchronize()
                start = time.perf_counter()
                hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            cache_implementation="static", pad_token_id=0)
                torch.cuda.synchronize()
                return time.perf_counter() - start

            # The static cache is sized prompt + max_new_tokens, so each length is its own compiled graph:
            # warm both up before timing (a first run of 2026-11-22 timed a compilation: 9.6 tok/s).
            gen(1), gen(workload.new_tokens)
            first, full = gen(1), gen(workload.new_tokens)
            row.update(decode_tokens_per_s=batch_size * (workload.new_tokens - 1) / (full - first))

        guarded(row, measure)
        result["rows"].append(row)
        common.write_json(args.out / "throughput.json", result)


# ---------------------------------------------------------------- output


def guarded(row: dict, fn) -> None:
    """Runs one measurement; a failure is recorded in the row and the run goes on."""
    try:
        fn()
    except Exception as e:  # one failing configuration must not end a run on a leased GPU
        row["error"] = "".join(traceback.format_exception_only(e)).strip().splitlines()[0][:400]
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)


def tables(result: dict) -> str:
    rows = result["rows"]
    smol = [r for r in rows if r["model"] == "smollm2-135m"]
    qwen = [r for r in rows if r["workload"] == "latency"]
    return "\n\n".join([
        f"{result['device']}, copy {result['rates']['copy_GBps']:.0f} GB/s, bf16 matmul {result['rates']['matmul_TFLOPs']:.0f} TFLOP/s, {result['date']}",
        "SmolLM2-135M (real weights), greedy, pallas backend:",
        common.markdown_table(smol, [
            ("workload", "workload", "s"), ("B", "batch", "d"), ("prompt", "prompt_tokens", "d"), ("method", "method", "s"),
            ("γ", "gamma", "d"), ("ratio", "ratio", ".3f"), ("decode tok/s", "decode_tokens_per_s", ".0f"),
            ("tok/iter", "tokens_per_iteration", ".2f"), ("x floor", "ratio_to_floor", ".2f"), ("error", "error", "s"),
        ]),
        f"Qwen3-8B shapes, random weights (latency; projected tok/s = batch x the tokens/iteration of "
        f"{'the acceptance sweep' if result.get('acceptance') else 'SmolLM2 workload b'} / iteration time):",
        common.markdown_table(qwen, [
            ("B", "batch", "d"), ("context", "context", "d"), ("method", "method", "s"), ("γ", "gamma", "d"), ("ratio", "ratio", ".2f"),
            ("metric", "metric", "s"), ("iter ms", "iteration_ms", ".2f"),
            ("draft ms", "draft_ms", ".2f"), ("verify ms", "verify_ms", ".2f"), ("select ms", "select_ms", ".3f"),
            ("select %", "select_pct", ".1f"), ("x floor", "ratio_to_floor", ".2f"),
            ("tok/iter (projection)", "projected_tokens_per_iteration", ".2f"), ("projected tok/s", "projected_tokens_per_s", ".0f"),
            ("error", "error", "s"),
        ]),
    ])


def plots(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    qwen = [r for r in result["rows"] if r["workload"] == "latency" and "projected_tokens_per_s" in r]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in METHODS:
        points = sorted((r["context"], r["projected_tokens_per_s"]) for r in qwen if r["method"] == method)
        if points:
            ax.plot(*zip(*points), marker="o", label=method)
    ax.set(xscale="log", xlabel="context (tokens)", ylabel=f"projected decode tokens/s (batch {qwen[0]['batch'] if qwen else 1})",
           title=f"Qwen3-8B shapes on {result['device']} (projection)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_context.png", dpi=120)

    smol = [r for r in result["rows"] if r["model"] == "smollm2-135m" and r["workload"] == "b" and r["batch"] == 1 and r.get("acceptance_by_depth")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in smol:
        ax.plot(range(1, len(r["acceptance_by_depth"]) + 1), r["acceptance_by_depth"], marker="o", label=f"{r['method']} (γ={r['gamma']})")
    ax.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.02), title="SmolLM2-135M, long prompts (workload b)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "acceptance_by_position.png", dpi=120)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="smollm2,qwen3,peer", type=lambda s: s.split(","))
    p.add_argument("--methods", default=",".join(METHODS), type=lambda s: s.split(","))
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), type=lambda s: tuple(int(x) for x in s.split(",")))
    p.add_argument("--qwen3-batch", type=int, default=1, help="batch of the Qwen3-8B latency part (8 x 32K fits an H100)")
    p.add_argument("--peer-workloads", default="a,b", type=lambda s: s.split(","))
    p.add_argument("--tuned", type=Path, default=None, help="a `python -m jaxspec.tune` file (default: gamma 6, ratio 0.07)")
    p.add_argument("--model", default="smollm2", help="SmolLM2: 'smollm2' or a path to its GGUF")
    p.add_argument("--project-from", type=Path, default=None, help="a throughput.json whose SmolLM2 rows give the tokens per iteration of the projection")
    p.add_argument("--acceptance", type=Path, default=None,
                   help="a bench/acceptance.py JSON: project with its greedy tokens per iteration at each method's (gamma, ratio)")
    p.add_argument("--backend", default="pallas" if jax.default_backend() == "gpu" else "reference")
    p.add_argument("--tiny", action="store_true", help="tiny sizes: a CPU smoke test of this script")
    p.add_argument("--out", type=Path, default=common.RESULTS)
    return p.parse_args()


def main():
    args = parse_args()
    tuning = json.loads(args.tuned.read_text())["methods"] if args.tuned else DEFAULT_TUNING
    result = common.run_info() | {"rates": common.measure_rates(args.tiny), "tuning": tuning, "rows": [],
                                  "acceptance": str(args.acceptance) if args.acceptance else None}
    for part, fn in (("smollm2", smollm2_part), ("qwen3", qwen3_part)):
        if part in args.parts:
            fn(args, result["rates"], tuning, result)
    if "peer" in args.parts:
        peer_part(args, result)
    common.write_json(args.out / "throughput.json", result)
    text = tables(result)
    files.write_text(args.out / "throughput.md", text + "\n")
    plots(result, args.out)
    print(text)


if __name__ == "__main__":
    main()
