"""Running a batch end to end: prompts to token ids, compiled prefill/start/decode, timings, stats.

Shared by the CLIs (`generate`, `tune`), the tests and the benchmarks. Prefill and decode are compiled
ahead of time (compile time is reported apart) and timed separately: decode tokens/s counts the tokens
produced by the decode loop (every generated token but the first, which prefill samples) over the
decode loop's wall time.

`run_auto` is `--method auto`: it decodes with the planner's choice, refines it over the first
segments (`decoding.planner.decide`) and switches strategy in place (`engine.switch`); executables are
compiled when first needed, and their compile time is counted apart from decode time too.
"""

from __future__ import annotations

import dataclasses
import functools
import resource
import shutil
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding import engine, planner
from jaxspec.errors import JaxspecError
from jaxspec.models.kvcache import cache_bytes
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import SpecConfig
from jaxspec.decoding.tree import MAX_TREE_ROWS
from jaxspec.tokenizer import Tokenizer

PROGRESS_SEGMENT = 16  # decode iterations between progress updates


@dataclasses.dataclass
class Batch:
    ids: np.ndarray  # [B, P] right-padded
    lengths: np.ndarray  # [B]


@dataclasses.dataclass
class Auto:
    """A `run_auto` run: the final strategy's spec, the plan, the switches and the refinement segments."""

    spec: SpecConfig
    plan: planner.Plan
    switches: list[dict]
    segments: list[dict]
    lossless: bool  # every strategy that ran was lossless


@dataclasses.dataclass
class Run:
    """What one generation produced and how long each phase took."""

    output: engine.GenerateOutput
    compile_s: float
    prefill_s: float
    decode_s: float
    auto: Auto | None = None  # what `run_auto` chose and switched

    def generated(self) -> list[np.ndarray]:
        tokens, length, prompt_len = (np.asarray(x) for x in (self.output.tokens, self.output.length, self.output.prompt_len))
        return [tokens[b, prompt_len[b] : length[b]] for b in range(len(length))]


def encode_prompts(tokenizer: Tokenizer, prompts: list[str], chat: bool) -> Batch:
    """Token ids of each prompt (through the chat template when `chat`), right-padded into one batch."""
    ids = []
    for text in prompts:
        if not text.strip():
            raise JaxspecError("empty prompt")
        if chat:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            ids.append(tokenizer.encode(rendered))
        else:
            ids.append(tokenizer.encode(text, add_special_tokens=True))
    lengths = np.array([len(x) for x in ids], np.int32)
    batch = np.zeros((len(ids), lengths.max()), np.int32)
    for b, x in enumerate(ids):
        batch[b, : len(x)] = x
    return Batch(batch, lengths)


def resolve_max_len(batch: Batch, max_new_tokens: int, max_len: int | None, model_max: int) -> int:
    """Total length cap (prompt + generated) of the run: the model's context unless `max_len` says
    otherwise; the prompts must leave room for one token."""
    longest = int(batch.lengths.max())
    if max_len is None:
        if longest >= model_max:
            raise JaxspecError(
                f"prompt of {longest} tokens does not fit the model's context of {model_max} tokens (--max-len overrides it)"
            )
        return min(longest + max_new_tokens, model_max)
    if longest >= max_len:
        raise JaxspecError(f"prompt of {longest} tokens does not fit --max-len {max_len} (it needs room to generate)")
    return max_len


@functools.lru_cache(maxsize=None)
def prefill_fn(cfg, max_len: int, backend: str, chunk: int):
    """jit-compiled `engine.prefill_cache`; it does not depend on the method, so runs can share its cache."""
    return jax.jit(functools.partial(engine.prefill_cache, cfg=cfg, max_len=max_len, backend=backend, chunk=chunk))


def decode_fns(cfg, spec: SpecConfig, sampling: SamplingConfig, max_len: int):
    """jit-compiled (start, decode) for the static part of `spec` (pass `spec.budget()` to start, so
    runs that differ only in ratio or min_tokens share one compilation). Both donate the cache (start
    its prefilled cache, decode its state), so the KV cache is updated in place: to reuse one prefill
    for several runs, pass each a copy."""
    return _decode_fns(cfg, spec.compiled(max_len), sampling, max_len)


@functools.lru_cache(maxsize=None)
def _decode_fns(cfg, spec: SpecConfig, sampling: SamplingConfig, max_len: int):
    start = jax.jit(
        functools.partial(engine.start, cfg=cfg, spec=spec, sampling=sampling, max_len=max_len), donate_argnums=1
    )
    decode = jax.jit(
        functools.partial(engine.decode, cfg=cfg, spec=spec, sampling=sampling, max_len=max_len), donate_argnums=1
    )
    return start, decode


