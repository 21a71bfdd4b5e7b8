"""The planner behind `--method auto`: which strategy to decode with (DESIGN.md section 4c).

Why: whether speculation pays depends on the regime, and nothing in a method's config knows the
regime. On SmolLM2-135M at batch 1 every step is launch-bound, a sparse draft forward costs as much
as a full one, and the old default (vegas) ran slower than plain decoding (789 vs 908 tok/s on an
H100); at Qwen3-8B shapes and 4 x 128K the KV read dominates and vegas runs 2.2x plain
(bench/NOTES.md). So a run asks the planner, which answers from three sources, best first:

1. A lookup table, measured by `python -m jaxspec.profile` for one model on one device kind: per
   batch size, sampling mode (greedy / sampled: acceptance differs), context bucket and precision
   class, the strategies ranked by measured decode tokens/s. Tables ship in `decoding/tables/`,
   named by the model's fingerprint and the device kind, and are found automatically.
2. Without a table, a cost model from the measured copy bandwidth (`cost_model`): bytes over
   bandwidth plus a per-layer launch overhead for every forward, and an assumed acceptance.
3. Refinement at run time (SSV's Algorithm 1 as designed here; the paper's text was not at hand):
   the run starts with the plan's choice, measures its accepted tokens per iteration and iteration
   time over a segment of SEGMENT iterations, corrects every candidate's prediction by what it saw
   (`corrected`; a strategy's own observations are pooled with its table rate, which counts as one
   more segment), and switches (`engine.switch`, which keeps the output distribution exact) to a
   candidate predicted faster by MARGIN, or to plain when plain is unmeasured and not predicted
   PROBE_MARGIN slower (`decide`); it measures that one for a segment and decides again, at most
   MAX_SWITCHES times. Settled, it keeps watching ngram (`Refinement.watch`): after windows of
   WATCH, 2 WATCH, 4 WATCH ... iterations (back to WATCH after a switch: each check costs a host sync
   and a replay, so their number grows with the log of the run's length) it replays the chain ngram
   candidates over the tokens just committed (`Ngram.replay`: what ngram would have accepted, exact
   in distribution, at no model cost) and switches when one is predicted MARGIN faster than the
   latest window of the running strategy, or, running ngram, when that window falls MARGIN below a
   candidate; so text that starts to repeat itself late (greedy loops, copied passages) is caught,
   and left again, within the switch limit.

A strategy is the part of a SpecConfig the planner chooses (`Strategy`); plain decoding is one, and
it is the fallback: a speculative strategy is chosen only when it is predicted (or measured) at
least MARGIN faster. Precision classes other than `strict` change the output distribution, so they
are candidates only when the user allows them (`allowed_precisions`).

Context buckets: a run belongs to the smallest bucket (upper bound in tokens, BUCKETS) that holds its
longest prompt plus its new tokens, i.e. the longest context it reaches; the profile measures each
bucket at its top (prompts of bucket - new tokens). A table without that bucket answers from the
nearest profiled one (by log distance), and from the nearest profiled batch size if it is within a
factor of 2 of the run's (further away the regime differs, e.g. KV reads dominate at batch 16 and not
at batch 1: the cost model answers instead). A cell's ngram entries measure what ngram could copy
from those prompts, so a run with a much shorter prompt does not use them (NGRAM_PROMPT_SHARE).

A cell's tokens/s is a static batch's, which lasts as long as its slowest row: `Prediction.tail`
says how much of the mean row's rate that kept, at the run's length (`run_tail`), and the refinement
sets its observations against predictions on one basis (`corrected`).

The bytes floor of a step (DESIGN.md section 6) lives here too, as the cost model's base; bench/
uses the same functions.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import pallas_kernels as kernels
from jaxspec import files
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import PRECISIONS, SPARSE_METHODS, SpecConfig
from jaxspec.errors import JaxspecError
from jaxspec.models import draft_weights
from jaxspec.models.config import ModelConfig

BUCKETS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
TABLES = Path(__file__).parent / "tables"  # shipped tables: <fingerprint>_<device>.json
TABLE_FORMAT = 1
SEGMENT = 8  # decode iterations per refinement segment
WATCH = 64  # decode iterations of a settled refinement's first watch window; it doubles while nothing switches
MAX_SWITCHES = 3
MARGIN = 0.1  # a switch, or a speculative choice over plain, needs a predicted gain of 10%
PROBE_MARGIN = 0.25  # plain is measured unless the running strategy beats its corrected prediction by 25%
# ngram drafts copy n-grams of the prompt and the text so far, so its tokens per iteration in a cell
# come from the calibration prompts' text: a run whose prompt is a small share of theirs gets none of
# that (the default CLI prompt, 47 tokens, against 960: 1.0-1.2 tokens per iteration where the cell
# measured 1.4-2.4; bench/NOTES.md, the planner table after the kernels).
NGRAM_PROMPT_SHARE = 0.25
CANDIDATES = 3  # speculative strategies kept beside plain for refinement (each may need a compile)

# Cost model assumptions (documented in cost_model).
LAYER_OVERHEAD_S = 35e-6  # per layer and forward: launches and small kernels
NSA_LAYER_OVERHEAD_S = 60e-6  # per layer, on top, for a forward that runs NSA attention
ITERATION_OVERHEAD_S = 0.4e-3  # per speculative iteration: proposal, acceptance, commit
PRIOR_ACCEPTANCE = {"model": 0.8, "ngram": 0.5}  # geometric: draft i accepted with probability alpha^i
COST_MODEL_RATIO = 0.07


# Strategy fields added after tables were written: their default 1 is stored as None and left out
# of a strategy's JSON, so older tables read as measured and older readers read newer tables.
ONE_AS_NONE = ("select_every", "balance")


@dataclasses.dataclass(frozen=True)
class Strategy:
    """What the planner chooses: method, draft shape (a chain of gamma, or a tree and its traversal),
    sparse ratio, the draft's weights, how often a score drafter selects (`SpecConfig.select_every`),
    how far a sparse drafter's rows share the budget (`SpecConfig.balance`) and, for NSA targets, the
    precision class and verification group. Canonical: fields a method does not use are None, and so
    are select_every 1 and balance 1 (so equal strategies compare and hash equal, and a table written
    before a field reads as it was measured)."""

    method: str = "plain"
    gamma: int | None = None
    tree: tuple[int, ...] | None = None
    traversal: str | None = None
    ratio: float | None = None
    precision: str = "strict"
    group: int = 8
    draft_weights: str = "exact"
    select_every: int | None = None
    balance: float | None = None

    def __post_init__(self):
        for name in ONE_AS_NONE:  # the default 1, stored canonically
            value = getattr(self, name)
            if value == 1 and not isinstance(value, bool):
                object.__setattr__(self, name, None)

    @classmethod
    def of(cls, spec: SpecConfig) -> Strategy:
        plain = spec.method == "plain"
        tree = None if plain or spec.tree is None else tuple(spec.tree)
        return cls(
            method=spec.method,
            gamma=None if plain or tree else spec.gamma,
            tree=tree,
            traversal=spec.traversal if tree else None,
            ratio=spec.ratio if spec.method in SPARSE_METHODS else None,
            precision=spec.precision,
            group=spec.group,
            draft_weights=spec.draft_weights,
            select_every=spec.select_every,  # 1 (stored as None) unless a score method spaces its selections
            balance=spec.balance,  # 1 (stored as None) unless a sparse method shares its budget
        )

    def spec(self, base: SpecConfig) -> SpecConfig:
        """`base` (backend, min_tokens, metric, n-gram sizes) decoding with this strategy; validated."""
        return dataclasses.replace(
            base, method=self.method, gamma=base.gamma if self.gamma is None else self.gamma, tree=self.tree,
            traversal=self.traversal or "bfs", ratio=self.ratio if self.ratio is not None else base.ratio,
            precision=self.precision, group=self.group, draft_weights=self.draft_weights,
            select_every=1 if self.select_every is None else self.select_every,
            balance=1.0 if self.balance is None else self.balance,
        ).validate()

    @property
    def plain(self) -> bool:
        return self.method == "plain"

    @property
    def depth(self) -> int:
        """Most drafts accepted per iteration."""
        return 0 if self.plain else len(self.tree) if self.tree else self.gamma

    @property
    def kind(self) -> str:
        """Whose acceptance this strategy shares: "model" (the target drafting over a KV subset),
        "ngram", or "none" (plain)."""
        return "none" if self.plain else "ngram" if self.method == "ngram" else "model"

    @property
    def name(self) -> str:
        """e.g. 'plain', 'vegas g6 r0.07', 'vegas bfs:3,2,1 r0.07', 'ngram g8', '... approx group 4' (the
        group when it is not the default 8), 'full g6 int8' (draft weights other than exact), 'vegas g6
        r0.07 every 2' (selecting after every 2nd verification), 'vegas g10 r0.07 balance 2' (a shared
        budget)."""
        parts = [self.method]
        if self.tree:
            parts.append(f"{self.traversal}:{','.join(map(str, self.tree))}")
        elif self.gamma:
            parts.append(f"g{self.gamma}")
        if self.ratio is not None:
            parts.append(f"r{self.ratio:g}")
        if self.precision != "strict":
            parts.append(self.precision)
        if self.group != 8:
            parts.append(f"group {self.group}")
        if self.draft_weights != "exact":
            parts.append(self.draft_weights)
        if self.select_every:
            parts.append(f"every {self.select_every}")
        if self.balance:
            parts.append(f"balance {self.balance:g}")
        return " ".join(parts)

    def to_json(self) -> dict:
        """The fields, without select_every and balance while they are the defaults (a table stays
        readable by versions that predate them)."""
        fields = {**dataclasses.asdict(self), "tree": list(self.tree) if self.tree else None}
        return {k: v for k, v in fields.items() if k not in ONE_AS_NONE or v is not None}

    @classmethod
    def from_json(cls, d: dict) -> Strategy:
        """Raises JaxspecError for unknown keys or invalid values."""
        if not isinstance(d, dict) or set(d) - {f.name for f in dataclasses.fields(cls)}:
            raise JaxspecError(f"bad strategy {d!r}")
        tree = d.get("tree")
        return cls.of(cls(**{**d, "tree": tuple(tree) if tree else None}).spec(SpecConfig()))


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A strategy's expected decode throughput (batch total), tokens per iteration (per row) and
    iteration time, from a table or the cost model."""

    strategy: Strategy
    tokens_per_s: float
    tokens_per_iteration: float
    iteration_s: float
    spread: float = 0.0  # of tokens_per_s over a table's repeats (max - min); 0 for the cost model
    iterations: float = 0.0  # decode iterations the table measured it over; 0 for the cost model
    # A table's closed-batch tokens per iteration (its tokens/s times its iteration time, per row)
    # over its mean row's, at most 1: the share of the mean rate its tokens/s kept, a static batch
    # lasting as long as its slowest row (ngram's ~0.5-0.7, the model drafters' ~0.8-0.95 at 8-64
    # rows x 256 tokens on SmolLM2), at the run's length (`lookup`); 1 for the cost model.
    tail: float = 1.0


