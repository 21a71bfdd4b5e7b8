"""Running a batch end to end: prompts to token ids, the batch through the scheduler, timings, stats.

Shared by the CLIs (`generate`, `tune`), the tests and the benchmarks. A batch runs as a client of the
serving scheduler (`serving.scheduler.Scheduler`, one slot per row, every row admitted in one
prefill), so the CLI and the server decode on one path. Programs are compiled on first use and their
compile time is reported apart, as is the decode program's first call in the process (a call of no
iterations, which loads it on the device: `Scheduler.load`); prefill and decode are timed separately:
decode tokens/s counts the tokens produced by the decode loop (every generated token but the first,
which prefill samples) over the decode loop's wall time.

`--method auto` is the same run given the planner's plan: it decodes with the planner's choice,
refines it over the first segments (`planner.Refinement`) and switches strategy in place.
"""

from __future__ import annotations

import dataclasses
import functools
import resource
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from jaxspec import planner
from jaxspec.decoding import engine
from jaxspec.errors import JaxspecError, out_of_memory_as
from jaxspec.models.kvcache import cache_bytes
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import SpecConfig
from jaxspec.decoding.tree import MAX_TREE_ROWS
from jaxspec.serving.requests import Request
from jaxspec.serving.scheduler import Scheduler
from jaxspec.tokenizer import Tokenizer

# Decode iterations between progress updates and between chunks of streamed text. A segment's end idled the
# device ~1.6 ms at one row while the host read its report and dispatched the next: at 16, SmolLM2's plain decoding
# ran 15% slower on an H200 and an eagle tree 11%, at 64 the tree 3% (bench/NOTES.md, "what auto's and the CLI's
# segments cost"); still ~20 updates a second there. Segments are now queued one ahead (`serving.scheduler`).
PROGRESS_SEGMENT = 64


@dataclasses.dataclass
class Batch:
    ids: np.ndarray  # [B, P] right-padded
    lengths: np.ndarray  # [B]


@dataclasses.dataclass
class Auto:
    """An auto run (a plan given): the final strategy's spec, the plan, the switches and the refinement segments."""

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
    auto: Auto | None = None  # what an auto run chose and switched
    load_s: float = 0.0  # the programs' first calls, of no iterations (`Scheduler._load`), apart from decode_s

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


def read_prompt(path: Path) -> str:
    """The text of a --prompt-file (one-line errors)."""
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise JaxspecError(f"cannot read prompt file {path}: {e}") from None


def resolve_max_len(batch: Batch, max_new_tokens: int, max_len: int | None, model_max: int) -> int:
    """Total length cap (prompt + generated) of the run: the model's context unless `max_len` lowers
    it; the prompts must leave room for one token."""
    longest = int(batch.lengths.max())
    if max_len is not None and not 2 <= max_len <= model_max:
        raise JaxspecError(f"--max-len must be in [2, {model_max}] for this model, got {max_len}")
    if max_len is None:
        if longest >= model_max:
            raise JaxspecError(f"prompt of {longest} tokens does not fit the model's context of {model_max} tokens")
        return min(longest + max_new_tokens, model_max)
    if longest >= max_len:
        raise JaxspecError(f"prompt of {longest} tokens does not fit --max-len {max_len} (it needs room to generate)")
    return max_len


@functools.lru_cache(maxsize=None)
def prefill_fn(cfg, max_len: int, backend: str, chunk: int, head=None):
    """jit-compiled `engine.prefill_cache`; it does not depend on the method, so runs can share its cache
    (with an EAGLE-3 `head`, eagle's runs too)."""
    return jax.jit(functools.partial(engine.prefill_cache, cfg=cfg, max_len=max_len, backend=backend, chunk=chunk,
                                     head=head))


def decode_fns(cfg, spec: SpecConfig, sampling: SamplingConfig, max_len: int):
    """jit-compiled engine (start, decode) for the static part of `spec`, for the tests and the
    step benchmarks that drive the engine's loop themselves (pass `spec.budget()` to start, so runs
    that differ only in ratio or min_tokens share one compilation). Both donate the cache (start its
    prefilled cache, decode its state): to reuse one prefill for several runs, pass each a copy."""
    return _decode_fns(cfg, spec.compiled(max_len), sampling, max_len)


@functools.lru_cache(maxsize=None)
def _decode_fns(cfg, spec: SpecConfig, sampling: SamplingConfig, max_len: int):
    eng = engine.Engine(cfg, spec, sampling, max_len)
    return jax.jit(eng.start, donate_argnums=1), jax.jit(eng.decode, donate_argnums=1)


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
    plan: planner.Plan | None = None,
    mesh=None,
    shrink: bool = False,
) -> Run:
    """Runs one batch through a scheduler with a slot per row: admits every row in one prefill
    (timed), decodes to the end (timed; with a progress bar, in segments) and counts compile time
    apart. Running out of device memory is a JaxspecError naming the KV cache size.

    `cache`, if given, is this batch's `prefill_fn` output (donated), used instead of prefilling again.
    `plan` (`--method auto`): decode with `plan.first` on `spec`'s backend and settings, refine and
    switch; `run.auto` says what ran, and the stats sum over strategies (acceptance by depth padded
    to the deepest). Row b samples with its own key, derived from `seed` and b. `mesh`: run
    tensor-parallel over it (`params` split by `models.sharding.shard_params`). `shrink`: as rows
    finish, the unfinished ones move into a smaller batch (the scheduler's `shrink`): it pays where
    the decode outlasts the compiling of a program set for each smaller row count (one process
    running several batches, or long outputs).
    """
    return _memory_checked(
        cfg, batch, max_len,
        lambda: _run(params, cfg, batch, spec, sampling, max_len, max_new_tokens, stop_ids, seed, progress, cache, plan, mesh,
                     shrink),
    )


