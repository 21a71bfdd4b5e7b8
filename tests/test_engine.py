"""The engine's promise: every method's output is the target model's own (docs/architecture.md, "the speculative-decoding contract").

Greedy outputs of every method, draft length and draft-tree shape (both traversal orders) equal plain
greedy decoding token for token (float32, SmolLM2 and a random Qwen3), on a batch of different lengths
and on a long prompt of real text; sampled outputs, chains and trees, follow the target's distribution
(chi-square against exact teacher-forced probabilities); a chain is exactly the tree of widths 1; and
plain cached decoding equals full forwards.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxspec import corpus
from jaxspec.decoding import engine
from jaxspec.models import decoder, draft_weights
from jaxspec.models.config import ModelConfig
from jaxspec.models.kvcache import init_cache
from jaxspec.loaders import load_model
from jaxspec.runner import Batch, decode_fns, encode_prompts, prefill_fn
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import METHODS, SpecConfig
from pallas_kernels import paging
from paged_pools import repeated

# full drafts over the whole cache, so it needs a draft model cheaper than the target: the draft-model tests
SPEC_METHODS = [m for m in METHODS if m not in ("plain", "full", "eagle")]  # eagle drafts with a head: test_eagle_engine
# By default 7 drafts for every method on the random Qwen3 and for vegas on SmolLM2, one tree each; the
# rest with the slow tests (a chain is the width-1 tree, and the trees below cover the middle depths)
# 16 and 12 verified rows; the second gives each node its own children (a node of depth 1 and one of depth 2
# without any: leaves above the last depth)
TREES = [((3, 2, 1), "bfs"), ((3, (3, 1), (2, 0, 1, 1)), "dfs")]
GREEDY = SamplingConfig()


def generate(params, cfg, batch: Batch, cache, spec: SpecConfig, max_len: int, max_new: int, sampling=GREEDY, seed=0, stop_ids=(-1,)):
    """Runs start + decode on a prefilled cache; returns (generated token lists, stats)."""
    start, decode = decode_fns(cfg, spec, sampling, max_len)
    state = start(
        params, jax.tree.map(jnp.copy, cache), jnp.asarray(batch.ids), jnp.asarray(batch.lengths), jax.random.key(seed),
        spec.budget(),
        max_new_tokens=jnp.int32(max_new), stop_ids=jnp.asarray(stop_ids, jnp.int32),
    )
    state = decode(params, state, max_iterations=jnp.int32(1 << 30))
    tokens, length, prompt_len = jax.device_get((state.tokens, state.length, state.prompt_len))
    return [tokens[b, prompt_len[b] : length[b]].tolist() for b in range(len(length))], jax.device_get(state.stats)


def prefilled(params, cfg, batch: Batch, max_len: int):
    return prefill_fn(cfg, max_len, "reference", 256)(params, jnp.asarray(batch.ids), jnp.asarray(batch.lengths))


class Case:
    """A model, a batch, its prefilled cache and the plain greedy output to compare against."""

    def __init__(self, cfg, params, batch: Batch, max_new: int):
        self.cfg, self.params, self.batch, self.max_new = cfg, params, batch, max_new
        self.max_len = int(batch.lengths.max()) + max_new
        self.cache = prefilled(params, cfg, batch, self.max_len)
        self.plain, _ = self.run(SpecConfig())

    def run(self, spec: SpecConfig, params=None, **kw):
        return generate(self.params if params is None else params, self.cfg, self.batch, self.cache, spec, self.max_len,
                        self.max_new, **kw)


@pytest.fixture(scope="module")
def smollm2_f32():
    return load_model("smollm2", dtype="float32")


@pytest.fixture(scope="module")
def smollm2_bf16():
    return load_model("smollm2", dtype="bfloat16")


@pytest.fixture(scope="module")
def smollm2_batch(smollm2_f32):
    """Rows of different lengths, one of more than 2,000 tokens of real text (sparse drafters keep ~12%)."""
    cfg, params, tokenizer = smollm2_f32
    prompts = [
        "What is the capital of France? Answer in one sentence.",
        corpus.long_prompt(tokenizer, 2200, task="question"),
        corpus.long_prompt(tokenizer, 300, task="summary", offset=7),
    ]
    batch = encode_prompts(tokenizer, prompts, chat=True)
    assert batch.lengths[1] >= 2000
    return Case(cfg, params, batch, max_new=24)


@pytest.fixture(scope="module")
def qwen3_case():
    cfg = ModelConfig(
        model_type="qwen3", vocab_size=512, hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=2,
        head_dim=32, intermediate_size=256, qk_norm=True, dtype="float32",
    )
    params = decoder.init_params(cfg, jax.random.key(3), scale=0.08)
    rng = np.random.default_rng(11)
    lengths = np.array([700, 37, 300], np.int32)
    ids = np.zeros((3, lengths.max()), np.int32)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(0, cfg.vocab_size, n)
    return Case(cfg, params, Batch(ids, lengths), max_new=48)


@pytest.fixture(scope="module")
def smollm2_text(smollm2_f32):
    """Two rows of real text (~300 and ~200 tokens) for 24 new tokens: with min_tokens 32 a sparse
    drafter selects ~10-15% of the context, so drafting over a subset runs on the real model by default."""
    cfg, params, tokenizer = smollm2_f32
    prompts = [corpus.long_prompt(tokenizer, 300, task="summary", offset=7),
               corpus.long_prompt(tokenizer, 200, task="question", offset=2)]
    batch = encode_prompts(tokenizer, prompts, chat=True)
    assert batch.lengths.min() >= 150
    return Case(cfg, params, batch, max_new=24)


def tokens_per_iteration(out, stats) -> np.ndarray:
    """Committed tokens per iteration of each row (the first token comes from the prefill)."""
    return np.array([len(o) - 1 for o in out]) / np.maximum(stats.iterations, 1)


@pytest.mark.parametrize("spec, least", [  # least: a floor under the rows' measured 2.9-3.8 (vegas), 1.9-2.6 (quest)
    (SpecConfig(method="vegas", gamma=4, min_tokens=32), 2.0),
    # slow: a duplicate of vegas-chain's real text and of test_tree_greedy_lossless_qwen3's trees
    pytest.param(SpecConfig(method="quest", tree=(3, 2, 1), min_tokens=32), 1.5, marks=pytest.mark.slow),
], ids=["vegas-chain", "quest-tree"])
def test_sparse_drafts_on_real_text_are_lossless_and_accepted(smollm2_text, spec, least):
    """Greedy sparse drafting over ~32 selected slots of real text (float32 SmolLM2) emits plain's
    tokens, and real weights get several drafts accepted per iteration: a bug in the accept-several
    path (a draft dropped, its keys left unmoved) changes the tokens or lowers the rate."""
    spec = spec.validate()
    assert spec.min_tokens < 0.25 * smollm2_text.batch.lengths.min()  # the selection is a subset
    out, stats = smollm2_text.run(spec)
    assert out == smollm2_text.plain
    assert (tokens_per_iteration(out, stats) > least).all(), tokens_per_iteration(out, stats)


# With the slow tests (the default run's 20 minutes): every drafter's 7 run on the random Qwen3 below by
# default, and greedy vegas on SmolLM2 through the CLI (test_cli's JSON batch)
@pytest.mark.slow
@pytest.mark.parametrize("method, gamma", [pytest.param(m, g, id=f"{m}-{g}") for m in SPEC_METHODS for g in (1, 4, 7)])
def test_greedy_lossless_smollm2(smollm2_batch, method, gamma):
    out, stats = smollm2_batch.run(SpecConfig(method=method, gamma=gamma))
    assert out == smollm2_batch.plain
    assert stats.iterations.sum() > 0 and stats.drafted.sum() == gamma * stats.iterations.sum()


@pytest.mark.parametrize("gamma", [pytest.param(1, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow), 7])
@pytest.mark.parametrize("method", SPEC_METHODS)
def test_greedy_lossless_qwen3(qwen3_case, method, gamma):
    # min_tokens 32 keeps the selection sparse on these short contexts.
    out, _ = qwen3_case.run(SpecConfig(method=method, gamma=gamma, min_tokens=32))
    assert out == qwen3_case.plain


def with_draft(case, spec: SpecConfig, weights: str, skip=()):
    """The spec with a draft model (weights, skipped layers), checked, and the case's params with its copies."""
    spec = dataclasses.replace(spec, draft_weights=weights, draft_skip=skip).validate().check_model(case.cfg)
    return spec, draft_weights.with_draft_weights(case.params, weights, skip)


