"""SpecConfig: the static description of a decoding method (hashable, a `jax.jit` static argument),
and the one place that builds it from user settings (`spec_from_settings`, with the tuned files of
`python -m jaxspec.tune`: `load_tuned`, `at_batch`)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxspec.decoding.sampling import Rules, SamplingConfig, without_top_p
from jaxspec.decoding.tree import MAX_TREE_ROWS, ORDERS, TreeShape, branching_text
from jaxspec.errors import JaxspecError
from jaxspec.models.draft_weights import DRAFT_WEIGHTS, check_skip
from jaxspec.models.eagle import EagleConfig
from pallas_kernels.verify_attention import METRICS
from pallas_kernels.quest_pages import QUEST_PAGE

METHODS = ("plain", "vegas", "all_rows", "last_accepted", "stream", "quest", "full", "ngram", "eagle")
SPARSE_METHODS = ("vegas", "all_rows", "last_accepted", "stream", "quest")
SCORE_METHODS = ("vegas", "all_rows", "last_accepted")  # select by verification scores (--metric)
HEAD_CONTEXTS = ("full", "selected")  # SpecConfig.head_context
DRAWS = ("sampled", "top")  # SpecConfig.draws
MAX_GAMMA = MAX_TREE_ROWS - 1  # a chain of gamma drafts verifies gamma + 1 rows
PAGE = QUEST_PAGE  # page size of the page-granular policies (stream, quest): the slots a Quest bound covers
MAX_BALANCE = 8.0  # SpecConfig.balance: a row's budget within [1/8, 8] of the even share
MAX_SELECT_EVERY = 8  # SpecConfig.select_every: at most 7 iterations reuse a selection
PRIOR_ITERATIONS = 4  # Budget.shared: pseudo-iterations every row starts with
# SSV precision classes of NSA verification: only "strict" is lossless.
PRECISIONS = ("strict", "reuse", "approx", "approx+reuse")


def takes_draft_model(method: str, weights: str, skip: tuple[int, ...] = ()) -> bool:
    """Whether `method` runs with this draft model (`SpecConfig.validate` and `check_model` say why
    not): plain, ngram and eagle run no draft forward of the model, so only the exact weights and
    every layer; `full` only with a draft cheaper than the model; the other drafters with any."""
    cheaper = weights != "exact" or bool(skip)
    if method in ("plain", "ngram", "eagle"):
        return not cheaper
    return cheaper or method != "full"


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """How to decode: the method, the draft tree and the sparse budget.

    Drafts form a tree (`tree`: children per depth, or per node of a depth, flattened in `traversal`
    order); without one, a chain of `gamma` drafts, the tree (1, ..., 1). With a tree, gamma is its depth.

    Sparse drafters select K = clamp(ceil(ratio * context), min_tokens, k_max) KV entries, never more
    than there are candidates. `k_max` is the static selection capacity (by
    default derived from ratio, min_tokens and the run's max_len); ratio and min_tokens are run-time
    values, so `compiled` strips them and a sweep over ratios compiles once.

    `balance` > 1 shares the batch's budget among its rows by how many drafts each has lost per
    iteration (`Budget.shared`): a row's ratio is scaled by a share within [1 / balance, balance],
    shares averaging 1 over the unfinished rows, so the selection's total size is unchanged. A static
    batch lasts as long as its slowest row, and a row loses drafts because its selection misses
    attention mass, so more budget there shortens the batch. The output distribution is unchanged
    (only the drafts move), but a row's drafts, and so its sampled tokens, then depend on the other
    rows of its batch.

    `select_every` N > 1 (score drafters) selects after every N-th verification only: the N - 1
    verifications in between collect no scores (their attention kernel skips the collection) and the
    drafts reuse the last selection, whose tail then reaches back to it. Only the drafts change, so
    the output distribution is unchanged; the decode loop runs whole groups of N iterations.
    """

    method: str = "plain"
    gamma: int = 6
    tree: tuple[int | tuple[int, ...], ...] | None = None  # TreeShape.branching
    traversal: str = "bfs"
    ratio: float | None = 0.07
    min_tokens: int | None = 256
    k_max: int | None = None
    metric: str = "weight"  # vegas / all_rows / last_accepted: one of METRICS (kernels.Collect says what each is)
    ngram_min: int = 1
    ngram_max: int = 4
    backend: str = "reference"  # attention kernels: "reference" (jnp) or "pallas"
    prefill_chunk: int = 256
    precision: str = "strict"  # NSA targets: SSV precision class of the target passes (PRECISIONS)
    group: int = 0  # NSA targets: adjacent draft rows verified per program (0: by the shape, nsa_grouped.auto_group)
    draft_weights: str = "exact"  # the layer weights draft steps read: exact, int8 or int4 (models.draft_weights)
    draft_skip: tuple[int, ...] = ()  # the layers draft steps leave out (models.draft_weights), increasing
    balance: float = 1.0  # sparse drafters: the largest share of the budget a row may take (1: every row the same)
    select_every: int = 1  # score drafters: iterations per selection (the others reuse it and collect no scores)
    # The run's EAGLE-3 draft head (its weights: params["eagle"]): the KV cache carries the head's cache,
    # and method eagle drafts with it (an auto run that starts with eagle keeps it after switching away).
    eagle: EagleConfig | None = None
    # method eagle: the head attends its whole KV cache ("full"), or ("selected") the slots the target's
    # last verification scored highest on its top layer, chosen as vegas chooses (ratio, min_tokens,
    # metric), plus the tail since that verification
    head_context: str = "full"
    # when sampling, a model drafter's children: drawn from its processed distribution q ("sampled"), or
    # its top-b tokens ("top"), verified as one-hot candidates as ngram's are (lossless either way: a
    # draft x is then accepted with the target's p(x)). "top" skips the draft's draws and the q it
    # hands verification. None: the method's default (`draw_mode`)
    draws: str | None = None

    def validate(self) -> SpecConfig:
        """Raises JaxspecError naming the first invalid field; returns the config, with a tree's
        gamma set to its depth."""
        if self.method not in METHODS:
            raise JaxspecError(f"unknown method {self.method!r} (choose from {', '.join(METHODS)})")
        if self.traversal not in ORDERS:
            raise JaxspecError(f"--traversal must be bfs or dfs, got {self.traversal!r}")
        if self.tree is not None:
            if self.method == "plain":
                raise JaxspecError("--tree needs a drafting method, not plain")
            shape = TreeShape(self.tree, self.traversal)
            self = dataclasses.replace(self, tree=shape.branching, gamma=shape.depth)
        elif self.method != "plain" and not 1 <= self.gamma <= MAX_GAMMA:
            raise JaxspecError(f"--gamma must be between 1 and {MAX_GAMMA}, got {self.gamma}")
        if self.ratio is not None and not (0 < self.ratio <= 1 and math.isfinite(self.ratio)):
            raise JaxspecError(f"--ratio must be in (0, 1], got {self.ratio}")
        if self.min_tokens is not None and self.min_tokens < 1:
            raise JaxspecError(f"--min-tokens must be at least 1, got {self.min_tokens}")
        if self.k_max is not None and (self.k_max < PAGE or self.k_max % PAGE):
            raise JaxspecError(f"k_max must be a positive multiple of {PAGE}, got {self.k_max}")
        if self.metric not in METRICS:
            raise JaxspecError(f"--metric must be one of {', '.join(METRICS)}, got {self.metric!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise JaxspecError(f"need 1 <= --ngram-min <= --ngram-max, got {self.ngram_min} and {self.ngram_max}")
        if self.backend not in ("reference", "pallas"):
            raise JaxspecError(f"--backend must be reference or pallas, got {self.backend!r}")
        if self.prefill_chunk < 1:
            raise JaxspecError(f"prefill chunk must be positive, got {self.prefill_chunk}")
        if self.precision not in PRECISIONS:
            raise JaxspecError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not 0 <= self.group <= MAX_TREE_ROWS:
            raise JaxspecError(f"--group must be between 0 (by the batch) and {MAX_TREE_ROWS}, got {self.group}")
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise JaxspecError(f"--draft-weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {self.draft_weights!r}")
        if self.draft_weights != "exact" and self.method in ("plain", "ngram", "eagle"):
            raise JaxspecError(f"--draft-weights {self.draft_weights} needs a model drafter; {self.method} runs no draft forward")
        if self.draft_skip and self.method in ("plain", "ngram", "eagle"):
            raise JaxspecError(f"--draft-skip needs a model drafter; {self.method} runs no draft forward")
        if self.head_context not in HEAD_CONTEXTS:
            raise JaxspecError(f"--head-context must be one of {', '.join(HEAD_CONTEXTS)}, got {self.head_context!r}")
        if self.draws is not None and self.draws not in DRAWS:
            raise JaxspecError(f"--draws must be one of {', '.join(DRAWS)}, got {self.draws!r}")
        if self.draws == "top" and self.method in ("plain", "ngram"):
            raise JaxspecError(f"--draws {self.draws} chooses a model drafter's children; {self.method} draws none")
        if self.head_context != "full" and self.method != "eagle":
            raise JaxspecError(f"--head-context {self.head_context} is the eagle head's; {self.method} has no head")
        balance = self.balance
        if isinstance(balance, bool) or not isinstance(balance, (int, float)) or not (
                1 <= balance <= MAX_BALANCE and math.isfinite(balance)):
            raise JaxspecError(f"--balance must be between 1 and {MAX_BALANCE:g}, got {balance!r}")
        if self.balance != 1 and self.method not in SPARSE_METHODS:
            raise JaxspecError(f"--balance shares a sparse drafter's budget; {self.method} keeps none")
        every = self.select_every
        if isinstance(every, bool) or not isinstance(every, int) or not 1 <= every <= MAX_SELECT_EVERY:
            raise JaxspecError(f"--select-every must be an integer between 1 and {MAX_SELECT_EVERY}, got {every!r}")
        if self.select_every != 1 and self.method not in SCORE_METHODS:
            raise JaxspecError(f"--select-every spaces the selections of a score drafter "
                               f"({', '.join(SCORE_METHODS)}); {self.method} selects otherwise")
        if list(self.draft_skip) != sorted(set(self.draft_skip)):
            raise JaxspecError(f"--draft-skip must list layers in increasing order, once each, got {list(self.draft_skip)}")
        return self

    def check_model(self, cfg) -> SpecConfig:
        """Raises JaxspecError if the model cannot run this config: skipped layers must exist and
        leave one (and `full` needs a draft cheaper than the model: the skip list is only known with
        the model); quantized drafts need a dense model; approximate precision classes need an NSA
        model, `reuse` one with a calibrated refresh/reuse schedule."""
        check_skip(self.draft_skip, cfg.num_layers)
        if self.method == "full" and self.draft_weights == "exact" and not self.draft_skip:
            raise JaxspecError("--method full drafts over the whole cache, so it needs a cheaper draft model: "
                               "--draft-weights int8|int4 or --draft-skip")
        if self.draft_weights != "exact" and cfg.moe is not None:
            raise JaxspecError(f"--draft-weights {self.draft_weights} quantizes a dense model's layer matrices; "
                               "a mixture-of-experts model drafts with its exact weights")
        if self.precision != "strict" and cfg.nsa is None:
            raise JaxspecError(f"--precision {self.precision} needs an NSA model (dense models verify exactly)")
        if self.reuse_layers and not cfg.nsa.refresh_layers:
            raise JaxspecError(
                f"--precision {self.precision} needs a calibrated refresh/reuse schedule in the model's config "
                "(python -m jaxspec.convert --calibrate-reuse)"
            )
        return self

    @property
    def lossless(self) -> bool:
        """Whether the output distribution is exactly the target model's (the strict class)."""
        return self.precision == "strict"

    @property
    def shared_index(self) -> bool:
        """NSA verification groups share one representative row's blocks (approx classes)."""
        return self.precision.startswith("approx")

    @property
    def reuse_layers(self) -> bool:
        """NSA reuse layers take the nearest preceding refresh layer's blocks (reuse classes)."""
        return self.precision.endswith("reuse")

    @property
    def draw_mode(self) -> str:
        """`draws`, or the method's default: for eagle, sampled on a chain and top on a tree; sampled for the
        model's own drafts (not measured). Eagle's sampled draws take q without top-p (`draft_rules`): a
        chain of 5 on generate's default request then made 1.84 tokens an iteration against top draws'
        1.61 for 4% more time (1.29x plain against 1.19x), and 2.98 against 2.48 on held-out documents; a
        tree's siblings already hold the mass a draw would reach, so there top draws are faster (5,3+1:
        1.59x against 1.50x; H100, bench/NOTES.md "eagle's draft q without top-p")."""
        if self.draws:
            return self.draws
        return "top" if self.method == "eagle" and not self.shape.is_chain else "sampled"

    def draft_rules(self, rules: Rules) -> Rules:
        """The rules a drafter picks its children by: greedy ones (its top-b tokens, handed to
        verification without a q: one-hot candidates) when `draw_mode` is top; else the run's `rules`,
        for eagle without top-p. The head's q at the run's temperature needs no nucleus search over
        the draft vocabulary (~34 µs a depth at batch 1) and keeps ~98% of the acceptance: sampled
        chains of 5 +11%, trees of 5,3+1 +5% (H100, bench/NOTES.md "eagle's draft q without top-p").
        Verification takes q as it is, so the output stays the target's."""
        if self.draw_mode == "top":
            return SamplingConfig()
        return without_top_p(rules) if self.method == "eagle" else rules

    @property
    def selects_head_context(self) -> bool:
        """Eagle's head attends a selection of its cache (`head_context`)."""
        return self.method == "eagle" and self.head_context == "selected"

    @property
    def draft_len(self) -> int:
        """Most drafts accepted per iteration: the tree's depth (0 for plain decoding)."""
        return 0 if self.method == "plain" else self.gamma

    @property
    def shape(self) -> TreeShape | None:
        """The draft tree (a chain of gamma drafts without `tree`); None for plain decoding."""
        if self.method == "plain":
            return None
        return TreeShape(self.tree or (1,) * self.gamma, self.traversal)

    def describe(self) -> dict:
        """method, gamma, tree, ratio and metric as stats and benchmark rows report them (None where unused)."""
        return {
            "method": self.method,
            "gamma": self.draft_len,
            "tree": branching_text(self.tree) if self.tree and self.method != "plain" else None,
            "traversal": self.traversal if self.tree and self.method != "plain" else None,
            "nodes": self.shape.rows - 1 if self.shape else 0,
            "ratio": self.ratio if self.method in SPARSE_METHODS or self.selects_head_context else None,
            "metric": self.metric if self.method in SCORE_METHODS or self.selects_head_context else None,
            "head_context": self.head_context if self.method == "eagle" else None,
            "draws": self.draw_mode if self.method not in ("plain", "ngram") else None,
            "precision": self.precision,
            "lossless": self.lossless,
            "group": self.group,
            "draft_weights": self.draft_weights,
            "draft_skip": list(self.draft_skip),
            "balance": self.balance if self.method in SPARSE_METHODS else None,
            "select_every": self.select_every if self.method in SCORE_METHODS else None,
        }

    def whole_groups(self, iterations: int) -> int:
        """The iterations `engine.Engine.decode` runs for `max_iterations` = iterations: whole groups of
        `select_every`."""
        return -(-iterations // self.select_every) * self.select_every

    def capacity(self, max_len: int) -> int:
        """Static selection capacity k_max for contexts up to `max_len`, a multiple of PAGE."""
        if self.k_max is not None:
            return self.k_max
        k = max(self.min_tokens, math.ceil(self.ratio * self.balance * max_len))
        return min(-(-k // PAGE) * PAGE, -(-max_len // PAGE) * PAGE)

    def budget(self) -> Budget:
        """The run-time budget values as traced scalars (an `engine.Engine.start` argument)."""
        return Budget.of(self.ratio, self.min_tokens)

    def compiled(self, max_len: int) -> SpecConfig:
        """The static part (the jit key): k_max fixed, the run-time budget values removed."""
        return dataclasses.replace(self, k_max=self.capacity(max_len), ratio=None, min_tokens=None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Budget:
    """The run-time budget values (traced scalars): ratio (float32; [B] once `shared`) and min_tokens
    (int32)."""

    ratio: jax.Array
    min_tokens: jax.Array

    @classmethod
    def of(cls, ratio, min_tokens) -> Budget:
        return cls(jnp.asarray(ratio, jnp.float32), jnp.asarray(min_tokens, jnp.int32))

    def shared(self, lost: jax.Array, iterations: jax.Array, live: jax.Array, balance: float) -> Budget:
        """This budget with each row's ratio scaled by its share (`SpecConfig.balance`): its drafts lost
        per iteration over the unfinished rows' mean, clipped to [1 / balance, balance], then scaled to
        mean 1 over the unfinished rows. lost, iterations, live: [B]. Every row starts from a prior of
        PRIOR_ITERATIONS iterations that lost one draft each, so a new row's share starts near 1."""
        if balance == 1:
            return self
        live_count = jnp.sum(live)

        def live_mean(x):
            return jnp.where(live_count > 0, jnp.sum(jnp.where(live, x, 0.0)) / jnp.maximum(live_count, 1), 1.0)

        rate = (lost + PRIOR_ITERATIONS) / (iterations + PRIOR_ITERATIONS).astype(jnp.float32)
        share = jnp.clip(rate / live_mean(rate), 1 / balance, balance)
        return Budget(self.ratio * share / live_mean(share), self.min_tokens)


# The chain an EAGLE-3 head drafts when nothing sets one (SpecConfig's gamma for every other method):
# its fed-back draft steps are accepted less and less. Measured on an H200, SmolLM2's shipped head at
# 1 x 7.5K sampled: chains of 3 / 4 / 5 ran 1.68x / 1.85-1.90x / 1.36-1.54x plain (bench/NOTES.md).
EAGLE_GAMMA = 4


def spec_from_settings(method: str = "plain", *, tuned: dict | None = None, **settings) -> SpecConfig:
    """The validated SpecConfig of `method` and user settings (SpecConfig fields): a setting given
    (not None) wins over the `tuned` choice's (a tuned file's entry at the run's batch, `at_batch`;
    only TUNED_KEYS, and a tuned 0 or null counts as unset), which wins over the default
    (SpecConfig's; eagle's chain: EAGLE_GAMMA). The tuned tree, with its traversal (bfs if it has
    none), applies unless a gamma or a tree is given: a given gamma asks for a chain."""
    given = {key: value for key, value in settings.items() if value is not None}
    chosen = {key: value for key, value in (tuned or {}).items() if key in TUNED_KEYS and value}
    tree, traversal = chosen.pop("tree", None), chosen.pop("traversal", None)
    if tree and "gamma" not in given and "tree" not in given:
        given |= {"tree": TreeShape.parse(tree).branching, "traversal": traversal or "bfs"}
    if method == "eagle" and not {"gamma", "tree"} & (given.keys() | chosen.keys()):
        given["gamma"] = EAGLE_GAMMA
    return SpecConfig(method=method, **(chosen | given)).validate()


# The settings a tuned choice may carry (`python -m jaxspec.tune` writes the first five; bench/smollm2_h100.json
# the rest, and per-batch ones under "batches") and their JSON types; SpecConfig.validate then checks their ranges.
TUNED_KEYS = {"gamma": int, "ratio": float, "metric": str, "tree": str, "traversal": str, "balance": float,
              "select_every": int}
TYPE_NAMES = {int: "an integer", float: "a number", str: "a string"}


def load_tuned(path: Path, method: str) -> dict:
    """The (gamma, ratio, and tree if one won) chosen for `method` in a file written by `python -m
    jaxspec.tune` (or by hand), with its per-batch settings (`batches`, see `at_batch`) if it has any;
    a setting of the wrong type is a JaxspecError naming it."""
    try:
        methods = json.loads(path.read_text())["methods"]
    except (OSError, ValueError, KeyError, TypeError) as e:  # ValueError: bad JSON or bytes
        raise JaxspecError(f"cannot read tuned file {path}: {e}") from None
    if not isinstance(methods, dict) or method not in methods:
        have = ", ".join(methods) if isinstance(methods, dict) else "no methods"
        raise JaxspecError(f"tuned file {path} has no entry for method {method!r} (it has {have})")
    choice = methods[method]
    _check_settings(path, method, choice)
    batches = choice.get("batches", {})
    if not isinstance(batches, dict):
        raise JaxspecError(f"tuned file {path}: {method}.batches must be an object of batch sizes, got {batches!r}")
    for rows, setting in batches.items():
        if not rows.isdecimal() or int(rows) < 1:  # isdigit admits "²", which int() refuses
            raise JaxspecError(f"tuned file {path}: {method}.batches keys are batch sizes >= 1, got {rows!r}")
        _check_settings(path, f"{method}.batches.{rows}", setting)
    return choice


def _check_settings(path: Path, name: str, choice) -> None:
    if not isinstance(choice, dict):
        raise JaxspecError(f"tuned file {path}: the entry for {name!r} must be an object, got {choice!r}")
    for key, kind in TUNED_KEYS.items():
        value = choice.get(key)
        kinds = (int, float) if kind is float else kind  # a JSON number may be written without a fraction
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            raise JaxspecError(f"tuned file {path}: {name}.{key} must be {TYPE_NAMES[kind]}, got {value!r}")


def at_batch(choice: dict, batch: int) -> dict:
    """A tuned choice for a batch of `batch` rows: its settings, replaced by those of the largest size in
    its `batches` not above `batch` ({"32": {"balance": 2}, "128": {"gamma": 10}}: 32's from 32 rows
    up to 127, 128's from 128). What pays depends on the rows: a static batch's tail, which a shared
    budget and longer chains cut, grows with them (bench/NOTES.md, "settings per batch")."""
    by_rows = {int(rows): setting for rows, setting in choice.get("batches", {}).items() if int(rows) <= batch}
    base = {key: value for key, value in choice.items() if key != "batches"}
    return base | by_rows[max(by_rows)] if by_rows else base
