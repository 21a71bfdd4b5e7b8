"""NSA targets in the engine: cached decoding equals a full forward, verifying
T rows equals T decode steps (blocks completing inside the window, rejected rows overwritten), batched
rows equal rows alone, and every method's greedy output equals plain greedy decoding.

A random NSA model with blocks of 16 tokens, 4 selected blocks and a 32-token window over prompts of
up to 700 tokens (44 blocks): selection drops most blocks, and the nsa1b rule differs from exact.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding.spec import METHODS, SpecConfig
import pallas_kernels as kernels
from jaxspec.models import decoder, draft_weights, nsa
from jaxspec.models.config import ModelConfig, NSAConfig
from jaxspec.models.kvcache import init_cache
from jaxspec.runner import Batch
from pallas_kernels import paging
from test_engine import Case, assert_rows_alone_equal_batched, generate, prefilled

SPEC_METHODS = [m for m in METHODS if m not in ("plain", "full", "eagle")]  # full: with a draft model, below; eagle with a head: test_eagle_engine


def nsa_config(rule: str = "nsa1b") -> ModelConfig:
    return ModelConfig(
        model_type="llama-nsa", vocab_size=512, hidden_size=128, num_layers=3, num_heads=8, num_kv_heads=2,
        head_dim=32, intermediate_size=256, max_position_embeddings=2048, dtype="float32",
        nsa=NSAConfig(block_size=16, block_counts=4, window_size=32, topk_rule=rule),
    )


def random_ids(lengths, vocab, seed):
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), max(lengths)), np.int32)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(0, vocab, n)
    return Batch(ids, np.asarray(lengths, np.int32))


@pytest.fixture(scope="module")
def nsa_case():
    cfg = nsa_config()
    params = decoder.init_params(cfg, jax.random.key(5), scale=0.08)
    return Case(cfg, params, random_ids([700, 37, 300], cfg.vocab_size, 12), max_new=40)


def step_fn(params, cfg):
    """One jitted forward of the rows `tokens` [1, T] at `pos` [1, T]: (logits [T, V], cache)."""

    @jax.jit
    def step(cache, tokens, pos):
        attend = decoder.attention(cfg, pos, "reference")
        hidden, cache, _ = decoder.forward(params, cfg, tokens, pos, jnp.ones(tokens.shape, bool), cache, attend)
        return decoder.logits(params, cfg, hidden)[0], cache

    return step


@pytest.mark.parametrize("rule", ["nsa1b", "exact"])
def test_cached_decoding_equals_full_forward(rule):
    """One-token cached steps reproduce a full forward at every position (each its own selection)."""
    cfg = nsa_config(rule)
    params = decoder.init_params(cfg, jax.random.key(1), scale=0.08)
    n = 300
    tokens = jnp.asarray(random_ids([n], cfg.vocab_size, 2).ids)
    full = np.asarray(decoder.score(params, cfg, tokens))[0]
    step, cache = step_fn(params, cfg), init_cache(cfg, 1, n)
    for t in range(n):
        got, cache = step(cache, tokens[:, t : t + 1], jnp.array([[t]], jnp.int32))
        np.testing.assert_allclose(np.asarray(got)[0], full[t], rtol=1e-4, atol=1e-4 * np.abs(full[t]).max())


def test_verification_equals_decode_steps_across_a_block_end():
    """T = 9 rows from position 251 (block 15 completes at row 4) equal 9 one-token steps, after a
    pass whose last rows were rejected drafts (different tokens written at the same positions)."""
    cfg = nsa_config()
    params = decoder.init_params(cfg, jax.random.key(3), scale=0.08)
    start, T = 251, 9
    tokens = jnp.asarray(random_ids([start + T], cfg.vocab_size, 4).ids)
    step = step_fn(params, cfg)
    cache = init_cache(cfg, 1, 512)
    _, cache = step(cache, tokens[:, :start], jnp.arange(start, dtype=jnp.int32)[None])
    # A rejected verification: rows 251..259 with other tokens, then only 251 and 252 committed.
    wrong = (tokens[:, start : start + T] + 7) % cfg.vocab_size
    _, rejected = step(cache, wrong, start + jnp.arange(T, dtype=jnp.int32)[None])
    _, rejected = step(rejected, tokens[:, start : start + 2], start + jnp.arange(2, dtype=jnp.int32)[None])
    pos = start + jnp.arange(T, dtype=jnp.int32)[None]
    verified, after = step(rejected, tokens[:, start + 2 :][:, : T - 2], pos[:, 2:])

    single = cache
    for t in range(T):
        logits, single = step(single, tokens[:, start + t : start + t + 1], pos[:, t : t + 1])
        if t >= 2:
            np.testing.assert_allclose(np.asarray(verified[t - 2]), np.asarray(logits[0]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(after.k_cmp), np.asarray(single.k_cmp), rtol=1e-5, atol=1e-6)


# By default 5 drafts for vegas (selection from NSA's block scores), quest and ngram; the rest with
# the slow tests (the default run's 20 minutes: the drafters' paths on a dense target are test_engine's)
@pytest.mark.parametrize("method, gamma", [
    pytest.param(m, g, id=f"{m}-{g}", marks=[] if g == 5 and m in ("vegas", "quest", "ngram") else [pytest.mark.slow])
    for m in SPEC_METHODS for g in (1, 5)])
def test_greedy_lossless_nsa(nsa_case, method, gamma):
    out, stats = nsa_case.run(SpecConfig(method=method, gamma=gamma, min_tokens=32))
    assert out == nsa_case.plain
    assert stats.iterations.sum() > 0


@pytest.mark.parametrize("method, weights, skip", [("vegas", "int4", ()), ("full", "int8", (1,))])
def test_draft_models_lossless_nsa(nsa_case, method, weights, skip):
    """Draft models (quantized copies, a skipped layer) on an NSA target: the NSA gate columns are
    quantized with q/k/v, and the output stays the model's."""
    spec = SpecConfig(method=method, gamma=4, min_tokens=32, draft_weights=weights, draft_skip=skip).validate()
    params = draft_weights.with_draft_weights(nsa_case.params, weights, skip)
    out, stats = nsa_case.run(spec.check_model(nsa_case.cfg), params=params)
    assert out == nsa_case.plain and stats.accepted.sum() > 0


