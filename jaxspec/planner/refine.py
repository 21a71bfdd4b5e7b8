"""Refinement at run time (after SSV's Algorithm 1).

The run starts with the plan's choice, measures its accepted tokens per iteration and iteration time
over a segment of SEGMENT iterations (`Observation`), corrects every candidate's prediction by what it
saw (`corrected`; a strategy's own observations are pooled with its table rate, which counts as one
more segment), and switches (`engine.Engine.switch`, which keeps the output distribution exact) to a
candidate predicted faster by MARGIN, or to plain when plain is unmeasured and not predicted the
plan's `probe_margin` slower (`decide`); it measures that one for a segment and decides again, at most
MAX_SWITCHES times. Settled, it keeps watching (`Refinement.watch`) while a speculative strategy runs
or ngram could: after windows of WATCH, 2 WATCH, 4 WATCH ... iterations (back to WATCH after a switch:
each check costs a host sync and a replay, so their number grows with the log of the run's length;
in a closed batch settled on plain or an observed model drafter the windows run inside one device
call, which returns only where the host may decide (`Refinement.thresholds`, `own_floor`); otherwise
in segments of AHEAD, so a switch away from a running drafter lands at most AHEAD iterations after
its judgement) it
replays the chain ngram candidates over the tokens just committed (`Ngram.replay`: what ngram would
have accepted, exact in distribution, at no model cost) and switches when one is predicted MARGIN
faster than the running strategy, or when the running one falls MARGIN below any candidate. ngram is
judged by the latest window (text that starts to repeat itself late, greedy loops and copied passages,
is caught, and left again, within the switch limit); a model drafter by all its windows pooled (its
acceptance follows the kind of text, and as the windows add up they outweigh its table rate: a table
choice that does badly on this run's text is left). Observations and predictions are set against
each other on one basis (`corrected`).
"""

from __future__ import annotations

import dataclasses

from jaxspec.planner.plan import MARGIN, PROBE_MARGIN, Plan
from jaxspec.planner.strategy import Prediction, Strategy

SEGMENT = 8  # decode iterations per refinement segment
WATCH = 64  # decode iterations of a settled refinement's first watch window; it doubles while nothing switches
AHEAD = 64  # decode iterations per segment of a watched running drafter: each runs ahead of the last one's judgement
# (each segment costs ~1.2-2 ms on an H200: at 16, batch 1's iterations ran 6-15% longer; bench/NOTES.md)
MAX_SWITCHES = 3
STRETCH = 1 << 20  # iterations of `Refinement.own_floor`'s long stretch: its table rate and segments weigh nothing
FLOOR_PRECISION = 2.0 ** -24  # of `own_floor`'s bisection: float32's, in which the device compares


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


def decide(candidates, observations: dict, current: Strategy, probe_margin: float | None = PROBE_MARGIN,
           replays: dict | None = None, closed: bool = False) -> tuple[Strategy, str]:
    """(strategy to run next, why): the candidate with the best corrected rate if it beats the
    current strategy's (its observations pooled with its table rate) by MARGIN; else plain, while it
    is unmeasured and the current speculative strategy does not beat plain's corrected prediction by
    `probe_margin` (the plan's: predicted relative step times can be off by that much; measured, a
    speculative strategy then has to beat plain by MARGIN to be switched back to); else the current
    one. A table's plain rate is measured on this device, so table plans (`probe_margin` None) do not
    probe it. A run cannot switch into eagle (`engine.Engine.switch`), so eagle is never a target, and
    is left only for a candidate predicted faster (a probe could not come back). `replays`, `closed`:
    as `corrected` takes them."""
    expected = corrected(candidates, observations, replays, closed)
    expected = {s: rate for s, rate in expected.items() if s == current or s.method != "eagle"}
    best = max(expected, key=expected.get)
    now = expected[current]
    if best != current and expected[best] > now * (1 + MARGIN):
        how = "observed" if best in observations else "replayed" if best in (replays or {}) else "predicted"
        return best, f"{best.name} {how} {expected[best]:.0f} tok/s > {current.name} expected {now:.0f} tok/s"
    plain = max((c.strategy for c in candidates if c.strategy.plain), key=expected.get)
    if (probe_margin is not None and not current.plain and current.method != "eagle" and plain not in observations
            and expected[plain] * (1 + probe_margin) >= now):
        return plain, f"plain predicted {expected[plain]:.0f} tok/s, {current.name} expected {now:.0f} tok/s: measuring plain"
    return current, f"{current.name} expected {now:.0f} tok/s, no candidate {MARGIN:.0%} faster"