@dataclasses.dataclass(frozen=True)
class Observation:
    """What a strategy did over refinement segments: loop iterations, tokens committed (all rows),
    host-synced seconds, accepted + 1 tokens per row iteration, and the tokens per iteration of the
    row that gained least among those running the whole segment (a closed batch lasts as long as its
    slowest row, which the mean does not show: reported in the segments, and how a closed batch's
    refinement weighs ngram, `Refinement.closed`)."""

    iterations: int
    tokens: int
    seconds: float
    tokens_per_iteration: float
    slowest_tokens_per_iteration: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def iteration_s(self) -> float:
        return self.seconds / max(self.iterations, 1)

    def at_slowest(self) -> Observation:
        """The observation as its slowest row saw it (tokens and tokens per iteration scaled to that
        row's): the rate of a closed batch, which lasts as long as its slowest row."""
        if not self.slowest_tokens_per_iteration:
            return self
        share = self.slowest_tokens_per_iteration / self.tokens_per_iteration
        return dataclasses.replace(self, tokens=round(self.tokens * share), tokens_per_iteration=self.slowest_tokens_per_iteration)

    def merge(self, other: Observation) -> Observation:
        """Both observations as one: sums, and tokens per iteration weighted by iterations (the
        slowest row's over the observations that have one)."""
        n = self.iterations + other.iterations
        tpi = (self.tokens_per_iteration * self.iterations + other.tokens_per_iteration * other.iterations) / max(n, 1)
        known = [(o.slowest_tokens_per_iteration, o.iterations) for o in (self, other)
                 if o.slowest_tokens_per_iteration is not None]
        slowest = sum(s * i for s, i in known) / max(sum(i for _, i in known), 1) if known else None
        return Observation(n, self.tokens + other.tokens, self.seconds + other.seconds, tpi, slowest)

    @classmethod
    def replayed(cls, tokens, iterations, whole) -> Observation:
        """A replay's observation (no time: it ran no model) from per-row committed tokens and
        replayed iterations [B] and the rows that ran the whole window [B] (for the slowest row)."""
        total = max(int(iterations.sum()), 1)
        ran = whole & (iterations > 0)
        slowest = float((tokens[ran] / iterations[ran]).min()) if ran.any() else None
        return cls(int(iterations.max(initial=0)), int(tokens.sum()), 0.0, int(tokens.sum()) / total, slowest)

    @classmethod
    def between(cls, before, after, seconds: float) -> Observation:
        """A segment's observation from host copies of (length [B], SpecStats) before and after it."""
        (length0, stats0), (length1, stats1) = before, after
        row_iterations = stats1.iterations - stats0.iterations
        row_accepted = stats1.accepted - stats0.accepted
        total = max(int(row_iterations.sum()), 1)
        most = int(row_iterations.max())
        # accepted + 1 an iteration, as the mean counts it (a row's last tokens may be cut at its
        # limit), over the rows that ran every iteration of the segment
        whole = whole_rows(before, after)
        slowest = float(row_accepted[whole].min() + most) / most if most > 0 else None
        return cls(most, int((length1 - length0).sum()), seconds, (int(row_accepted.sum()) + total) / total, slowest)