def run_generation(
    params,
    cfg,
    batch: Batch,
    *,
    spec: SpecConfig,
    sampling: SamplingConfig,
    max_len: int,
    max_new_tokens: int,
    stop_ids: tuple[int, ...],
    seed: int = 0,
    progress: bool = False,
    cache=None,
) -> Run:
    """Compiles (timed), prefills (timed) and decodes (timed) one batch; running out of device memory
    is a JaxspecError naming the KV cache size.

    `cache`, if given, is this batch's `prefill_fn` output (donated), used instead of prefilling again.
    """
    return _memory_checked(
        cfg, batch, max_len,
        lambda: _run(params, cfg, batch, spec, sampling, max_len, max_new_tokens, stop_ids, seed, progress, cache),
    )


def _memory_checked(cfg, batch: Batch, max_len: int, run):
    """run(), with XLA's RESOURCE_EXHAUSTED turned into a JaxspecError naming the KV cache size."""
    try:
        return run()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        kv = cache_bytes(cfg, len(batch.lengths), max_len + MAX_TREE_ROWS)
        raise JaxspecError(
            f"out of device memory: batch {len(batch.lengths)} x {max_len} tokens needs {kv / 2**30:.1f} GiB of KV cache "
            "on top of the weights; lower --max-len or the batch"
        ) from None


def _run(params, cfg, batch, spec, sampling, max_len, max_new_tokens, stop_ids, seed, progress, cache) -> Run:
    start, decode = decode_fns(cfg, spec, sampling, max_len)
    ids, lengths = jnp.asarray(batch.ids), jnp.asarray(batch.lengths)
    compile_start = time.perf_counter()
    prefill_exe = None
    if cache is None:
        prefill_exe = prefill_fn(cfg, max_len, spec.backend, spec.prefill_chunk).lower(params, ids, lengths).compile()
        cache_info = prefill_exe.out_info
    else:
        cache_info = cache
    start_args = _start_args(spec, seed, max_new_tokens, stop_ids)
    start_exe = start.lower(params, cache_info, ids, lengths, **start_args).compile()
    decode_exe = decode.lower(params, start_exe.out_info, max_iterations=jnp.int32(0)).compile()
    compile_s = time.perf_counter() - compile_start

    prefill_start = time.perf_counter()
    if prefill_exe is not None:
        cache = prefill_exe(params, ids, lengths)
    state = jax.block_until_ready(start_exe(params, cache, ids, lengths, **start_args))
    prefill_s = time.perf_counter() - prefill_start

    decode_start = time.perf_counter()
    state = _decode_to_end(decode_exe, params, state, max_new_tokens, progress)
    decode_s = time.perf_counter() - decode_start
    return Run(engine.finish(state, max_len), compile_s, prefill_s, decode_s)


def _start_args(spec: SpecConfig, seed: int, max_new_tokens: int, stop_ids: tuple[int, ...]) -> dict:
    """The keyword arguments of `decode_fns`'s start: the key, the spec's budget and the stop rules."""
    return dict(key=jax.random.key(seed), budget=spec.budget(), max_new_tokens=jnp.int32(max_new_tokens),
                stop_ids=jnp.asarray(stop_ids or (-1,), jnp.int32))


def _decode_to_end(decode_exe, params, state, max_new_tokens: int, progress: bool):
    """Runs the compiled decode loop until every row is done (with a progress bar: in segments)."""
    if progress:
        return _decode_with_progress(decode_exe, params, state, max_new_tokens)
    return jax.block_until_ready(decode_exe(params, state, max_iterations=jnp.int32(np.iinfo(np.int32).max)))


def run_auto(
    params,
    cfg,
    batch: Batch,
    *,
    plan: planner.Plan,
    base: SpecConfig,
    sampling: SamplingConfig,
    max_len: int,
    max_new_tokens: int,
    stop_ids: tuple[int, ...],
    seed: int = 0,
    progress: bool = False,
) -> Run:
    """`--method auto`: decodes with `plan.first` (on `base`'s backend and settings), observes it for
    a segment of planner.SEGMENT iterations, and while `planner.decide` names a faster candidate
    (at most planner.MAX_SWITCHES times) switches to it with `engine.switch` and observes again;
    then runs to completion (a table's plain choice runs to completion at once). Decode time counts
    segments, switches and the rest; compiles (when a strategy or switch is first needed) count
    apart. The output's stats are sums over strategies (acceptance by depth padded to the deepest)."""
    return _memory_checked(
        cfg, batch, max_len,
        lambda: _run_auto(params, cfg, batch, plan, base, sampling, max_len, max_new_tokens, stop_ids, seed, progress),
    )


