"""A run's plan: the candidate strategies and the first choice, from a table or the cost model.

A run's candidates come from the shipped table of its model and device kind (`tables.lookup`), or,
without one, from the cost model (`cost.cost_model`). The CANDIDATES best speculative ones, the best
chain ngram one (the refinement replays it while another strategy runs, at no model cost) and the
best plain one are kept; the first choice is speculative only when it is predicted MARGIN faster than
plain (`choose`). Precision classes other than `strict` change the output distribution, so they are
candidates only when the user allows them (`allowed_precisions`).

A run with an EAGLE-3 draft head (`head`) has eagle strategies among the predictions: a table's
entries for this head, or the cost model's without a table's answer (a head's acceptance depends on
the kind of text too much for a prior to stand beside measurements). A run cannot switch into eagle
(the head's cache covers only what it drafted over: `engine.Engine.switch`), so the best eagle
strategy (by its `pessimistic` rate, as `choose` ranks) is a candidate only as the first choice;
otherwise its place goes to the next strategy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from statistics import NormalDist

from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import PRECISIONS
from jaxspec.errors import JaxspecError
from jaxspec.models.config import ModelConfig
from jaxspec.models.eagle import EagleConfig
from jaxspec.planner.cost import cost_model, measure_bandwidth
from jaxspec.planner.strategy import Prediction, Strategy
from jaxspec.planner.tables import bucket_of, device_kind, fingerprint, load_table, lookup, sampling_mode, table_path

MARGIN = 0.1  # a switch, or a speculative choice over plain, needs a predicted gain of 10%
CANDIDATES = 3  # speculative strategies kept beside plain for refinement (each may need a compile)
PROBE_MARGIN = 0.25  # plain is measured unless the running strategy beats its corrected prediction by 25%
ERRORS = 1.26  # `pessimistic`: standard errors of a table's median held against it (3 runs: half their range)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The candidates (ranked by prediction, plain always among them), the first choice, where the
    predictions came from ("table:<file>" or "cost-model") and the context bucket. `probe_margin`:
    plain is measured while a running speculative strategy does not beat its corrected prediction by
    this much (`refine.decide`); None (a table's plan: its plain rate was measured on this device)
    never. `unmeasured_head`: the table's cells for this run measured another draft head's eagle
    entries but none of the run's head, so eagle is no candidate (the module docstring says why); the
    caller tells the user how to profile it."""

    candidates: tuple[Prediction, ...]
    first: Strategy
    source: str
    bucket: int
    probe_margin: float | None = None
    unmeasured_head: bool = False  # the run's cells measured another head, not this one: planned without it

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


def allowed_precisions(precision: str) -> tuple[str, ...]:
    """The classes `--precision P` allows: strict always, plus P and the classes it combines
    (approx+reuse allows all four)."""
    if precision not in PRECISIONS:
        raise JaxspecError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return tuple(p for p in PRECISIONS if p == "strict" or set(p.split("+")) <= set(precision.split("+")))


@functools.cache
def expected_range(runs: int) -> float:
    """d2: the expected range of `runs` standard normal draws, integrated over [-8, 8] (once per count)."""
    cdf = NormalDist().cdf
    return sum(1 - cdf(x / 32) ** runs - (1 - cdf(x / 32)) ** runs for x in range(-256, 257)) / 32


def median_error(spread: float, runs: int) -> float:
    """The standard error of the median of `runs` runs whose range is `spread`, for normally spread
    runs: the range over its expected multiple of sigma (`expected_range`) estimates sigma, and the
    median's error is sigma sqrt(pi / (2 (runs + 0.5))) (exact to 0.1% for odd runs, up to 12% high for
    even ones). Without two runs there is no range: 0."""
    if runs < 2:
        return 0.0
    return spread / expected_range(runs) * math.sqrt(math.pi / (2 * (runs + 0.5)))


def pessimistic(p: Prediction) -> float:
    """A prediction's rate ERRORS standard errors of its median below it (`median_error`): a table's
    noisy win is no win, and a win over more runs is surer. At 3 runs this is median - spread / 2, as
    the tables were first ranked; at 24 runs median - 0.08 spread, where the range of 3 runs' rule would
    grow with the runs and hold back every win."""
    return p.tokens_per_s - ERRORS * median_error(p.spread, p.runs)


def choose(candidates) -> Strategy:
    """The speculative candidate with the best `pessimistic` rate if that beats the best plain one by
    MARGIN, else that plain."""
    plain = max((p for p in candidates if p.strategy.plain), key=lambda p: p.tokens_per_s)
    speculative = [p for p in candidates if not p.strategy.plain]
    if not speculative:
        return plain.strategy
    best = max(speculative, key=pessimistic)
    return best.strategy if pessimistic(best) > plain.tokens_per_s * (1 + MARGIN) else plain.strategy