@pytest.mark.parametrize("spec, weights, skip, least", [
    # on the real model with the slow tests (the default run's 20 minutes): the random Qwen3 below runs
    # quantized and skipping drafts by default, and so does the sampling test further on
    pytest.param(SpecConfig(method="vegas", gamma=6), "int8", (), 0.5, marks=pytest.mark.slow),
    pytest.param(SpecConfig(method="stream", gamma=4), "int4", (), 0.3, marks=pytest.mark.slow),
    pytest.param(SpecConfig(method="quest", tree=(3, 2, 1)), "int8", (), 0.5, marks=pytest.mark.slow),
    pytest.param(SpecConfig(method="full", gamma=4), "int4", (), 0.3, marks=pytest.mark.slow),
    pytest.param(SpecConfig(method="vegas", gamma=3), "exact", (4, 17), 0.1, marks=pytest.mark.slow),
    pytest.param(SpecConfig(method="full", tree=(2, 2)), "int8", (4,), 0.1, marks=pytest.mark.slow),
], ids=["vegas-int8", "stream-int4", "quest-tree-int8", "full-int4", "vegas-skip", "full-tree-int8-skip"])
def test_draft_models_lossless_smollm2(smollm2_batch, spec, weights, skip, least):
    """Drafts that read quantized copies of the layer weights and leave out layers (verification
    exact) emit plain's tokens, and real weights still get drafts accepted (`least`: of the longest
    accepted path)."""
    spec, params = with_draft(smollm2_batch, spec, weights, skip)
    out, stats = smollm2_batch.run(spec, params=params)
    assert out == smollm2_batch.plain
    assert stats.accepted.sum() > least * spec.draft_len * stats.iterations.sum()


