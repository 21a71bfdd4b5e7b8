"""What the planner chooses (`Strategy`: the part of a SpecConfig it sets, in the form tables store)
and what it expects of a strategy (`Prediction`)."""

from __future__ import annotations

import dataclasses

from jaxspec.decoding.spec import SPARSE_METHODS, SpecConfig, spec_from_settings
from jaxspec.decoding.tree import TreeShape, branching_text
from jaxspec.errors import JaxspecError


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
    tree: tuple[int | tuple[int, ...], ...] | None = None  # TreeShape.branching
    traversal: str | None = None
    ratio: float | None = None
    precision: str = "strict"
    group: int = 0
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
        tree = None if plain or spec.tree is None else TreeShape(spec.tree).branching
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
        """This strategy's SpecConfig (its unset fields at their defaults: `spec_from_settings`) with
        `base`'s other fields (backend, min_tokens, k_max, metric, n-gram sizes); validated."""
        settings = dataclasses.asdict(self)
        rest = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.name not in settings}  # eagle kept whole
        return spec_from_settings(**settings, **rest)

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
        "ngram", "eagle" (the run's draft head) or "none" (plain)."""
        return "none" if self.plain else self.method if self.method in ("ngram", "eagle") else "model"

    @property
    def name(self) -> str:
        """e.g. 'plain', 'vegas g6 r0.07', 'vegas bfs:3,2,1 r0.07', 'ngram g8', '... approx group 4' (the
        group when one is set, not chosen by the shape), 'full g6 int8' (draft weights other than exact), 'vegas g6
        r0.07 every 2' (selecting after every 2nd verification), 'vegas g10 r0.07 balance 2' (a shared
        budget)."""
        parts = [self.method]
        if self.tree:
            parts.append(f"{self.traversal}:{branching_text(self.tree)}")
        elif self.gamma:
            parts.append(f"g{self.gamma}")
        if self.ratio is not None:
            parts.append(f"r{self.ratio:g}")
        if self.precision != "strict":
            parts.append(self.precision)
        if self.group:
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
        return cls.of(cls(**{**d, "tree": TreeShape(tree).branching if tree else None}).spec(SpecConfig()))


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
    runs: int = 0  # the table's runs (calibration batches) behind tokens_per_s and spread; 0 for the cost model
    # A table's closed-batch tokens per iteration (its tokens/s times its iteration time, per row)
    # over its mean row's, at most 1: the share of the mean rate its tokens/s kept, a static batch
    # lasting as long as its slowest row (ngram's the lowest: bench/NOTES.md, "the refinement's rates
    # on one basis"), at the run's length (`lookup`); the cost model's prior for a closed batch
    # (`cost.closed_tail`: ngram and eagle), else 1.
    tail: float = 1.0