def margin(expected: dict, current: Strategy) -> float:
    """How far `decide` (no probe) is from leaving `current` with these expected rates (`corrected`):
    its rate times 1 + MARGIN less the best rival's it may switch to (eagle is never a target); < 0
    where it leaves."""
    rivals = [rate for s, rate in expected.items() if s != current and s.method != "eagle"]
    return expected[current] * (1 + MARGIN) - max(rivals, default=-float("inf"))


def measured_first(plan: Plan, closed: bool) -> bool:
    """Whether `plan` starts a closed batch with a model drafter a table measured on this device
    (`Refinement.of` watches it from its first iteration)."""
    first = plan.first
    return closed and plan.source.startswith("table:") and not first.plain and first.method != "ngram"


@dataclasses.dataclass
class Refinement:
    """Refinement at run time (the module's docstring) as the scheduler drives it: the
    strategy running now, what each strategy was observed to do, the switches made and the segments
    seen. `active` until the choice is settled: `decide` keeps the current strategy, or MAX_SWITCHES
    were made (not when the rows finished: a server goes on with its next requests). A plain choice
    starts settled, a table's or the cost model's: it has no drafts to observe, and a segment of it
    scales every unobserved candidate's prediction and its own by one tau (`corrected`), so only
    ngram's replays could move the choice, and the watch replays ngram (on the device, with no host
    sync, in a closed batch: bench/NOTES.md, "auto's first segment"; a closed batch settled on an
    observed model drafter is watched there too). Settled, it is `watching` while it has ngram to
    watch or a speculative strategy runs. `closed`: a static batch (the rows it starts with are all it runs, and it
    lasts as long as its slowest row): ngram, running or replayed, is then judged by its slowest row,
    since it leaves some rows at one token an iteration while others copy (its slowest row needs
    about twice its mean row's iterations, a model drafter's barely more: bench/NOTES.md, "auto
    watches ngram by replaying it")."""

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
    previous: Strategy | None = None  # the strategy the last switch left

    @classmethod
    def of(cls, plan: Plan, closed: bool = False) -> Refinement:
        """The refinement of a run that starts with `plan`. A closed batch whose plan starts with a model
        drafter measured by a table (on this device) starts settled: the device watches it from its first
        iteration, its table rate standing for the refining segment's observation. That segment's
        boundary and judgement cost a closed run at one row ~10% (bench/NOTES.md, "auto's overhead
        at one row"); a drafter doing worse than its table still falls under its floor within a window."""
        first = plan.first
        return cls(plan, first, active=not first.plain and not measured_first(plan, closed), closed=closed,
                   window=WATCH, ran={first})

    @property
    def replayed(self) -> tuple[Strategy, ...]:
        """The chain ngram candidates other than the running strategy: what each segment or watch
        window replays (`Ngram.replay`)."""
        return tuple(c.strategy for c in self.plan.candidates
                     if c.strategy.method == "ngram" and c.strategy.tree is None and c.strategy != self.current)

    @property
    def watching(self) -> bool:
        """Settled, with switches left and something to watch: a candidate to replay, or a speculative
        strategy running (it may fall under a candidate's prediction)."""
        return not self.active and len(self.switches) < MAX_SWITCHES and (bool(self.replayed) or not self.current.plain)

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
            self.plan.candidates, self.observations, c, probe_margin=self.plan.probe_margin, replays=replays,
            closed=self.closed)
        if target == c:
            self.active = False
            return None
        return self._switch(target, reason, seen)

    def watch(self, seen: Observation, finished: bool, replays: dict | None = None,
              left: int | None = None) -> Strategy | None:
        """A settled refinement's check over the latest window (`window` iterations): running ngram
        judged by this window alone (its acceptance drifts along a run: greedy text starts to loop
        after a few hundred tokens), a running model drafter by all it did (`_record` pooled this
        window in), ngram candidates by their replays over the window, the others as `corrected`
        predicts them; returns the strategy to switch to (staying settled), or None. `left`: the most
        tokens a row of a closed batch may still take; under WATCH no switch could pay for itself (a
        switch's step and first window), so none is made (bench/NOTES.md, "the watch on the device")."""
        replays = self._record(seen, replays, watch=True)
        c = self.current
        if finished or len(self.switches) == MAX_SWITCHES or (left is not None and left < WATCH):
            return None
        observations = {**self.observations, c: self._judged(c, seen)} if c.method == "ngram" else self.observations
        target, reason = decide(self.plan.candidates, observations, c, probe_margin=None, replays=replays,
                                closed=self.closed)
        if target == c:
            self.window *= 2
            return None
        self.window = WATCH
        return self._switch(target, reason, seen)

    @property
    def watches_on_device(self) -> bool:
        """Whether the watch can run inside the decode (`thresholds`, `own_floor`): a closed batch settled
        on plain with ngram to replay, or on an observed model drafter (running ngram is judged by its
        latest window's slowest row, and an open batch's segments are the host's anyway)."""
        c = self.current
        first = not self.switches and measured_first(self.plan, self.closed)  # not yet observed: watched from the start
        return self.closed and self.watching and c.method != "ngram" and (c.plain or c in self.observations or first)

    def own_floor(self) -> float:
        """The device's watch of a running model drafter (`serving.programs.watched`): the least tokens
        per iteration (the mean row's) at which a long stretch of it, at its pooled iteration time,
        keeps `decide` on it with no replay copying; 0 for plain (its rate does not drift) or a drafter
        no candidate beats even at one token an iteration, inf for one `decide` leaves now. A call
        whose own tokens per iteration fall under it ends, and the host judges as `watch` does: a
        floor says when to look. A shorter stretch pulls the pooled rate down less, so its own floor
        is lower: this one looks early, never late."""
        c = self.current
        if c.plain:
            return 0.0
        ones = self._not_copying()

        at = lambda tpi: margin(corrected(self.plan.candidates, self._after(tpi), ones, self.closed), c)
        low, high = 1.0, 1.0 + c.depth
        m_low, m_high = at(low), at(high)
        if m_low >= 0:
            return 0.0
        if m_high < 0:
            return float("inf")
        # Each margin costs ~0.05 ms of host time, the device idle. The margin is piecewise affine in
        # tpi, so a secant step lands on the floor where it is affine across the bracket; the points a
        # precision step either side of it then close the bracket. Bisection steps between them bound
        # the search where it is not.
        secant = True
        while high - low > high * FLOOR_PRECISION:
            if secant and m_high != m_low:
                x = min(max(high - m_high * (high - low) / (m_high - m_low), low), high)
                points = (x + high * FLOOR_PRECISION / 2, x - high * FLOOR_PRECISION / 2)
            else:
                points = ((low + high) / 2,)
            for point in points:
                if low < point < high:
                    m = at(point)
                    low, m_low, high, m_high = (low, m_low, point, m) if m >= 0 else (point, m, high, m_high)
            secant = not secant
        return high

    def look_level(self, floor: float) -> float:
        """Where the device's call of a running model drafter returns for the host to look: its own
        tokens per iteration since the call began under this level. Midway between its floor
        (`own_floor`, at least one token an iteration) and its mean row's rate so far (observed, or its
        table's), and the replays' thresholds are taken there (`thresholds`): valid while the drafter
        keeps over it. Taken at the floor, they were 1.06-1.07 tokens an iteration on the default
        request, which the prose's ngram replays crossed in every window (bench/NOTES.md, "auto's
        overhead at one row"). 0 or inf as the floor is, for plain or a drafter `decide` leaves now."""
        if self.current.plain or floor == float("inf"):
            return floor
        o = self.observations.get(self.current)
        rate = o.tokens_per_iteration if o is not None else self._prediction().tokens_per_iteration
        low = max(floor, 1.0)
        return max(low, (low + rate) / 2)

    def thresholds(self, floor: float) -> dict[Strategy, float]:
        """The watch as the device applies it (`serving.programs.watched`): for each replayed strategy,
        the least tokens per iteration of its replay over a window, as judged (its slowest row's in a
        closed batch), at which `decide` would switch now, the other replays at one token an iteration;
        inf where none up to its depth + 1 would. `corrected`'s rate of a replayed strategy is its
        rate at one token an iteration times the replay's tokens per iteration, so each threshold is
        the switch's bar over that rate. A running model drafter's bar is taken at `floor`, its
        `look_level` (the lowest it may sink to within a call that does not cross it). A window that
        crosses one ends the device's loop, and the host judges the device's replays of that window and
        decides as `watch` does: a threshold says when to look."""
        if floor == float("inf"):
            return {s: 1.0 for s in self.replayed}
        observations = self.observations if self.current.plain else self._after(max(floor, 1.0))
        expected = corrected(self.plan.candidates, observations, self._not_copying(), self.closed)
        if margin(expected, self.current) < 0:
            return {s: 1.0 for s in self.replayed}  # `decide` switches whatever the replays
        bar = expected[self.current] * (1 + MARGIN)
        least = {s: bar / expected[s] * (1 + 1e-9) for s in self.replayed}  # just over the bar
        return {s: x if x <= 1 + s.depth else float("inf") for s, x in least.items()}

    def _not_copying(self) -> dict[Strategy, Observation]:
        """Each replayed strategy's replay at one token an iteration."""
        return {s: Observation(1, 1, 0.0, 1.0, 1.0) for s in self.replayed}

    def _after(self, tokens_per_iteration: float) -> dict[Strategy, Observation]:
        """The observations after a long stretch (STRETCH iterations) of the running drafter at
        `tokens_per_iteration`, its rows and iteration time as observed (not yet observed, `of`'s
        measured drafter: as its table measured them, on the mean row's basis `corrected` sets
        observations against)."""
        o = self.observations.get(self.current)
        if o is not None:
            rows, iteration_s = o.tokens / max(o.iterations * o.tokens_per_iteration, 1e-9), o.iteration_s
        else:
            p = self._prediction()
            rows, iteration_s = p.tokens_per_s * p.iteration_s / (p.tail * p.tokens_per_iteration), p.iteration_s
        tpi = tokens_per_iteration
        stretch = Observation(STRETCH, STRETCH * rows * tpi, STRETCH * iteration_s, tpi)
        return {**self.observations, self.current: o.merge(stretch) if o is not None else stretch}

    def _prediction(self) -> Prediction:
        """The plan's prediction of the running strategy."""
        return next(p for p in self.plan.candidates if p.strategy == self.current)

    def watch_until(self, left: int) -> int:
        """Iterations of plain (a token a row an iteration) from now within which a window's crossing
        can lead to a switch, with `left` the most tokens a row of the closed batch may still take:
        later, fewer than WATCH would be left (`watch`)."""
        return left - WATCH

    def watched(self, seen: Observation, window: int) -> None:
        """Records a stretch the device watched without crossing a threshold (`thresholds`): pooled
        into the current strategy's observations; `window`, the device's next window, is the next
        stretch's first."""
        self._record(seen, {}, watch=True)
        self.window = window

    def _judged(self, strategy: Strategy, seen: Observation) -> Observation:
        """`seen` as the refinement weighs it for `strategy` (see `closed`)."""
        return seen.at_slowest() if by_slowest_row(strategy, self.closed) else seen

    def ran_ahead(self, seen: Observation) -> None:
        """Records the segment the strategy switched away from ran while its last window was judged (a
        running strategy's next segment, AHEAD iterations, is dispatched before that judgement: the
        scheduler hands its tokens out at the switch), and the switch, which takes effect after it."""
        self._record(seen, {}, watch=True, strategy=self.previous)
        self.switches[-1]["iteration"] = self.iterations

    def _record(self, seen: Observation, replays: dict | None, watch: bool, strategy: Strategy | None = None) -> dict:
        """Pools `seen` into the observations of `strategy` (default: the current one), appends the
        segment (with the replays' tokens per iteration as judged), and returns the replays as judged."""
        self.iterations += seen.iterations
        c = strategy or self.current
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
        self.previous, self.current = self.current, target
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