@pytest.mark.parametrize("method, weights, skip", [  # all_rows and last_accepted draft as vegas does: slow
    ("vegas", "int8", ()), pytest.param("all_rows", "int4", (), marks=pytest.mark.slow),
    pytest.param("last_accepted", "int8", (2,), marks=pytest.mark.slow), ("full", "int4", (1,)),
    ("stream", "exact", (3,)), ("quest", "int8", (2,)),
])
def test_draft_models_lossless_qwen3(qwen3_case, method, weights, skip):
    spec, params = with_draft(qwen3_case, SpecConfig(method=method, gamma=5, min_tokens=32), weights, skip)
    out, stats = qwen3_case.run(spec, params=params)
    assert out == qwen3_case.plain and stats.accepted.sum() > 0


@pytest.mark.slow  # every method's trees run on the random Qwen3 below by default (the default run's 20 minutes)
@pytest.mark.parametrize("method,tree,order", [pytest.param(m, *TREES[i % 2]) for i, m in enumerate(SPEC_METHODS)])
def test_tree_greedy_lossless_smollm2(smollm2_batch, method, tree, order):
    """Every method on the real model with a tree, the two shapes and orders alternating (the random
    Qwen3 below gives each method the other one)."""
    spec = SpecConfig(method=method, tree=tree, traversal=order).validate()
    out, stats = smollm2_batch.run(spec)
    assert out == smollm2_batch.plain
    assert stats.drafted.sum() == (spec.shape.rows - 1) * stats.iterations.sum() > 0


# all_rows and last_accepted draft trees through vegas's path (their chains run by default above)
TREE_DUPLICATES = ("all_rows", "last_accepted")


@pytest.mark.parametrize("method,tree,order", [
    (m, *TREES[(i + 1) % 2]) if other and m not in TREE_DUPLICATES else pytest.param(m, *TREES[(i + other) % 2], marks=pytest.mark.slow)
    for i, m in enumerate(SPEC_METHODS) for other in (True, False)])
def test_tree_greedy_lossless_qwen3(qwen3_case, method, tree, order):
    """Every method with both shapes and orders; by default each with the shape SmolLM2's test above
    does not give it (the other with the slow tests: the default run's 20 minutes; all_rows's and
    last_accepted's trees with them too: TREE_DUPLICATES)."""
    out, _ = qwen3_case.run(SpecConfig(method=method, tree=tree, traversal=order, min_tokens=32).validate())
    assert out == qwen3_case.plain


@pytest.mark.parametrize("method,tree,order", [  # quest's kernels alone: test_kernels_quest_pages; the chain's
    # single-row kernels each against their reference in test_kernels_* (and on the GPU in bench/gpu_checks): slow
    ("vegas", (3, 2, 1), "bfs"), pytest.param("vegas", None, "bfs", marks=pytest.mark.slow),
    pytest.param("quest", (2, 2), "dfs", marks=pytest.mark.slow)])