def by_slowest_row(strategy: Strategy, closed: bool) -> bool:
    """Whether the refinement judges `strategy` by its slowest row: ngram in a closed batch, whose
    rows differ most (`Refinement.closed`); everything else by its mean row."""
    return closed and strategy.method == "ngram"


def whole_rows(before, after):
    """[B] bool: the rows that ran every iteration between two host copies of (length, SpecStats)."""
    row_iterations = after[1].iterations - before[1].iterations
    return row_iterations == row_iterations.max()


@dataclasses.dataclass(frozen=True)
class Plan:
    """The candidates (ranked by prediction, plain always among them), the first choice, where the
    predictions came from ("table:<file>" or "cost-model") and the context bucket."""

    candidates: tuple[Prediction, ...]
    first: Strategy
    source: str
    bucket: int

    @property
    def draft_weights(self) -> str:
        """The draft weights whose copies the params need for these candidates ("exact": none)."""
        kinds = {c.strategy.draft_weights for c in self.candidates} - {"exact"}
        if len(kinds) > 1:
            raise JaxspecError(f"a plan's candidates draft with one kind of copies, got {sorted(kinds)}")
        return kinds.pop() if kinds else "exact"

    def describe(self) -> dict:
        first = next(c for c in self.candidates if c.strategy == self.first)
        return {
            "strategy": self.first.name,
            "source": self.source,
            "bucket": self.bucket,
            "predicted_tokens_per_s": first.tokens_per_s,
            "candidates": [{"strategy": c.strategy.name, "predicted_tokens_per_s": c.tokens_per_s} for c in self.candidates],
        }


# ------------------------------------------------------------------------------------------------
# Buckets, precision classes, sampling modes


def bucket_of(context: int, buckets=BUCKETS) -> int:
    """The smallest bucket holding `context` tokens (the largest one past it)."""
    return next((b for b in sorted(buckets) if context <= b), max(buckets))


def nearest(value: int, options) -> int:
    """The option nearest to `value` by log distance (ties: the smaller)."""
    return min(sorted(options), key=lambda o: abs(math.log(o / value)))


def allowed_precisions(precision: str) -> tuple[str, ...]:
    """The classes `--precision P` allows: strict always, plus P and the classes it combines
    (approx+reuse allows all four)."""
    if precision not in PRECISIONS:
        raise JaxspecError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return tuple(p for p in PRECISIONS if p == "strict" or set(p.split("+")) <= set(precision.split("+")))


def sampling_mode(sampling: SamplingConfig) -> str:
    return "greedy" if sampling.greedy else "sample"


# ------------------------------------------------------------------------------------------------
# Tables


# Config fields added after tables were shipped, at the value that leaves a model as it was: left out
# of the hash there, so that the shipped tables keep their names (tests/test_planner.py checks them).
ADDED_FIELDS = {"tp": 1}


