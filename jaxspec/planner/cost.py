"""The planner's cost model, without a table: bytes floors plus launch overheads, and an assumed
acceptance (`predict`, `cost_model`); and the measurements it rests on (`measure_bandwidth`).

The bytes floor of a step is what it must read and write (weights, the keys and values its attention
reads, float32 logits) over the device's copy bandwidth (`step_floor_s`); bench/ uses the same
functions (bench/NOTES.md, "Floors").
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp

import pallas_kernels as kernels
from jaxspec.models import decoder, draft_weights, eagle
from jaxspec.models.config import ModelConfig
from jaxspec.models.eagle import EagleConfig
from jaxspec.planner.strategy import Prediction, Strategy

# Cost model assumptions (`predict` says where they come from).
LAYER_OVERHEAD_S = 35e-6  # per layer and forward: launches and small kernels
NSA_LAYER_OVERHEAD_S = 60e-6  # per layer, on top, for a forward that runs NSA attention
ITERATION_OVERHEAD_S = 0.4e-3  # per speculative iteration: proposal, acceptance, commit
PRIOR_ACCEPTANCE = {"model": 0.8, "ngram": 0.5, "eagle": 0.6}  # geometric: draft i accepted with probability alpha^i
# eagle's prior sits between what the shipped SmolLM2 head accepts on documents (~0.7) and on short
# chat requests (~0.35) (bench/NOTES.md, "Issue 59: eagle in the planner"); the overhead of an EAGLE-3
# head step (a chain of small kernels) is that head's at SmolLM2's width (bench/NOTES.md, "Issue 59:
# EAGLE-3 drafting, the first shipped head and its first end-to-end numbers")
HEAD_STEP_OVERHEAD_S = 0.1e-3
# A closed batch lasts as long as its slowest row. ngram's and the draft head's acceptance follows each
# row's text, so their slowest row trails their mean row more as rows are added: the prior tail
# (`Prediction.tail`) 1 / (1 + log2(batch) / TAIL_DOUBLINGS) fits the shipped SmolLM2 head's measured
# tails, 0.7 at 8 rows, 0.58 at 32 and 0.5 at 128 (bench/NOTES.md, "Issue 59: eagle at batch 128");
# ngram's measured 0.43-0.81 at 8 rows. Model drafters' rows differ far less (no prior).
TAIL_DOUBLINGS = 7.0
ROW_TEXT_KINDS = ("ngram", "eagle")
COST_MODEL_RATIO = 0.07


def tree_bytes(tree) -> int:
    """Bytes of every array in `tree` (a model's parameters: the weight bytes a forward reads)."""
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
    their three branches; a sliding-window layer: its window)."""
    full = sum(layer_attention_bytes(cfg, batch, context).values())
    window = key_bytes(cfg, batch) * min(context, cfg.sliding_window)
    return (cfg.num_layers - len(cfg.sliding_layers)) * full + len(cfg.sliding_layers) * window


def weight_bytes_read(cfg: ModelConfig, weight_bytes: int, tokens: int) -> int:
    """The weight bytes a forward over `tokens` rows reads: a dense model's `weight_bytes`; of a
    mixture-of-experts model's experts only those hit, in expectation E (1 - (1 - k/E)^tokens) a
    layer for rows routed evenly to k of E experts (one token: k; a verify pass of many rows: more).
    An expert's bytes are the stacks' share of `weight_bytes` (everything else at the config's dtype)
    over L x E, so packed MXFP4 stacks are priced as stored."""
    if cfg.moe is None:
        return weight_bytes
    E, k = cfg.moe.num_experts, cfg.moe.top_k
    shapes = decoder.param_shapes(cfg)
    for name in ("moe_gate_up", "moe_down"):
        del shapes["layers"][name]
    rest = sum(math.prod(s) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)))
    expert = (weight_bytes - rest * jnp.dtype(cfg.dtype).itemsize) / (cfg.num_layers * E)
    hit = E * (1 - (1 - k / E) ** tokens)
    return round(weight_bytes - cfg.num_layers * (E - hit) * expert)


def step_floor_s(cfg: ModelConfig, weight_bytes: int, batch: int, context: int, bandwidth_GBps: float,
                 rows: int = 1) -> float:
    """The bytes floor of a decode step of `rows` rows a sequence: (the weights it reads + KV read +
    float32 logits written) / measured bandwidth."""
    logits = batch * cfg.vocab_size * 4
    weights = weight_bytes_read(cfg, weight_bytes, batch * rows)
    return (weights + kv_bytes_read(cfg, batch, context) + logits) / (bandwidth_GBps * 1e9)


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
    back to back (`seconds_per_call`: one call timed with its host sync reads about half the copy
    rate; bench/NOTES.md, "what the default, `--method auto`, gets at each batch"). Measured once per
    process (well under a second)."""
    n = (1 << 26) if jax.default_backend() != "cpu" else (1 << 22)
    x = jnp.ones((n,), jnp.float32)
    return 2 * x.nbytes / seconds_per_call(jax.jit(lambda x: x + 1), x) / 1e9


def head_step_bytes(head: EagleConfig, cfg: ModelConfig, batch: int, context: int) -> int:
    """Bytes one step of an EAGLE-3 draft head reads and writes: its weights (and the target's LM head
    when it shares it), its own K and V over `context` positions (its window's, if shorter), and
    float32 logits over its draft vocabulary."""
    itemsize = jnp.dtype(cfg.dtype).itemsize
    shapes = eagle.param_shapes(head)
    weights = sum(math.prod(shape) for name, shape in shapes.items() if name != "d2t") * itemsize  # d2t: a gather
    if head.shared_lm_head:
        weights += cfg.vocab_size * cfg.hidden_size * itemsize
    keys = min(context, head.sliding_window or context)
    kv = batch * keys * head.num_kv_heads * head.head_dim * 2 * itemsize
    return weights + kv + batch * head.draft_vocab_size * 4


def predict(strategy: Strategy, cfg: ModelConfig, weight_bytes: int, batch: int, context: int, bandwidth_GBps: float,
            min_tokens: int = 256, head: EagleConfig | None = None) -> Prediction:
    """The cost model's prediction for a chain strategy (plain, a sparse drafter, ngram, or eagle with
    the draft head `head`):

      forward(keys, rows, nsa) = layers x (LAYER_OVERHEAD_S + NSA_LAYER_OVERHEAD_S if nsa)
                                 + (weights read + K/V bytes of `keys` + rows x batch x vocab x 4) / bandwidth
                                 (weights read: an MoE model's rows hit more experts: `weight_bytes_read`)
      plain step  = forward(context, 1, NSA attention on NSA models)
      iteration   = depth x draft + verify + ITERATION_OVERHEAD_S, draft = forward(K + depth + 1 keys
                    (selection + tail), 1, dense attention, the draft's weight bytes) with K =
                    clamp(ceil(ratio x context), min_tokens, context) (full: the context), 0 for
                    ngram (no model), HEAD_STEP_OVERHEAD_S + `head_step_bytes` / bandwidth for eagle;
                    verify = forward(context, depth + 1, NSA on NSA models)
      tokens/iteration = 1 + sum_{i=1..depth} alpha^i (geometric acceptance, PRIOR_ACCEPTANCE)
      tokens/s = batch x tokens/iteration / iteration

    The bytes term is the step floor (`step_floor_s`). The overheads are launches and small kernels,
    which the floor does not see (small models' steps run several times their floors); they and the
    acceptance priors (alpha below what sparse self-drafts measured, as harder text and larger models
    accept less) were calibrated on measured steps (bench/NOTES.md, "SSV: grouped NSA verification,
    refresh/reuse layers, the planner"). Refinement replaces both the acceptance and the time scale
    with what the run observes.
    """
    if strategy.tree is not None:
        raise ValueError("the cost model predicts chains only; trees need a measured table")

    bandwidth = bandwidth_GBps * 1e9

    def forward(rows: int, draft_keys: int | None = None) -> float:
        """`rows` rows through the target's own attention over the context, or (draft_keys) one row
        through dense attention over draft_keys keys, reading the draft's weights."""
        if draft_keys is None:
            floor = step_floor_s(cfg, weight_bytes, batch, context, bandwidth_GBps, rows)
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
    elif strategy.kind == "eagle":
        draft = HEAD_STEP_OVERHEAD_S + head_step_bytes(head, cfg, batch, context) / bandwidth
    alpha = PRIOR_ACCEPTANCE[strategy.kind]
    tpi = 1 + sum(alpha**i for i in range(1, depth + 1))
    iteration = depth * draft + verify + ITERATION_OVERHEAD_S
    return Prediction(strategy, batch * tpi / iteration, tpi, iteration)


def closed_tail(prediction: Prediction, batch: int) -> Prediction:
    """`prediction` for a closed batch of `batch` rows: ngram's and eagle's at the prior tail
    (TAIL_DOUBLINGS), their rate with it; the others as they are."""
    if prediction.strategy.kind not in ROW_TEXT_KINDS:
        return prediction
    tail = 1 / (1 + math.log2(batch) / TAIL_DOUBLINGS)
    return dataclasses.replace(prediction, tokens_per_s=prediction.tokens_per_s * tail, tail=tail)


def cost_model(cfg: ModelConfig, weight_bytes: int, batch: int, context: int, bandwidth_GBps: float,
               min_tokens: int = 256, head: EagleConfig | None = None, closed: bool = False) -> list[Prediction]:
    """Predictions, best first, for plain, vegas at gamma 2, 4 and 6 (ratio 0.07, the KV-bound choice
    of bench/kv_bound.json), vegas and full at gamma 6 with int8 draft weights (int8 drafts accept as
    exact ones do, int4 ones markedly less, so int4 is for tables and fixed methods only: bench/NOTES.md,
    "int4, skipped layers, `full`, the quantized-matmul kernel"; batches of up to one kernel row block,
    which reads the int8 matrix once), ngram at gamma 4 and 8 and, given the run's draft `head`, eagle
    at gamma 3 and 5, all strict (approximate precision classes and draft trees are chosen from
    measured tables only). `closed`: for a static batch (`closed_tail`)."""
    strategies = [Strategy()] + [Strategy("vegas", gamma=g, ratio=COST_MODEL_RATIO) for g in (2, 4, 6)]
    if batch <= kernels.ROW_MATMUL_ROWS and cfg.moe is None:  # a draft forward's rows in one row block: int8 read once
        strategies += [Strategy("vegas", gamma=6, ratio=COST_MODEL_RATIO, draft_weights="int8"),
                       Strategy("full", gamma=6, draft_weights="int8")]
    strategies += [Strategy("ngram", gamma=g) for g in (4, 8)]
    strategies += [Strategy("eagle", gamma=g) for g in (3, 5)] if head is not None else []
    predictions = [predict(s, cfg, weight_bytes, batch, context, bandwidth_GBps, min_tokens, head) for s in strategies]
    if closed:
        predictions = [closed_tail(p, batch) for p in predictions]
    return sorted(predictions, key=lambda p: -p.tokens_per_s)