def test_tree_greedy_lossless_pallas_kernels(method, tree, order):
    """The engine on the Pallas kernels (interpret mode): multi-row sparse drafting with ancestor bits,
    tree verification with collection, a chain (`--backend pallas`'s default shape), Quest's dense
    layers with the mask; greedy equals plain."""
    cfg = ModelConfig(model_type="qwen3", vocab_size=512, hidden_size=128, num_layers=2, num_heads=8, num_kv_heads=2,
                      head_dim=32, intermediate_size=256, qk_norm=True, dtype="float32")
    params = decoder.init_params(cfg, jax.random.key(3), scale=0.08)
    ids = np.random.default_rng(11).integers(0, cfg.vocab_size, (2, 300)).astype(np.int32)
    case = Case(cfg, params, Batch(ids, np.array([300, 37], np.int32)), max_new=16)
    out, stats = case.run(SpecConfig(method=method, gamma=3, tree=tree, traversal=order, min_tokens=32,
                                     backend="pallas").validate())
    assert out == case.plain and stats.accepted.sum() > 0


def full_forward_greedy(params, cfg, batch: Batch, max_new: int) -> list[list[int]]:
    """Plain greedy decoding without the engine: each token the argmax of a full forward
    (`decoder.score`, no cache) over the row's tokens so far, padded at the end (causal: padding
    after a position does not reach it), so one compiled forward serves every step."""
    lengths = batch.lengths.copy()
    seqs = np.zeros((len(lengths), int(lengths.max()) + max_new), np.int32)
    seqs[:, : batch.ids.shape[1]] = batch.ids
    score = jax.jit(decoder.score, static_argnums=1)
    for _ in range(max_new):
        logits = np.asarray(score(params, cfg, jnp.asarray(seqs)))
        seqs[np.arange(len(lengths)), lengths] = logits[np.arange(len(lengths)), lengths - 1].argmax(-1)
        lengths += 1
    return [seqs[b, n : n + max_new].tolist() for b, n in enumerate(batch.lengths)]


def test_chain_equals_sequential_full_forwards(qwen3_case):
    """The engine's plain decoding and a chain (vegas, gamma 4, with drafts both accepted and
    rejected) emit the tokens of an independent reference: one full forward per token (the first 16)."""
    case, n = qwen3_case, 16
    reference = full_forward_greedy(case.params, case.cfg, case.batch, n)
    assert [row[:n] for row in case.plain] == reference
    out, stats = case.run(SpecConfig(method="vegas", gamma=4, min_tokens=32))
    assert [row[:n] for row in out] == reference and 0 < stats.accepted.sum() < stats.drafted.sum()


@pytest.mark.parametrize("method", [  # all_rows and last_accepted select through vegas's path: slow tests
    "vegas", pytest.param("all_rows", marks=pytest.mark.slow), pytest.param("last_accepted", marks=pytest.mark.slow),
    pytest.param("stream", marks=pytest.mark.slow), pytest.param("quest", marks=pytest.mark.slow)])