def paid_copies(predictions: list[Prediction]) -> list[Prediction]:
    """`predictions` without those that draft with quantized weights, unless one of them is
    predicted to beat plain: their copies cost device memory."""
    plain = max(p.tokens_per_s for p in predictions if p.strategy.plain)
    if any(p.tokens_per_s > plain for p in predictions if p.strategy.draft_weights != "exact"):
        return predictions
    return [p for p in predictions if p.strategy.draft_weights == "exact"]


def make_plan(cfg: ModelConfig, weight_bytes: int, *, batch: int, prompt_tokens: int, new_tokens: int,
              sampling: SamplingConfig, precisions=("strict",), table: Path | None = None,
              min_tokens: int = 256, closed: bool = True, head: EagleConfig | None = None,
              head_id: str | None = None) -> Plan:
    """The plan of a run: candidates from `table` (or the shipped table of this model and device
    kind), else from the cost model at the run's middle context (prompt + new / 2); the CANDIDATES
    best speculative ones, the best chain ngram one (the refinement replays it while another strategy
    runs, at no model cost) and the best plain one are kept, quantized drafts only if they pay
    (`paid_copies`; `Plan.draft_weights` says which copies to make). A given table must be of this
    model. Not `closed` (a server that admits into freed rows), a table's rates are its mean rows'
    (without their tails): no row waits for the slowest. `head`, `head_id`: the run's EAGLE-3 draft
    head and its `loaders.eagle.head_fingerprint` (the module docstring says how eagle is planned)."""
    context = prompt_tokens + new_tokens
    path = table or table_path(cfg, device_kind())
    predictions: list[Prediction] = []
    unmeasured = False  # the run's cells measured another head's eagle, not this one's
    if table is not None or path.is_file():
        data = load_table(path)
        if data["model"]["fingerprint"] != fingerprint(cfg):
            raise JaxspecError(
                f"planner table {path} is for model {data['model']['fingerprint']}, not this one ({fingerprint(cfg)})")
        cells = (data, batch, sampling_mode(sampling), context, precisions, prompt_tokens, new_tokens, head_id)
        bucket, predictions = lookup(*cells)
        source = f"table:{path}"
        has_eagle = lambda ps: any(p.strategy.method == "eagle" for p in ps)
        unmeasured = head_id is not None and not has_eagle(predictions) and has_eagle(lookup(*cells, any_head=True)[1])
        if not closed:
            predictions = [dataclasses.replace(p, tokens_per_s=p.tokens_per_s / p.tail, spread=p.spread / p.tail, tail=1.0)
                           for p in predictions]
    if not predictions:
        bucket, source = bucket_of(context), "cost-model"
        middle = prompt_tokens + new_tokens // 2
        predictions = cost_model(cfg, weight_bytes, batch, middle, measure_bandwidth(), min_tokens, head, closed)
    predictions = sorted(paid_copies(predictions), key=lambda p: -p.tokens_per_s)
    # the best eagle strategy only, ranked as `choose` ranks (its shapes' medians are often within their spreads)
    eagle = max((p for p in predictions if p.strategy.method == "eagle"), key=pessimistic, default=None)
    predictions = [p for p in predictions if p.strategy.method != "eagle" or p is eagle]
    candidates = kept(predictions)
    first = choose(candidates)
    if first.method != "eagle":  # eagle cannot be switched into: its place goes to the next strategy
        candidates = kept([p for p in predictions if p.strategy.method != "eagle"])
    return Plan(candidates, first, source, bucket, probe_margin(source), source != "cost-model" and unmeasured)


def probe_margin(source: str) -> float | None:
    """A plan's `probe_margin`: none for a table's; PROBE_MARGIN for the cost model's on an
    accelerator; on a CPU plain is always measured, since the cost model counts bytes and a CPU's
    verified rows cost compute as well (SmolLM2 in float32 on 2 cores: a 9-row ngram verification
    took 1.5 plain steps, so the bytes model's 2x for ngram g8 ran at 0.75x plain unprobed)."""
    if source != "cost-model":
        return None
    return math.inf if device_kind() == "cpu" else PROBE_MARGIN


def kept(predictions: list[Prediction]) -> tuple[Prediction, ...]:
    """The candidates among `predictions` (fastest first): the CANDIDATES best speculative ones, the
    best chain ngram one and the best plain one."""
    plain = max((p for p in predictions if p.strategy.plain), key=lambda p: p.tokens_per_s)
    speculative = [p for p in predictions if not p.strategy.plain][:CANDIDATES]
    ngram = next((p for p in predictions if p.strategy.method == "ngram" and p.strategy.tree is None), None)
    speculative += [ngram] if ngram is not None and ngram not in speculative else []
    return tuple(sorted(speculative + [plain], key=lambda p: -p.tokens_per_s))