def timed_runs(run: Callable[[int], Run], seeds: Sequence[int]) -> tuple[Run, list[Run]]:
    """(first, timed): run(seeds[0]) once untimed, then run(seed) for each seed. A program's first
    execution costs more once (XLA loads its kernels and builds its command buffers: on an H100 ~6 ms
    for a plain 256-token SmolLM2 run, 13-18 ms for an eagle tree's, 4-25% of such a run; bench/NOTES.md,
    "a program's first executions"). Timed, that cost fell on the first seed alone, and with it on that
    seed's text, whose acceptance a sampled comparison samples. A fresh `generate` pays it once: the
    first run tells what that sees. Since the decode program's first call of no iterations is timed
    apart (`Run.load_s`), the first run holds only what that call does not carry."""
    first = run(seeds[0])
    return first, [run(seed) for seed in seeds]


def _memory_checked(cfg, batch: Batch, max_len: int, run):
    """run(), with the device running out of memory told as one line naming the KV cache size."""
    B = len(batch.lengths)
    with out_of_memory_as(lambda: f"batch {B} x {max_len} tokens needs "
                          f"{cache_bytes(cfg, B, max_len + MAX_TREE_ROWS) / 2**30:.1f} GiB of KV cache on top of the "
                          "weights; lower --max-len or the batch"):
        return run()


def _run(params, cfg, batch, spec, sampling, max_len, max_new_tokens, stop_ids, seed, progress, cache, plan, mesh,
         shrink) -> Run:
    B = len(batch.lengths)
    scheduler = Scheduler(params, cfg, None, spec, slots=B, max_len=max_len, stop_ids=tuple(stop_ids), sampling=sampling,
                          plan=plan, queue_limit=0, segment=PROGRESS_SEGMENT if progress else None, static=True,
                          mesh=mesh, shrink=shrink)
    seeds = np.random.SeedSequence(seed % (1 << 32)).generate_state(B)
    last, generated = {}, np.zeros((B,), np.int64)

    def listener(b):
        def hear(delta):
            generated[b] += len(delta.token_ids)
            if delta.finish_reason is not None:
                last[b] = delta
        return hear

    handles = []
    for b, n in enumerate(batch.lengths):
        request = Request(tuple(batch.ids[b, :n].tolist()), min(max_new_tokens, max_len - int(n)), sampling, int(seeds[b]))
        handles.append(scheduler.submit(request, listener(b)))

    def timed(work) -> float:
        """Wall seconds of work(), less the compiling and the programs' first calls it did."""
        start, setup = time.perf_counter(), scheduler.compile_s + scheduler.load_s
        work()
        return time.perf_counter() - start - (scheduler.compile_s + scheduler.load_s - setup)

    prefill_s = timed(lambda: scheduler.admit_waiting(cache))
    scheduler.load()

    def decode():
        while len(last) < B:
            scheduler.step()
            if progress:
                _draw_progress(int(generated.sum()), B * max_new_tokens, done=len(last) == B)

    decode_s = timed(decode)
    if errors := [d.error for d in last.values() if d.error]:
        raise JaxspecError(f"generation failed: {errors[0]}")
    rows = [last[b].stats for b in range(B)]
    depth = max(len(r.accepted_by_depth) for r in rows)
    column = lambda name: np.array([getattr(r, name) for r in rows], np.int32)
    by_depth = np.array([(*r.accepted_by_depth, *(0,) * (depth - len(r.accepted_by_depth))) for r in rows], np.int32)
    stats = engine.SpecStats(column("iterations"), column("drafted"), column("accepted"), by_depth.reshape(B, depth))
    tokens = np.zeros((B, max_len), np.int32)  # from the handles: a shrunk state holds only its last rows
    for b, h in enumerate(handles):
        row = (*h.request.ids, *h.tokens)
        tokens[b, : len(row)] = row
    length = np.array([len(h.request.ids) + len(h.tokens) for h in handles], np.int32)
    output = engine.GenerateOutput(tokens, length, batch.lengths.astype(np.int32), stats)
    auto = None
    if plan is not None:
        r = scheduler.refinement
        auto = Auto(scheduler.spec, plan, r.switches, r.segments, r.lossless)
    return Run(output, scheduler.compile_s, prefill_s, decode_s, auto, scheduler.load_s)


def _draw_progress(generated: int, total: int, done: bool) -> None:
    """A progress bar on stderr (drawn between decode segments)."""
    fraction = min(1.0, generated / total)
    print(f"\r[{'#' * int(30 * fraction):<30}] {generated}/{total} tokens", end="\n" if done else "", file=sys.stderr)


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
    an auto run, the final strategy's: `run.auto.spec`)."""
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
        "load_s": run.load_s,
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