def test_dense_budget_accepts_every_draft(qwen3_case, method):
    """A budget covering the whole context makes the draft the target itself: all drafts accepted,
    and with a tree the greedy path runs through first children (top-1 drafts) to full depth; every
    accepted draft and the bonus token are committed (depth + 1 tokens an iteration, the last one cut
    at max_new), the accepted path's keys moved into place, and the tokens are plain's."""
    out, stats = qwen3_case.run(SpecConfig(method=method, gamma=4, ratio=1.0, min_tokens=32))
    assert out == qwen3_case.plain
    assert stats.accepted.sum() == stats.drafted.sum() > 0
    np.testing.assert_array_equal(stats.iterations, -(-(qwen3_case.max_new - 1) // 5))
    spec = SpecConfig(method=method, tree=(2, 2, 1), ratio=1.0, min_tokens=32).validate()
    out, stats = qwen3_case.run(spec)
    assert out == qwen3_case.plain
    assert stats.accepted.sum() == 3 * stats.iterations.sum() > 0
    np.testing.assert_array_equal(stats.iterations, -(-(qwen3_case.max_new - 1) // 4))


@pytest.mark.parametrize("method", ["vegas", pytest.param("stream", marks=pytest.mark.slow)])
def test_shared_budget_is_lossless_and_moves_the_drafts(qwen3_case, method):
    """Rows that share the budget by their lost drafts (`balance`) emit plain's tokens, and draft
    differently from an even budget (the engine passes the shared budget to the drafter)."""
    even = SpecConfig(method=method, gamma=4, ratio=0.15, min_tokens=8)
    out, stats_even = qwen3_case.run(even)
    out_shared, stats_shared = qwen3_case.run(dataclasses.replace(even, balance=4.0))
    assert out == out_shared == qwen3_case.plain
    assert not np.array_equal(stats_even.accepted, stats_shared.accepted)


def test_selections_spaced_out_are_lossless(qwen3_case):
    """Selecting after every third verification only (`select_every`) emits plain's tokens and drafts
    differently from selecting every time. The drafts' tail reaches back to the last selection: with
    a budget that covers the context the drafts are the target's own, so every one is accepted only
    if the reference kernel's fixed tail window is that wide (the Pallas kernel's tail is traced)."""
    each = SpecConfig(method="vegas", gamma=4, min_tokens=32)
    spaced = dataclasses.replace(each, select_every=3)
    out, stats = qwen3_case.run(each)
    out_spaced, stats_spaced = qwen3_case.run(spaced)
    assert out == out_spaced == qwen3_case.plain
    assert not np.array_equal(stats.accepted, stats_spaced.accepted)
    out_whole, stats_whole = qwen3_case.run(dataclasses.replace(spaced, min_tokens=4096))
    assert out_whole == qwen3_case.plain
    assert stats_whole.accepted.sum() == 4 * stats_whole.iterations.sum() > 0
    np.testing.assert_array_equal(stats_whole.iterations, -(-(qwen3_case.max_new - 1) // 5))


@pytest.mark.slow  # selection quality on real text, not losslessness (~48 s of the default run's 20 minutes)
def test_selection_is_what_the_draft_sees(smollm2_batch):
    """On the 2,000+ token row, 3 selected slots draft poorly and the default 256 draft well."""
    rate = lambda stats: stats.accepted[1] / stats.drafted[1]
    _, tight = smollm2_batch.run(SpecConfig(method="vegas", gamma=4, ratio=0.001, min_tokens=1))
    _, default = smollm2_batch.run(SpecConfig(method="vegas", gamma=4))
    assert rate(tight) < 0.6 < 0.8 < rate(default)


def test_teacher_forced_argmax_bf16(smollm2_bf16):
    """In bf16, each token vegas emits (sparse: 32 of ~300 slots) is the target argmax of its prefix
    (a full forward's logits), and drafts are accepted."""
    cfg, params, tokenizer = smollm2_bf16
    batch = encode_prompts(tokenizer, [corpus.long_prompt(tokenizer, 300, task="continue", offset=3)], chat=True)
    max_len = int(batch.lengths[0]) + 16
    cache = prefilled(params, cfg, batch, max_len)
    out, stats = generate(params, cfg, batch, cache, SpecConfig(method="vegas", gamma=4, min_tokens=32), max_len, 16)
    assert stats.accepted.sum() > stats.iterations.sum()  # more than one draft an iteration
    full = np.concatenate([batch.ids[0, : batch.lengths[0]], out[0]])
    logits = np.asarray(decoder.score(params, cfg, jnp.asarray(full[None])))[0]
    predicted = logits[batch.lengths[0] - 1 : -1]
    top2 = np.sort(predicted, axis=-1)[:, -2:]
    chosen = predicted[np.arange(len(out[0])), out[0]]
    # The emitted token is the argmax, up to bf16 near-ties between the top two logits.
    assert np.all(chosen >= top2[:, 1] - 0.05 * np.maximum(1.0, np.abs(top2[:, 1])))
    assert np.mean(np.argmax(predicted, -1) == np.array(out[0])) >= 0.9


def test_stop_ids_and_max_tokens(qwen3_case):
    """A stop id ends its row right after it (inside accepted drafts too); rows stop independently."""
    plain = qwen3_case.plain
    stop = plain[1][5]
    for spec in (SpecConfig(), SpecConfig(method="vegas", gamma=7, min_tokens=32)):
        out, stats = qwen3_case.run(spec, stop_ids=(stop,))
        for row, ref in zip(out, plain):
            expected = ref[: ref.index(stop) + 1] if stop in ref else ref
            assert row == expected
        assert spec.method == "plain" or (stats.accepted > 0).all()  # drafts accepted in every row


@pytest.mark.parametrize("spec", [SpecConfig(method="vegas", gamma=4, min_tokens=32),
                                  SpecConfig(method="quest", tree=(2, 2), traversal="dfs", min_tokens=32)])
def test_finished_rows_stop_reading_and_writing(qwen3_case, spec):
    """A finished row's later passes run at slot 0 and write nothing (engine.roots): its cache keeps
    what it held when it finished (a tree's compaction moves nothing in it either), its selection
    shrinks to one slot, and the rows still running emit plain's tokens."""
    case, spec = qwen3_case, spec.validate()
    stop = case.plain[1][2]
    start, decode = decode_fns(case.cfg, spec, GREEDY, case.max_len)
    state = start(case.params, jax.tree.map(jnp.copy, case.cache), jnp.asarray(case.batch.ids),
                  jnp.asarray(case.batch.lengths), jax.random.key(0), spec.budget(),
                  max_new_tokens=jnp.int32(case.max_new), stop_ids=jnp.asarray([stop], jnp.int32))
    while not bool(state.done[1]):
        state = decode(case.params, state, max_iterations=jnp.int32(1))
    assert not bool(state.done.all())
    if spec.method == "vegas":
        assert int(state.drafter.n_idx[1]) == 1 and int(state.drafter.n_idx[0]) > 1
    row = lambda cache: jax.device_get(tuple(paging.logical_view(pool, cache.pages, cache.page_size)[:, 1]
                                             for pool in (cache.k, cache.v)))
    frozen = row(state.cache)
    state = decode(case.params, state, max_iterations=jnp.int32(1 << 30))
    jax.tree.map(np.testing.assert_array_equal, row(state.cache), frozen)
    tokens, length = jax.device_get((state.tokens, state.length))
    for b, (ref, n) in enumerate(zip(case.plain, case.batch.lengths)):
        assert tokens[b, n : length[b]].tolist() == (ref[: ref.index(stop) + 1] if stop in ref else ref)


def test_generate_inside_a_users_jit(qwen3_case):
    """The README's library use: `engine.Engine.generate` under the caller's own jax.jit, prefill included."""
    case = qwen3_case
    spec = SpecConfig(method="vegas", gamma=4, min_tokens=32)

    @jax.jit
    def run(params, ids, lengths, key):
        return engine.Engine(case.cfg, spec, GREEDY, case.max_len).generate(
            params, ids, lengths, key, max_new_tokens=case.max_new, stop_ids=jnp.array([-1], jnp.int32))

    out = run(case.params, jnp.asarray(case.batch.ids), jnp.asarray(case.batch.lengths), jax.random.key(0))
    tokens, length = jax.device_get((out.tokens, out.length))
    assert [tokens[b, n : length[b]].tolist() for b, n in enumerate(case.batch.lengths)] == case.plain
    assert int(out.stats.accepted.sum()) > 0


@pytest.mark.slow  # by default: test_batching's rows admitted into a running batch equal each row alone
def test_batched_rows_equal_rows_alone(qwen3_case):
    assert_rows_alone_equal_batched(qwen3_case)


@pytest.mark.slow  # the same on real text (~55 s of the default run's 20 minutes)
def test_batched_rows_equal_rows_alone_smollm2(smollm2_batch):
    assert_rows_alone_equal_batched(smollm2_batch)


def assert_rows_alone_equal_batched(case: Case) -> None:
    """Each row generated alone (own prefill, plain greedy) equals its row of the batched run."""
    for b in range(len(case.batch.lengths)):
        n = case.batch.lengths[b]
        single = Batch(case.batch.ids[b : b + 1, :n], case.batch.lengths[b : b + 1])
        cache = prefilled(case.params, case.cfg, single, case.max_len)
        out, _ = generate(case.params, case.cfg, single, cache, SpecConfig(), case.max_len, case.max_new)
        assert out[0] == case.plain[b]


def test_cached_decoding_equals_full_forward(qwen3_case):
    """Logits of one-token cached steps equal a full forward's logits at every position."""
    case = qwen3_case
    cfg, params = case.cfg, case.params
    tokens = jnp.asarray(case.batch.ids[:1, :40])
    full = np.asarray(decoder.score(params, cfg, tokens))[0]
    cache = init_cache(cfg, 1, 40)

    @jax.jit
    def step(cache, token, pos):
        attend = decoder.attention(cfg, pos, "reference")
        hidden, cache, _ = decoder.forward(params, cfg, token, pos, jnp.ones((1, 1), bool), cache, attend)
        return decoder.logits(params, cfg, hidden)[0, 0], cache

    for t in range(40):
        got, cache = step(cache, tokens[:, t : t + 1], jnp.array([[t]], jnp.int32))
        np.testing.assert_allclose(np.asarray(got), full[t], rtol=1e-4, atol=1e-4 * np.abs(full[t]).max())


def test_prefill_padding_writes_only_the_prompts():
    """A prefill chunk over rows of different prompt lengths writes each row's prompt slots and
    nothing for its padding tokens: every other slot of the rows' (scattered) pages keeps the poison,
    and so does the null page, where padding goes (past the table: decoder.forward) and the XLA write
    drops it (paging.scatter_slots: on the GPU a scatter of every padded position to one slot
    serialises)."""
    params = decoder.init_params(TINY, jax.random.key(3), scale=0.5)
    prompt_len = jnp.asarray([9, 3], jnp.int32)
    prompts = jax.random.randint(jax.random.key(4), (2, 12), 0, TINY.vocab_size)
    empty = init_cache(TINY, 2, 12 + engine.MAX_TREE_ROWS)
    order = 1 + np.random.default_rng(6).permutation(empty.pages.size)
    empty = empty.with_pages(jnp.asarray(order.reshape(empty.pages.shape), jnp.int32))
    noise = lambda a: jax.random.normal(jax.random.key(5), a.shape, a.dtype) + 7.0
    poison = dataclasses.replace(empty, k=noise(empty.k), v=noise(empty.v))
    cache = engine.prefill_chunk(params, poison, prompts=prompts, prompt_len=prompt_len, begin=0, cfg=TINY,
                                 backend="reference", chunk=12)
    rows = lambda pool: np.asarray(paging.logical_view(pool, cache.pages, cache.page_size))
    for new, old in ((cache.k, poison.k), (cache.v, poison.v)):
        changed = np.any(rows(new) != rows(old), axis=(0, 2, 4))  # [B, S]
        for b, n in enumerate(np.asarray(prompt_len) - 1):  # the last prompt token is the first decode step's
            assert changed[b, :n].all() and not changed[b, n:].any(), b
        null = slice(paging.NULL_PAGE * cache.page_size, (paging.NULL_PAGE + 1) * cache.page_size)
        np.testing.assert_array_equal(np.asarray(new)[:, :, null], np.asarray(old)[:, :, null])


def test_prefill_reads_only_the_pages_under_the_prompts():
    """A prefill (chunks of more than 64 rows: the reference attention over a row's table) reads no page
    past the prompts' width: with NaN in every later page of a long cache it writes exactly what it
    writes into a clean one (before, the reference read the whole table: 0 x NaN)."""
    params = decoder.init_params(TINY, jax.random.key(8), scale=0.5)
    prompt_len = jnp.asarray([150, 97], jnp.int32)
    prompts = jax.random.randint(jax.random.key(9), (2, 150), 0, TINY.vocab_size)
    clean = init_cache(TINY, 2, 1024, page_size=64)
    under = -(-prompts.shape[1] // clean.page_size)
    later = np.zeros(clean.k.shape[2], bool)
    for page in np.asarray(clean.pages)[:, under:].ravel():
        later[page * 64:(page + 1) * 64] = True
    nan = lambda pool: jnp.where(jnp.asarray(later)[None, None, :, None], jnp.nan, pool)
    poisoned = dataclasses.replace(clean, k=nan(clean.k), v=nan(clean.v))
    fill = jax.jit(functools.partial(engine.prefill_cache, cfg=TINY, max_len=1000, chunk=128))
    want, got = fill(params, prompts, prompt_len, cache=clean), fill(params, prompts, prompt_len, cache=poisoned)
    for new, ref in ((got.k, want.k), (got.v, want.v)):
        np.testing.assert_array_equal(np.asarray(new)[:, :, ~later], np.asarray(ref)[:, :, ~later])
        assert np.isfinite(np.asarray(new)[:, :, ~later]).all()


@pytest.mark.slow  # by default seeds repeat in test_server's sampled requests and test_batching's sampled rows
def test_same_seed_same_tokens(smollm2_batch):
    sampling = SamplingConfig(temperature=0.8, top_p=0.95)
    spec = SpecConfig(method="vegas", gamma=4)
    a, _ = smollm2_batch.run(spec, sampling=sampling, seed=5)
    b, _ = smollm2_batch.run(spec, sampling=sampling, seed=5)
    c, _ = smollm2_batch.run(spec, sampling=sampling, seed=6)
    assert a == b and a != c


# --- distribution: speculative sampling emits the target's own distribution ----------------------

TINY = ModelConfig(
    model_type="llama", vocab_size=8, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
    intermediate_size=64, dtype="float32",
)


def _exact_joint(params, prompt: np.ndarray) -> np.ndarray:
    """p(x1, x2 | prompt) at temperature 1 from teacher-forced full forwards, [V, V], float64."""
    V = TINY.vocab_size
    seqs = np.concatenate([np.tile(prompt, (V, 1)), np.arange(V)[:, None]], axis=1)
    logits = np.asarray(decoder.score(params, TINY, jnp.asarray(seqs)), np.float64)
    p1 = np.exp(logits[0, -2] - np.logaddexp.reduce(logits[0, -2]))
    p2 = np.exp(logits[:, -1] - np.logaddexp.reduce(logits[:, -1], axis=-1, keepdims=True))
    return p1[:, None] * p2


@pytest.fixture(scope="module")
def tiny_rows():
    """The chi-square tests' target, prompt, batch of 12,000 identical rows and its prefilled cache: one
    row prefilled and repeated (prefilling the whole batch took ~8 s per case; draft weights do not
    change the target's cache)."""
    params = decoder.init_params(TINY, jax.random.key(7), scale=0.6)
    prompt = np.random.default_rng(0).integers(0, TINY.vocab_size, 50).astype(np.int32)
    rows = 12000
    batch = Batch(np.tile(prompt, (rows, 1)), np.full((rows,), len(prompt), np.int32))
    one_row = prefilled(params, TINY, Batch(batch.ids[:1], batch.lengths[:1]), len(prompt) + 2)
    return params, prompt, batch, repeated(one_row, rows)


@pytest.mark.parametrize("method,tree,order,weights,skip,draws", [
    # plain checks the harness; stream's and ngram's chains sample as vegas's does, stream's tree as
    # vegas's, and draft models as the target (vegas's chain and tree, its tree's top-b children, and
    # ngram's one-hot q in its tree run by default; the rest with the slow tests: the default run's 20 minutes)
    pytest.param("plain", None, "bfs", "exact", (), "sampled", marks=pytest.mark.slow),
    pytest.param("vegas", None, "bfs", "exact", (), "sampled", marks=pytest.mark.slow),  # the tree cases' width-1 tree
    pytest.param("stream", None, "bfs", "exact", (), "sampled", marks=pytest.mark.slow),
    pytest.param("ngram", None, "bfs", "exact", (), "sampled", marks=pytest.mark.slow),
    ("vegas", (3, 2), "bfs", "exact", (), "sampled"), ("vegas", (3, (2, 0, 1)), "bfs", "exact", (), "top"),
    pytest.param("vegas", None, "bfs", "exact", (), "top", marks=pytest.mark.slow),
    pytest.param("stream", (2, 1, 2), "dfs", "exact", (), "sampled", marks=pytest.mark.slow),
    ("ngram", (2, 2), "bfs", "exact", (), "sampled"),
    pytest.param("vegas", None, "bfs", "int8", (), "sampled", marks=pytest.mark.slow),
    pytest.param("full", (2, 2), "bfs", "int4", (1,), "sampled", marks=pytest.mark.slow),
])
def test_first_two_tokens_follow_the_target(tiny_rows, method, tree, order, weights, skip, draws):
    """Chi-square of the first two sampled tokens (V^2 = 64 cells, 12,000 rows) against the exact joint.

    The drafters here really differ from the target (16 of 50 context slots), so the recovered-token
    path is exercised; ngram exercises one-hot q (its trees: several earlier matches of the suffix);
    trees exercise sampling children without replacement and recursive rejection, or with draws
    "top" a model drafter's top-b children as one-hot candidates; quantized draft weights and a
    skipped layer a draft model that differs from the target in its weights too. One batch of
    identical rows gives independent draws.
    """
    target, prompt, batch, cache = tiny_rows
    params = draft_weights.with_draft_weights(target, weights, skip)
    rows, max_len = len(batch.lengths), len(prompt) + 2
    spec = SpecConfig(method=method, gamma=3, tree=tree, traversal=order, ratio=0.3, min_tokens=1, ngram_min=1,
                      ngram_max=2, draft_weights=weights, draft_skip=skip, draws=draws).validate()
    out, stats_ = generate(params, TINY, batch, cache, spec, max_len, 2, sampling=SamplingConfig(temperature=1.0), seed=1)
    pairs = np.array(out)
    assert pairs.shape == (rows, 2)
    if method != "plain":  # drafts are both accepted and rejected
        assert 0 < stats_.accepted.sum() < stats_.iterations.sum() * spec.draft_len
    counts = np.bincount(pairs[:, 0] * TINY.vocab_size + pairs[:, 1], minlength=TINY.vocab_size**2)
    expected = _exact_joint(params, prompt).reshape(-1) * rows
    keep = expected >= 5  # pool sparse cells so the chi-square approximation holds
    observed = np.append(counts[keep], counts[~keep].sum())
    expected = np.append(expected[keep], expected[~keep].sum())
    _, p_value = stats.chisquare(observed, expected)
    assert p_value > 1e-3