def _run_auto(params, cfg, batch, plan, base, sampling, max_len, max_new_tokens, stop_ids, seed, progress) -> Run:
    ids, lengths = jnp.asarray(batch.ids), jnp.asarray(batch.lengths)
    executables, compile_s = {}, 0.0

    def compiled(name, fn, *args, **kwargs):
        nonlocal compile_s
        if name not in executables:
            start_time = time.perf_counter()
            executables[name] = fn.lower(*args, **kwargs).compile()
            compile_s += time.perf_counter() - start_time
        return executables[name]

    def timed(f, *args, **kwargs):
        start_time = time.perf_counter()
        out = jax.block_until_ready(f(*args, **kwargs))
        return out, time.perf_counter() - start_time

    current = plan.first
    spec = current.spec(base)
    prefill = compiled("prefill", prefill_fn(cfg, max_len, spec.backend, spec.prefill_chunk), params, ids, lengths)
    start_args = _start_args(spec, seed, max_new_tokens, stop_ids)
    start = compiled("start", decode_fns(cfg, spec, sampling, max_len)[0], params, prefill.out_info, ids, lengths, **start_args)
    state, prefill_s = timed(lambda: start(params, prefill(params, ids, lengths), ids, lengths, **start_args))

    def decode_exe(strategy, state):
        fn = decode_fns(cfg, strategy.spec(base), sampling, max_len)[1]
        return compiled(("decode", strategy), fn, params, state, max_iterations=jnp.int32(0))

    decode_s, iterations, totals = 0.0, 0, None
    observations, switches, segments, ran = {}, [], [], {current}
    # A measured table's plain choice has nothing to refine (no drafts to observe): it runs as plain does.
    refine = not (current.plain and plan.source != "cost-model")
    while refine:
        exe = decode_exe(current, state)
        state, seconds = timed(exe, params, state, max_iterations=jnp.int32(0))  # loads it: not observed
        decode_s += seconds
        before = jax.device_get((state.length, state.stats))
        state, seconds = timed(exe, params, state, max_iterations=jnp.int32(planner.SEGMENT))
        decode_s += seconds
        after = jax.device_get((state.length, state.stats))
        seen = _observation(before, after, seconds)
        iterations += seen.iterations
        observations[current] = observations[current].merge(seen) if current in observations else seen
        segments.append({"strategy": current.name, "iterations": seen.iterations, "tokens_per_s": seen.tokens_per_s,
                         "tokens_per_iteration": seen.tokens_per_iteration, "iteration_s": seen.iteration_s})
        if bool(jax.device_get(state.done).all()) or len(switches) == planner.MAX_SWITCHES:
            break
        target, reason = planner.decide(plan.candidates, observations, current, probe_plain=plan.source == "cost-model")
        if target == current:
            break
        totals = _add_stats(totals, after[1])
        spec = target.spec(base)
        fn = _switch_fn(cfg, spec.compiled(max_len), sampling, max_len)
        with warnings.catch_warnings():  # the old tokens buffer is donated but has the old width: expected
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            exe = compiled(("switch", current, target), fn, params, state, spec.budget())
        state, seconds = timed(exe, params, state, spec.budget())
        decode_s += seconds
        switches.append({"iteration": iterations, "from": current.name, "to": target.name, "reason": reason,
                         "observed_tokens_per_s": seen.tokens_per_s})
        current = target
        ran.add(current)

    state, seconds = timed(_decode_to_end, decode_exe(current, state), params, state, max_new_tokens, progress)
    decode_s += seconds
    totals = _add_stats(totals, jax.device_get(state.stats))
    output = engine.GenerateOutput(state.tokens[:, :max_len], state.length, state.prompt_len, totals)
    auto = Auto(current.spec(base), plan, switches, segments, all(s.precision == "strict" for s in ran))
    return Run(output, compile_s, prefill_s, decode_s, auto)


@functools.lru_cache(maxsize=None)
def _switch_fn(cfg, spec: SpecConfig, sampling: SamplingConfig, max_len: int):
    """jit-compiled `engine.switch` to the static `spec` (donates the state)."""
    return jax.jit(functools.partial(engine.switch, cfg=cfg, spec=spec, sampling=sampling, max_len=max_len), donate_argnums=1)


def _observation(before, after, seconds: float) -> planner.Observation:
    """A segment's observation from (length, stats) before and after it (host copies)."""
    (length0, stats0), (length1, stats1) = before, after
    row_iterations = stats1.iterations - stats0.iterations
    accepted = int((stats1.accepted - stats0.accepted).sum())
    total = max(int(row_iterations.sum()), 1)
    return planner.Observation(int(row_iterations.max()), int((length1 - length0).sum()), seconds, (accepted + total) / total)