@pytest.mark.parametrize("reduce_rows", [True, False])
def test_collected_scores_are_block_weights(reduce_rows):
    """Score drafters on NSA read the verify rows' compressed block weights, per slot: the block's
    weight (mean over query heads) for complete visible blocks, 1 for the own unfinished block's
    slots up to the row, nothing (-inf after the reduction) past the row."""
    rng = np.random.default_rng(int(reduce_rows))
    B, T, Hkv, G, bs, NB = 2, 5, 2, 3, 16, 8
    weights = jnp.asarray(rng.random((B, T, Hkv, NB)), jnp.float32)
    q_pos = jnp.asarray([[37, 38, 39, 40, 41], [47, 48, 49, 50, 51]], jnp.int32)
    collect = kernels.Collect(rows=(0, 4), metric="weight", reduce_rows=reduce_rows)
    got = np.asarray(nsa.collected_scores(weights, q_pos, collect, G, NB * bs))
    expected = np.zeros((B, 2, NB * bs))
    for b in range(B):
        for r, t in enumerate(collect.rows):
            p = int(q_pos[b, t])
            for j in range(p + 1):
                c = j // bs
                complete = (c + 1) * bs - 1 <= p
                expected[b, r, j] = float(weights[b, t, :, c].mean()) / G if complete else 1.0
    if reduce_rows:
        expected = expected.mean(axis=1)
        expected[np.arange(NB * bs)[None, :] > np.asarray(q_pos[:, :1])] = -np.inf
    else:
        expected[np.arange(NB * bs)[None, None, :] > np.asarray(q_pos[:, [0, 4]])[..., None]] = -np.inf
    np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.slow  # the default run's 20 minutes: test_engine's batched rows run by default
def test_batched_rows_equal_rows_alone(nsa_case):
    assert_rows_alone_equal_batched(nsa_case)