def fingerprint(cfg: ModelConfig) -> str:
    """A readable, stable model id: '<type>-<layers>x<hidden>-<dtype>-<hash>' where the hash covers
    every shape, NSA and dtype field of the config (not the token ids; ADDED_FIELDS only off their
    old value)."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items()
              if k not in ("bos_token_id", "eos_token_ids") and not (k in ADDED_FIELDS and v == ADDED_FIELDS[k])}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:10]
    return f"{cfg.model_type}-{cfg.num_layers}x{cfg.hidden_size}-{cfg.dtype}-{digest}"


def device_kind() -> str:
    return jax.devices()[0].device_kind


def table_path(cfg: ModelConfig, device: str, directory: Path = TABLES) -> Path:
    """Where the table of this model on this device kind lives: <fingerprint>_<device slug>.json."""
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    return directory / f"{fingerprint(cfg)}_{slug}.json"


def new_table(cfg: ModelConfig, model_name: str, device: str, backend: str, profile: dict) -> dict:
    return {
        "format": TABLE_FORMAT,
        "model": {"name": model_name, "fingerprint": fingerprint(cfg)},
        "device": device,
        "backend": backend,
        "profile": profile,
        "cells": [],
    }


def set_cell(table: dict, batch: int, sampling: str, bucket: int, precision: str, entries: list[dict], **info) -> None:
    """Adds (or replaces) one cell, its entries ranked by tokens_per_s. An entry is {"strategy":
    Strategy.to_json(), "tokens_per_s", "tokens_per_iteration", "iteration_s", ...}. Cells measured
    over different run lengths (`info["new_tokens"]`) are different cells: `lookup` takes the
    nearest."""
    key = (batch, sampling, bucket, precision, info.get("new_tokens"))
    table["cells"] = [c for c in table["cells"] if _cell_key(c) != key]
    ranked = sorted(entries, key=lambda e: -e["tokens_per_s"])
    table["cells"].append({"batch": batch, "sampling": sampling, "bucket": bucket, "precision": precision, **info,
                           "ranked": ranked})


def _cell_key(cell: dict) -> tuple:
    return cell["batch"], cell["sampling"], cell["bucket"], cell["precision"], cell.get("new_tokens")


def save_table(path: Path, table: dict) -> None:
    """Writes the table atomically: never half-written."""
    files.write_text(path, json.dumps(table, indent=1) + "\n")


def load_table(path: Path) -> dict:
    """Reads and checks a table; any problem is one JaxspecError naming the file."""
    try:
        table = json.loads(Path(path).read_text())
        if table.get("format") != TABLE_FORMAT:
            raise ValueError(f"format {table.get('format')!r} is not {TABLE_FORMAT}")
        table["model"]["fingerprint"], table["device"]
        if not table["cells"]:
            raise ValueError("no cells")
        for cell in table["cells"]:
            if cell["sampling"] not in ("greedy", "sample") or cell["precision"] not in PRECISIONS:
                raise ValueError(f"bad cell {_cell_key(cell)}")
            if int(cell["batch"]) < 1 or int(cell["bucket"]) < 1:
                raise ValueError(f"bad cell {_cell_key(cell)}")
            strategies = [Strategy.from_json(e["strategy"]) for e in cell["ranked"]]
            if not any(s.plain for s in strategies):
                raise ValueError(f"cell {_cell_key(cell)} has no plain entry")
            for e in cell["ranked"]:
                if not all(float(e[k]) > 0 for k in ("tokens_per_s", "tokens_per_iteration", "iteration_s")):
                    raise ValueError(f"cell {_cell_key(cell)}: non-positive measurement")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, JaxspecError) as e:
        raise JaxspecError(f"cannot read planner table {path}: {e}") from None
    return table


def lookup(table: dict, batch: int, sampling: str, context: int, precisions=("strict",),
           prompt_tokens: int | None = None, new_tokens: int | None = None) -> tuple[int, list[Prediction]]:
    """(bucket, predictions ranked best first) of the cells nearest to this run: the sampling mode
    if profiled (else the other), the nearest batch, the exact bucket or the nearest profiled one,
    the run length nearest `new_tokens` by ratio (without it, the shortest: a short static batch
    loses more to its slowest row, and how much differs by strategy more than `run_tail` says);
    the entries of every allowed precision class, less ngram's where the run's prompt is under
    NGRAM_PROMPT_SHARE of the cell's calibration prompts. Empty when no cell has an allowed class,
    or when the nearest profiled batch is more than a factor of 2 from `batch`. A cell of another
    batch answers at its rate per row (tokens/s and spread scaled by batch / its batch): the
    refinement compares these rates with what the run's own rows do, and the choice between them is
    the same at any scale. Given the run's `new_tokens`, a model drafter's tokens/s and tail are
    those of a run that long (`run_tail`)."""
    cells = [c for c in table["cells"] if c["precision"] in precisions]
    if not cells:
        return bucket_of(context), []
    if any(c["sampling"] == sampling for c in cells):
        cells = [c for c in cells if c["sampling"] == sampling]
    b = nearest(batch, {c["batch"] for c in cells})
    if max(b, batch) > 2 * min(b, batch):
        return bucket_of(context), []
    cells = [c for c in cells if c["batch"] == b]
    bucket = bucket_of(context)
    bucket = nearest(bucket, {c["bucket"] for c in cells})
    cells = [c for c in cells if c["bucket"] == bucket]
    measured = lambda c: c.get("new_tokens") or table["profile"].get("new_tokens", 0)  # older cells: the header's
    far = lambda n: abs(math.log(max(n, 1) / new_tokens)) if new_tokens else n
    length = min({measured(c) for c in cells}, key=lambda n: (far(n), n))
    entries = [(c, e) for c in cells if measured(c) == length for e in c["ranked"]
               if not (e["strategy"]["method"] == "ngram" and prompt_tokens is not None
                       and prompt_tokens < NGRAM_PROMPT_SHARE * c.get("prompt_tokens", 0))]
    predictions = []
    for c, e in entries:
        strategy, tps, tpi = Strategy.from_json(e["strategy"]), float(e["tokens_per_s"]), float(e["tokens_per_iteration"])
        tail = min(1.0, tps * float(e["iteration_s"]) / (tpi * b))
        if new_tokens and measured(c) and strategy.kind == "model":
            longer = run_tail(tail, measured(c), new_tokens)
            tail, tps = longer, tps * longer / tail
        predictions.append(Prediction(strategy, batch / b * tps, tpi, float(e["iteration_s"]),
                                      batch / b * float(e.get("spread_tokens_per_s", 0.0)),
                                      e.get("runs", 0) * measured(c) / tpi, tail))
    return bucket, sorted(predictions, key=lambda p: -p.tokens_per_s)


def run_tail(tail: float, measured_tokens: int, new_tokens: int) -> float:
    """A model drafter's tail (`Prediction.tail`) measured over `measured_tokens` new tokens, at a
    run of `new_tokens`. Its rows' acceptance varies iteration by iteration alike, so the slowest
    row's excess iterations over the mean row's shrink as 1 / sqrt(tokens): on SmolLM2 at 128 rows
    sampled, vegas g6 / g4 every 2 kept 0.80 / 0.88 of their mean rates over 256 tokens, which
    predicts 0.89 / 0.93 at 1,024 against 0.90 / 0.92 measured (bench/NOTES.md). ngram's rows differ
    for good (a row that loops copies, one that does not never will): its tail is kept as measured."""
    excess = (1 / tail - 1) * math.sqrt(measured_tokens / new_tokens)
    return 1 / (1 + excess)


# ------------------------------------------------------------------------------------------------
# Cost model: bytes floors (DESIGN.md section 6) plus launch overhead, and an assumed acceptance


def tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def key_bytes(cfg: ModelConfig, batch: int) -> int:
    """K and V bytes of one key position, one layer, `batch` sequences."""
    return batch * cfg.num_kv_heads * cfg.head_dim * 2 * jnp.dtype(cfg.dtype).itemsize


def layer_attention_bytes(cfg: ModelConfig, batch: int, context: int, T: int = 1) -> dict:
    """K+V bytes one layer's attention reads for T rows whose last row is at position context + T - 2,
    by part. Dense: every key up to that row. NSA: the compressed blocks visible to it, S selected
    blocks (a lower bound of the rows' union) and the rows' window (w + T - 1 keys)."""
    per_key = key_bytes(cfg, batch)
    last = context + T - 1  # keys up to and including the last row
    n = cfg.nsa
    if n is None:
        return {"kv": per_key * last}
    return {"compressed": per_key * (last // n.block_size),
            "selected": per_key * min(n.block_counts * n.block_size, last),
            "window": per_key * min(n.window_size + T - 1, last)}


def kv_bytes_read(cfg: ModelConfig, batch: int, context: int) -> int:
    """Bytes of keys and values one decode step over `context` tokens reads, all layers (NSA models:
    their three branches)."""
    return cfg.num_layers * sum(layer_attention_bytes(cfg, batch, context).values())


def step_floor_s(cfg: ModelConfig, weight_bytes: int, batch: int, context: int, bandwidth_GBps: float) -> float:
    """DESIGN.md 6: (weights + KV read + float32 logits written) / measured bandwidth."""
    logits = batch * cfg.vocab_size * 4
    return (weight_bytes + kv_bytes_read(cfg, batch, context) + logits) / (bandwidth_GBps * 1e9)


def seconds_per_call(f, *args, min_run_s: float = 0.05) -> float:
    """Median over 3 runs of back-to-back asynchronous calls, each run at least `min_run_s` long: one
    host sync a run, so short device work is not timed together with the sync."""
    jax.block_until_ready(f(*args))

    def run(n):
        start = time.perf_counter()
        for _ in range(n):
            out = f(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / n

    n = max(1, min(1000, math.ceil(min_run_s / run(1))))
    return statistics.median(run(n) for _ in range(3))


@functools.cache
def measure_bandwidth() -> float:
    """Copy bandwidth in GB/s (bytes read + written, as bench/common.measure_rates counts it): a
    jitted x + 1 over 256 MiB of float32 on an accelerator (past any L2), 16 MiB on the CPU, timed
    back to back (`seconds_per_call`; one call timed with its sync read half the H100's 2,984 GB/s,
    bench/NOTES.md). Measured once per process (well under a second)."""
    n = (1 << 26) if jax.default_backend() != "cpu" else (1 << 22)
    x = jnp.ones((n,), jnp.float32)
    return 2 * x.nbytes / seconds_per_call(jax.jit(lambda x: x + 1), x) / 1e9


def predict(strategy: Strategy, cfg: ModelConfig, weight_bytes: int, batch: int, context: int, bandwidth_GBps: float,
            min_tokens: int = 256) -> Prediction:
    """The cost model's prediction for a chain strategy (plain, a sparse drafter or ngram):

      forward(keys, rows, nsa) = layers x (LAYER_OVERHEAD_S + NSA_LAYER_OVERHEAD_S if nsa)
                                 + (weights + K/V bytes of `keys` + rows x batch x vocab x 4) / bandwidth
      plain step  = forward(context, 1, NSA attention on NSA models)
      iteration   = depth x draft + verify + ITERATION_OVERHEAD_S, draft = forward(K + depth + 1 keys
                    (selection + tail), 1, dense attention, the draft's weight bytes) with K =
                    clamp(ceil(ratio x context), min_tokens, context) (full: the context), 0 for
                    ngram (no model); verify = forward(context, depth + 1, NSA on NSA models)
      tokens/iteration = 1 + sum_{i=1..depth} alpha^i (geometric acceptance, PRIOR_ACCEPTANCE)
      tokens/s = batch x tokens/iteration / iteration

    The bytes term is DESIGN.md's step floor; the overhead term is calibrated on bench/NOTES.md: a
    SmolLM2 step (30 layers) took ~1.3 ms against a 0.15 ms floor on the H100 (38 us per layer over
    the floor; its steps run 6-16x their floors at batch 1) and a Qwen3-8B step 6.75 ms against 5.69
    (29 us per layer); NSA attention adds 55-82 us per layer and pass; an ngram iteration, which
    drafts nothing, took 0.4-0.7 ms more than a plain step (SmolLM2 chain 6: 1.69 vs 1.31 ms;
    Qwen3-8B gamma 8 at 1 x 4K: 7.42 vs 6.75 ms), the iteration overhead. Priors: alpha 0.8 for the
    target drafting over a sparse KV subset (below SmolLM2's measured 0.86-0.94 per draft position
    at ratio 0.07, bench/NOTES "Acceptance", as harder text and larger models accept less), 0.5 for
    ngram (reproduces its measured 2.1-2.5 tokens per iteration at gamma 4-8). Refinement replaces
    both the acceptance and the time scale with what the run observes.
    """
    if strategy.tree is not None:
        raise ValueError("the cost model predicts chains only; trees need a measured table")

    bandwidth = bandwidth_GBps * 1e9

    def forward(rows: int, draft_keys: int | None = None) -> float:
        """`rows` rows through the target's own attention over the context, or (draft_keys) one row
        through dense attention over draft_keys keys, reading the draft's weights."""
        if draft_keys is None:
            floor = step_floor_s(cfg, weight_bytes, batch, context, bandwidth_GBps)
            overhead = LAYER_OVERHEAD_S + (NSA_LAYER_OVERHEAD_S if cfg.nsa else 0.0)
        else:
            draft_bytes = draft_weights.read_bytes(cfg, weight_bytes, strategy.draft_weights)
            floor = step_floor_s(cfg, draft_bytes, batch, 0, bandwidth_GBps)
            floor += cfg.num_layers * key_bytes(cfg, batch) * draft_keys / bandwidth
            overhead = LAYER_OVERHEAD_S
        return cfg.num_layers * overhead + floor + (rows - 1) * batch * cfg.vocab_size * 4 / bandwidth

    depth = strategy.depth
    verify = forward(depth + 1)
    if strategy.plain:
        return Prediction(strategy, batch / verify, 1.0, verify)
    draft = 0.0
    if strategy.kind == "model":
        k = context if strategy.method == "full" else min(max(math.ceil(strategy.ratio * context), min_tokens), context)
        draft = forward(1, draft_keys=k + depth + 1)
    alpha = PRIOR_ACCEPTANCE[strategy.kind]
    tpi = 1 + sum(alpha**i for i in range(1, depth + 1))
    iteration = depth * draft + verify + ITERATION_OVERHEAD_S
    return Prediction(strategy, batch * tpi / iteration, tpi, iteration)


def cost_model(cfg: ModelConfig, weight_bytes: int, batch: int, context: int, bandwidth_GBps: float,
               min_tokens: int = 256) -> list[Prediction]:
    """Predictions, best first, for plain, vegas at gamma 2, 4 and 6 (ratio 0.07, the KV-bound choice
    of bench/kv_bound.json), vegas and full at gamma 6 with int8 draft weights (int8 drafts accepted
    as exact ones did on SmolLM2: bench/NOTES.md, issue 16; int4 lost a third of its tokens per
    iteration there, so it is for tables and fixed methods only; batches of up to one kernel row block,
    which reads the int8 matrix once) and ngram at gamma 4 and 8, all strict
    (approximate precision classes and draft trees are chosen from measured tables only)."""
    strategies = [Strategy()] + [Strategy("vegas", gamma=g, ratio=COST_MODEL_RATIO) for g in (2, 4, 6)]
    if batch <= kernels.ROW_MATMUL_ROWS:  # a draft forward's rows in one row block: int8 bytes read once
        strategies += [Strategy("vegas", gamma=6, ratio=COST_MODEL_RATIO, draft_weights="int8"),
                       Strategy("full", gamma=6, draft_weights="int8")]
    strategies += [Strategy("ngram", gamma=g) for g in (4, 8)]
    predictions = [predict(s, cfg, weight_bytes, batch, context, bandwidth_GBps, min_tokens) for s in strategies]
    return sorted(predictions, key=lambda p: -p.tokens_per_s)


# ------------------------------------------------------------------------------------------------
# Choosing and refining


def choose(candidates) -> Strategy:
    """The speculative candidate with the best pessimistic rate (median - spread / 2: a table's
    noisy win is no win) if that beats the best plain one by MARGIN, else that plain."""
    plain = max((p for p in candidates if p.strategy.plain), key=lambda p: p.tokens_per_s)
    speculative = [p for p in candidates if not p.strategy.plain]
    if not speculative:
        return plain.strategy
    best = max(speculative, key=lambda p: p.tokens_per_s - p.spread / 2)
    return best.strategy if best.tokens_per_s - best.spread / 2 > plain.tokens_per_s * (1 + MARGIN) else plain.strategy


def paid_copies(predictions: list[Prediction]) -> list[Prediction]:
    """`predictions` without those that draft with quantized weights, unless one of them is
    predicted to beat plain: their copies cost device memory."""
    plain = max(p.tokens_per_s for p in predictions if p.strategy.plain)
    if any(p.tokens_per_s > plain for p in predictions if p.strategy.draft_weights != "exact"):
        return predictions
    return [p for p in predictions if p.strategy.draft_weights == "exact"]


def make_plan(cfg: ModelConfig, weight_bytes: int, *, batch: int, prompt_tokens: int, new_tokens: int,
              sampling: SamplingConfig, precisions=("strict",), table: Path | None = None,
              min_tokens: int = 256, closed: bool = True) -> Plan:
    """The plan of a run: candidates from `table` (or the shipped table of this model and device
    kind), else from the cost model at the run's middle context (prompt + new / 2); the CANDIDATES
    best speculative ones, the best chain ngram one (the refinement replays it while another strategy
    runs, at no model cost) and the best plain one are kept, quantized drafts only if they pay
    (`paid_copies`; `Plan.draft_weights` says which copies to make). A given table must be of this
    model. Not `closed` (a server that admits into freed rows), a table's rates are its mean rows'
    (without their tails): no row waits for the slowest."""
    context = prompt_tokens + new_tokens
    path = table or table_path(cfg, device_kind())
    predictions: list[Prediction] = []
    if table is not None or path.is_file():
        data = load_table(path)
        if data["model"]["fingerprint"] != fingerprint(cfg):
            raise JaxspecError(
                f"planner table {path} is for model {data['model']['fingerprint']}, not this one ({fingerprint(cfg)})")
        bucket, predictions = lookup(data, batch, sampling_mode(sampling), context, precisions, prompt_tokens, new_tokens)
        source = f"table:{path}"
        if not closed:
            predictions = sorted((dataclasses.replace(p, tokens_per_s=p.tokens_per_s / p.tail, spread=p.spread / p.tail, tail=1.0)
                                  for p in predictions), key=lambda p: -p.tokens_per_s)
    if not predictions:
        bucket, source = bucket_of(context), "cost-model"
        middle = prompt_tokens + new_tokens // 2
        predictions = cost_model(cfg, weight_bytes, batch, middle, measure_bandwidth(), min_tokens)
    predictions = paid_copies(predictions)
    plain = max((p for p in predictions if p.strategy.plain), key=lambda p: p.tokens_per_s)
    speculative = [p for p in predictions if not p.strategy.plain][:CANDIDATES]
    ngram = next((p for p in predictions if p.strategy.method == "ngram" and p.strategy.tree is None), None)
    speculative += [ngram] if ngram is not None and ngram not in speculative else []
    candidates = tuple(sorted(speculative + [plain], key=lambda p: -p.tokens_per_s))
    return Plan(candidates, choose(candidates), source, bucket)


def corrected(candidates, observations: dict, replays: dict | None = None, closed: bool = False) -> dict:
    """Each candidate's expected tokens/s given the observations so far ({Strategy: Observation})
    and the latest replays ({Strategy: Observation.replayed}, ngram only), as `Refinement.closed`
    judges them: in a closed batch ngram's by its slowest row, the rest by their mean row.

    Predictions and observations are compared on one basis (`basis`): a table's tokens/s is a closed
    batch's, its slowest row's tail included (`Prediction.tail`), while its tokens per iteration are
    the mean row's; so a mean-row observation is set against the table's rate without its tail, a
    slowest-row one against the table's rate at its closed tokens per iteration, and a closed batch's
    expected rate then carries the table's tail (an open batch refills its rows: no tail).

    An observed strategy: its observed rate, pooled with its table rate weighted as one more segment
    (or the iterations the table measured, if fewer; the cost model's weigh nothing): one segment is
    a small sample, and acceptance drifts within a run (ngram's grows as greedy text starts to
    repeat), so a table choice is left only when the run's own segments outweigh it.
    A replayed one: as above if observed, at the replay's tokens per iteration (fresher: acceptance
    drifts) over the observed ones; else its prediction at the replay's tokens per iteration, its
    time scaled by tau (below).
    Any other: its prediction with its accepted drafts per iteration scaled by a_k = (observed
    accepted per iteration) / (predicted), pooled over the observed strategies of the same drafter
    kind (model drafters share one a, ngram its own; 1 while none of the kind ran; tokens per
    iteration kept within [1, depth + 1]), and its time by tau = (observed iteration time) /
    (predicted), pooled over every observed strategy."""

    def basis(c: Prediction) -> tuple[float, float, float]:
        """(tokens/s, tokens per iteration) of `c` on the basis its observations arrive on, and the
        factor from that basis to the run's rate."""
        if by_slowest_row(c.strategy, closed):
            return c.tokens_per_s, c.tokens_per_iteration * c.tail, 1.0
        return c.tokens_per_s / c.tail, c.tokens_per_iteration, c.tail if closed else 1.0

    by_strategy = {c.strategy: c for c in candidates}
    seen = [(by_strategy[s], o) for s, o in observations.items()]
    tau = sum(o.iteration_s for _, o in seen) / sum(p.iteration_s for p, _ in seen) if seen else 1.0
    expected = {}
    for c in candidates:
        replay = (replays or {}).get(c.strategy)
        rate, tpi_then, to_run = basis(c)
        if c.strategy in observations:
            o, prior = observations[c.strategy], min(c.iterations, SEGMENT)
            pooled = (prior * rate + o.iterations * o.tokens_per_s) / (prior + o.iterations)
            expected[c.strategy] = to_run * pooled * (replay.tokens_per_iteration / o.tokens_per_iteration if replay else 1.0)
            continue
        if replay:
            tpi = replay.tokens_per_iteration
        else:
            same = [(basis(p)[1], o) for p, o in seen if p.strategy.kind == c.strategy.kind and basis(p)[1] > 1]
            a = sum(o.tokens_per_iteration - 1 for _, o in same) / sum(t - 1 for t, _ in same) if same else 1.0
            tpi = 1 + a * (tpi_then - 1)
        tpi = min(max(tpi, 1.0), 1.0 + c.strategy.depth)
        expected[c.strategy] = to_run * rate * tpi / tpi_then / tau
    return expected


def decide(candidates, observations: dict, current: Strategy, probe_plain: bool = True,
           replays: dict | None = None, closed: bool = False) -> tuple[Strategy, str]:
    """(strategy to run next, why): the candidate with the best corrected rate if it beats the
    current strategy's (its observations pooled with its table rate) by MARGIN; else, with
    `probe_plain` (cost-model plans), plain, while it is unmeasured and the current speculative
    strategy does not beat plain's corrected prediction by PROBE_MARGIN (predicted relative step
    times can be off by that much, e.g. on a CPU, where rows cost compute: measured, a speculative
    strategy then has to beat plain by MARGIN to be switched back to); else the current one. A table's plain rate is measured on this device,
    so table plans do not probe it. `replays`, `closed`: as `corrected` takes them."""
    expected = corrected(candidates, observations, replays, closed)
    best = max(expected, key=expected.get)
    now = expected[current]
    if best != current and expected[best] > now * (1 + MARGIN):
        how = "observed" if best in observations else "replayed" if best in (replays or {}) else "predicted"
        return best, f"{best.name} {how} {expected[best]:.0f} tok/s > {current.name} expected {now:.0f} tok/s"
    plain = max((c.strategy for c in candidates if c.strategy.plain), key=expected.get)
    if probe_plain and not current.plain and plain not in observations and expected[plain] * (1 + PROBE_MARGIN) >= now:
        return plain, f"plain predicted {expected[plain]:.0f} tok/s, {current.name} expected {now:.0f} tok/s: measuring plain"
    return current, f"{current.name} expected {now:.0f} tok/s, no candidate {MARGIN:.0%} faster"


@dataclasses.dataclass
class Refinement:
    """Refinement at run time (point 3 of the module docstring) as the scheduler drives it: the
    strategy running now, what each strategy was observed to do, the switches made and the segments
    seen. `active` until the choice is settled: `decide` keeps the current strategy, or MAX_SWITCHES
    were made (not when the rows finished: a server goes on with its next requests). A measured
    table's plain choice has nothing to refine (no
    drafts to observe), so it starts settled and runs as plain does. Settled, it is `watching` while
    it has ngram to watch. `closed`: a static batch (the rows it starts with are all it runs, and it
    lasts as long as its slowest row): ngram, running or replayed, is then judged by its slowest row,
    since it leaves some rows at one token an iteration while others copy (its slowest row needed
    2-2.3x its mean row's iterations on sampled SmolLM2, the model drafters' 1.1x; bench/NOTES.md)."""

    plan: Plan
    current: Strategy
    active: bool
    closed: bool = False
    window: int = WATCH  # iterations of the next watch window
    iterations: int = 0
    observations: dict = dataclasses.field(default_factory=dict)
    switches: list = dataclasses.field(default_factory=list)
    segments: list = dataclasses.field(default_factory=list)
    ran: set = dataclasses.field(default_factory=set)

    @classmethod
    def of(cls, plan: Plan, closed: bool = False) -> Refinement:
        return cls(plan, plan.first, active=not (plan.first.plain and plan.source != "cost-model"), closed=closed,
                   window=WATCH, ran={plan.first})

    @property
    def replayed(self) -> tuple[Strategy, ...]:
        """The chain ngram candidates other than the running strategy: what each segment or watch
        window replays (`Ngram.replay`)."""
        return tuple(c.strategy for c in self.plan.candidates
                     if c.strategy.method == "ngram" and c.strategy.tree is None and c.strategy != self.current)

    @property
    def watching(self) -> bool:
        """Settled, with switches left and ngram to watch: a candidate to replay, or ngram running
        (its window may fall under a candidate's prediction)."""
        return (not self.active and len(self.switches) < MAX_SWITCHES
                and (bool(self.replayed) or self.current.method == "ngram"))

    def observe(self, seen: Observation, finished: bool, replays: dict | None = None) -> Strategy | None:
        """Records a segment of the current strategy (and `replays` over it, {Strategy:
        Observation.replayed}); returns the strategy to switch to, or None (and settles) when the
        current one stays. With every row `finished` it returns None and refines on: a server that
        went idle refines with its next requests (a run that ended has no next segment)."""
        replays = self._record(seen, replays, watch=False)
        if finished:
            return None
        c = self.current
        target, reason = (c, "") if len(self.switches) == MAX_SWITCHES else decide(
            self.plan.candidates, self.observations, c, probe_plain=self.plan.source == "cost-model", replays=replays,
            closed=self.closed)
        if target == c:
            self.active = False
            return None
        return self._switch(target, reason, seen)

    def watch(self, seen: Observation, finished: bool, replays: dict | None = None) -> Strategy | None:
        """A settled refinement's check over the latest window (`window` iterations): the running
        strategy judged by this window alone (acceptance drifts along a run: greedy text starts to
        loop after a few hundred tokens), ngram candidates by their replays over it, the others as
        `corrected` predicts them; returns the strategy to switch to (staying settled), or None."""
        replays = self._record(seen, replays, watch=True)
        c = self.current
        if finished or len(self.switches) == MAX_SWITCHES:
            return None
        observations = {**self.observations, c: self._judged(c, seen)}
        target, reason = decide(self.plan.candidates, observations, c, probe_plain=False, replays=replays, closed=self.closed)
        if target == c:
            self.window *= 2
            return None
        self.window = WATCH
        return self._switch(target, reason, seen)

    def _judged(self, strategy: Strategy, seen: Observation) -> Observation:
        """`seen` as the refinement weighs it for `strategy` (see `closed`)."""
        return seen.at_slowest() if by_slowest_row(strategy, self.closed) else seen

    def _record(self, seen: Observation, replays: dict | None, watch: bool) -> dict:
        """Pools `seen` into the current strategy's observations, appends the segment (with the
        replays' tokens per iteration as judged), and returns the replays as judged."""
        self.iterations += seen.iterations
        c = self.current
        seen_judged = self._judged(c, seen)
        self.observations[c] = self.observations[c].merge(seen_judged) if c in self.observations else seen_judged
        replays = {s: self._judged(s, r) for s, r in (replays or {}).items()}
        self.segments.append({"strategy": c.name, "iterations": seen.iterations, "tokens_per_s": seen.tokens_per_s,
                              "tokens_per_iteration": seen.tokens_per_iteration, "iteration_s": seen.iteration_s,
                              "slowest_row_tokens_per_iteration": seen.slowest_tokens_per_iteration, "watch": watch,
                              "replayed_tokens_per_iteration": {s.name: r.tokens_per_iteration for s, r in replays.items()}})
        return replays

    def _switch(self, target: Strategy, reason: str, seen: Observation) -> Strategy:
        self.switches.append({"iteration": self.iterations, "from": self.current.name, "to": target.name,
                              "reason": reason, "observed_tokens_per_s": seen.tokens_per_s})
        self.current = target
        self.ran.add(target)
        return target

    @property
    def lossless(self) -> bool:
        """Every strategy that ran was lossless."""
        return all(s.precision == "strict" for s in self.ran)

    def describe(self) -> dict:
        """What a server reports of its refinement (/v1/models): the plan, the strategy running now,
        whether it still refines, its switches so far and how many segments it has judged."""
        return {"planned": self.plan.describe(), "current": self.current.name, "refining": self.active,
                "switches": list(self.switches), "segments": len(self.segments)}