def _add_stats(total: engine.SpecStats | None, stats: engine.SpecStats) -> engine.SpecStats:
    """Sums per-row counters (host copies); acceptance by depth padded to the deeper of the two."""
    if total is None:
        return stats
    depth = max(total.accepted_by_depth.shape[1], stats.accepted_by_depth.shape[1])
    pad = lambda x: np.pad(x, ((0, 0), (0, depth - x.shape[1])))
    return engine.SpecStats(total.iterations + stats.iterations, total.drafted + stats.drafted,
                            total.accepted + stats.accepted, pad(total.accepted_by_depth) + pad(stats.accepted_by_depth))


def _decode_with_progress(decode_exe, params, state, max_new_tokens: int):
    """Decodes in segments of PROGRESS_SEGMENT iterations, drawing a bar on stderr between them."""
    total = max_new_tokens * state.length.shape[0]
    while True:
        state = decode_exe(params, state, max_iterations=jnp.int32(PROGRESS_SEGMENT))
        done, generated = jax.device_get((state.done, state.length - state.prompt_len))
        fraction = min(1.0, int(generated.sum()) / total)
        print(f"\r[{'#' * int(30 * fraction):<30}] {int(generated.sum())}/{total} tokens", end="", file=sys.stderr)
        if done.all():
            print(file=sys.stderr)
            return state


def gpu_unseen_warning() -> str | None:
    """A warning when this machine has an NVIDIA GPU but JAX runs on the CPU (a CPU-only jaxlib)."""
    has_gpu = Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None
    if has_gpu and jax.default_backend() == "cpu":
        return ("warning: this machine has an NVIDIA GPU but JAX sees none and runs on the CPU; "
                "install the cuda extra: pip install -e '.[cuda]'")
    return None


def describe_device() -> str:
    """`device: <kind> (<platform>)`, then the GPU warning if it applies."""
    device = jax.devices()[0]
    warning = gpu_unseen_warning()
    return f"device: {device.device_kind} ({device.platform})" + (f"\n{warning}" if warning else "")


def peak_memory() -> tuple[str, int]:
    """Peak device memory in bytes where the backend reports it, else the process's peak RSS."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return "device", int(stats["peak_bytes_in_use"])
    return "host_rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def summarize(run: Run, batch: Batch, spec: SpecConfig) -> dict:
    """The stats object of the --json output (and the human stats block); `spec` is the run's (for
    `run_auto`, the final strategy's: `run.auto.spec`)."""
    stats = jax.device_get(run.output.stats)
    generated = int(sum(len(g) for g in run.generated()))
    decode_tokens = generated - len(batch.lengths)
    iterations = int(stats.iterations.sum())
    accepted = int(stats.accepted.sum())
    by_depth = stats.accepted_by_depth.sum(axis=0)
    memory_kind, memory = peak_memory()
    auto = {}
    if run.auto:
        auto = {"method_requested": "auto", "strategy": {"name": planner.Strategy.of(spec).name, **spec.describe()},
                "planned": run.auto.plan.describe(), "switches": run.auto.switches, "segments": run.auto.segments,
                "lossless": run.auto.lossless}
    return {
        **spec.describe(),
        "method_requested": spec.method,
        **auto,
        "backend": spec.backend,
        "batch": len(batch.lengths),
        "prompt_tokens": int(batch.lengths.sum()),
        "generated_tokens": generated,
        "compile_s": run.compile_s,
        "prefill_s": run.prefill_s,
        "decode_s": run.decode_s,
        "prefill_tokens_per_s": float(batch.lengths.sum()) / run.prefill_s,
        "decode_tokens_per_s": decode_tokens / run.decode_s if run.decode_s > 0 else 0.0,
        "iterations": iterations,
        "tokens_per_iteration": (accepted + iterations) / iterations if iterations else 0.0,
        "accepted_per_iteration": accepted / iterations if iterations else 0.0,
        "nodes_verified_per_iteration": int(stats.drafted.sum()) / iterations if iterations else 0.0,
        "draft_tokens": int(stats.drafted.sum()),
        "accepted_tokens": accepted,
        "acceptance_by_depth": [int(x) for x in by_depth],
        "acceptance_rate_by_depth": [float(x) / iterations if iterations else 0.0 for x in by_depth],
        f"peak_{memory_kind}_memory_bytes": memory,
        "device": jax.devices()[0].device_kind,
    }