@pytest.mark.slow  # 30 s; bench/gpu_checks.py runs the same check on the GPU with the real checkpoint
def test_real_nsa_smollm2_teacher_forced_bf16():
    """The real-weights NSA model (SmolLM2 + the shipped fitted gates) in bf16 over 1,500 tokens of
    real text (94 blocks, 16 selected): each token plain and vegas emit is the argmax of a full forward.
    (On random NSA weights the block weights are nearly flat, and bf16 rounding flips selections.)"""
    from jaxspec import corpus
    from jaxspec.loaders import load_model
    from jaxspec.models import nsa_convert
    from jaxspec.runner import encode_prompts
    from jaxspec.training import nsa_gates

    dense_cfg, dense_params, tokenizer = load_model("smollm2", "bfloat16")
    g_proj, _ = nsa_gates.load_gates(nsa_gates.SHIPPED_GATES)
    cfg, params = nsa_convert.to_nsa(dense_cfg, dense_params, nsa_convert.DEFAULT_NSA, g_proj)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    batch = encode_prompts(tokenizer, [corpus.long_prompt(tokenizer, 1500, task="continue", offset=3)], chat=True)
    max_len = int(batch.lengths[0]) + 24
    cache = prefilled(params, cfg, batch, max_len)
    for spec in (SpecConfig(), SpecConfig(method="vegas", gamma=4, min_tokens=64)):
        out, _ = generate(params, cfg, batch, cache, spec, max_len, 24)
        full = np.concatenate([batch.ids[0, : batch.lengths[0]], out[0]])
        logits = np.asarray(decoder.score(params, cfg, jnp.asarray(full[None])), np.float32)[0]
        predicted = logits[batch.lengths[0] - 1 : -1]
        top = predicted.max(-1)
        chosen = predicted[np.arange(len(out[0])), out[0]]
        assert np.all(chosen >= top - 0.05 * np.maximum(1.0, np.abs(top)))
        assert np.mean(chosen == top) >= 0.9



@pytest.mark.parametrize("method,tree,order", [  # vegas's by default; the rest slow (the default run's 20 minutes)
    ("vegas", (3, 2, 1), "bfs"), pytest.param("last_accepted", (2, 2, 2), "dfs", marks=pytest.mark.slow),
    pytest.param("stream", (2, 1, 2), "bfs", marks=pytest.mark.slow), pytest.param("ngram", (3, 1), "dfs", marks=pytest.mark.slow),
])
def test_tree_greedy_lossless_nsa(nsa_case, method, tree, order):
    """Draft trees on an NSA target: every row verified as its own path (compressed view, selection,
    window), the accepted path moved into place with its compressed blocks; greedy equals plain."""
    out, stats = nsa_case.run(SpecConfig(method=method, tree=tree, traversal=order, min_tokens=32).validate())
    assert out == nsa_case.plain
    assert stats.accepted.sum() > 0


def test_moved_slots_refresh_their_blocks_through_a_scattered_table():
    """KVCache.move under a shuffled page table (rows' pages anywhere in the pool): every layer's keys
    and values at the destination slots equal the source's, and the compressed entry of each block the
    destination touches is the mean of that block's slots as the rows see them (a draft tree's accepted
    path moving into place on an NSA model)."""
    cfg = nsa_config()
    B, length, bs = 2, 512, cfg.nsa.block_size
    cache = init_cache(cfg, B, length)
    order = np.random.default_rng(7).permutation(np.asarray(cache.pages).ravel())
    keys = jax.random.split(jax.random.key(8), 4)
    pools = [jax.random.normal(k, x.shape, jnp.float32) for k, x in zip(keys, (cache.k, cache.v, cache.k_cmp, cache.v_cmp))]
    cache = dataclasses.replace(cache, k=pools[0], v=pools[1], k_cmp=pools[2], v_cmp=pools[3],
                                pages=jnp.asarray(order.reshape(cache.pages.shape), jnp.int32))
    src = jnp.asarray([[300, 303, 306], [140, 141, 149]], jnp.int32)
    dst = jnp.asarray([[298, 299, 300], [139, 140, 141]], jnp.int32)
    before = [paging.logical_view(x, cache.pages, cache.page_size) for x in (cache.k, cache.v)]
    moved = cache.move(src, dst)
    rows = jnp.arange(B)[:, None]
    for old, new in zip(before, (paging.logical_view(x, moved.pages, moved.page_size) for x in (moved.k, moved.v))):
        np.testing.assert_array_equal(np.asarray(new[:, rows, :, dst]), np.asarray(old[:, rows, :, src]))
    k = paging.logical_view(moved.k, moved.pages, moved.page_size)  # [L, B, Hkv, S, Dh]
    k_cmp = paging.logical_view(moved.k_cmp, moved.pages, moved.page_size // bs)  # [L, B, Hkv, S / bs, Dh]
    for b in range(B):
        for block in {int(s) // bs for s in dst[b]}:
            want = k[:, b, :, block * bs : (block + 1) * bs].mean(axis=2)
            np.testing.assert_allclose(np.asarray(k_cmp[:, b, :, block]), np.asarray(want), rtol=1e-5, atol=1e-6)
