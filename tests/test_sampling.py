"""Logits processing against a float64 NumPy reference written from the documented rules, and `sample`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from jaxspec.errors import JaxspecError
from jaxspec.decoding.sampling import RowSampling, SamplingConfig, process_logits, sample


def softmax_over(x, keep):
    e = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    return e / e.sum()


def reference_probs(logits, cfg):
    """One row at a time: temperature, top-k, top-p, min-p; ties with the last kept token are kept."""
    logits = np.asarray(logits, np.float64)
    out = np.zeros_like(logits)
    for idx in np.ndindex(logits.shape[:-1]):
        x = logits[idx] / cfg.temperature
        keep = np.ones(x.shape, bool)
        if cfg.top_k:
            keep &= x >= np.sort(x)[-min(cfg.top_k, x.size)]
        if cfg.top_p < 1:
            p = softmax_over(x, keep)
            order = np.argsort(-p, kind="stable")
            mass_before = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
            keep &= x >= x[order[mass_before < cfg.top_p][-1]]
        if cfg.min_p > 0:
            p = softmax_over(x, keep)
            keep &= p >= cfg.min_p * p.max()
        out[idx] = softmax_over(x, keep)
    return out


def assert_matches_reference(logits, cfg, backend="reference"):
    got = np.asarray(process_logits(jnp.asarray(logits), cfg, backend))
    want = reference_probs(np.asarray(jnp.asarray(logits), np.float32), cfg)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-5)


CONFIGS = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.6),
    SamplingConfig(temperature=1.7, top_k=7),
    SamplingConfig(temperature=1.0, top_k=1),
    SamplingConfig(temperature=1.0, top_k=1000),  # k >= V: off
    SamplingConfig(temperature=1.0, top_p=0.8),
    SamplingConfig(temperature=0.5, top_p=0.37),
    SamplingConfig(temperature=1.3, min_p=0.1),
    SamplingConfig(temperature=0.8, top_k=40, top_p=0.9),
    SamplingConfig(temperature=1.2, top_k=40, min_p=0.02),
    SamplingConfig(temperature=2.0, top_p=0.6, min_p=0.05),
    SamplingConfig(temperature=0.9, top_k=25, top_p=0.75, min_p=0.03),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_process_logits_matches_reference(cfg):
    logits = 2.5 * np.random.default_rng(0).normal(size=(3, 4, 257)).astype(np.float32)  # leading dims
    assert_matches_reference(logits, cfg)


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_ties_keep_every_token_tied_with_the_last_kept(cfg):
    logits = np.random.default_rng(1).integers(-4, 3, size=(16, 64)).astype(np.float32)
    assert_matches_reference(logits, cfg)


NUCLEUS = [c for c in CONFIGS if c.top_p < 1 and not c.top_k]  # the sort-free search's configs


@pytest.mark.parametrize("cfg", NUCLEUS, ids=str)
def test_pallas_backend_matches_reference(cfg):
    """The nucleus kernel (interpret mode) inside process_logits, on normal and on tied logits."""
    rng = np.random.default_rng(5)
    assert_matches_reference(2.5 * rng.normal(size=(2, 3, 257)).astype(np.float32), cfg, "pallas")
    assert_matches_reference(rng.integers(-4, 3, size=(6, 64)).astype(np.float32), cfg, "pallas")


def test_tie_rule_by_hand():
    logits = jnp.array([[2.0, 0.0, 2.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    top_k = process_logits(logits, SamplingConfig(temperature=1.0, top_k=1))
    np.testing.assert_allclose(top_k[0], [0.5, 0, 0.5, 0])
    # top-p 0.3 would stop after one of four equal tokens; the tie keeps all of them
    top_p = process_logits(logits, SamplingConfig(temperature=1.0, top_p=0.3))
    np.testing.assert_allclose(top_p[1], [0.25] * 4)


def test_bfloat16_logits():
    logits = jnp.asarray(3 * np.random.default_rng(2).normal(size=(5, 1000)), jnp.bfloat16)
    assert_matches_reference(logits, SamplingConfig(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01))
    assert_matches_reference(logits, SamplingConfig(temperature=0.7, top_p=0.9))


def test_greedy_takes_the_first_argmax_of_the_raw_logits():
    logits = jnp.array([[0.0, 3.0, 1.0, 3.0], [5.0, -1.0, 5.0, 2.0]])
    cfg = SamplingConfig(top_k=2, top_p=0.5)  # filters never change the argmax
    tokens, probs = sample(jax.random.key(0), logits, cfg)
    assert probs is None and tokens.dtype == jnp.int32
    np.testing.assert_array_equal(tokens, [1, 0])
    np.testing.assert_array_equal(process_logits(logits, cfg), [[0, 1, 0, 0], [1, 0, 0, 0]])


def test_same_key_same_tokens_different_key_different_tokens():
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(2000, 50)), jnp.float32)
    cfg = SamplingConfig(temperature=1.0, top_k=20)
    a, probs = sample(jax.random.key(7), logits, cfg)
    b, _ = sample(jax.random.key(7), logits, cfg)
    c, _ = sample(jax.random.key(8), logits, cfg)
    np.testing.assert_array_equal(a, b)
    assert np.mean(np.asarray(a) != np.asarray(c)) > 0.5
    np.testing.assert_array_equal(probs, process_logits(logits, cfg))


def assert_follows(tokens, probs, threshold=1e-3):
    """Chi-square goodness of fit of the tokens to probs; tokens outside the support fail outright."""
    counts = np.bincount(np.asarray(tokens).ravel(), minlength=len(probs))
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support] / probs[support].sum() * counts.sum()
    assert scipy.stats.chisquare(counts[support], expected).pvalue > threshold


def test_sample_follows_process_logits():
    row = np.random.default_rng(4).normal(size=12).astype(np.float32)
    cfg = SamplingConfig(temperature=0.8, top_k=9, top_p=0.97, min_p=0.01)
    tokens, probs = sample(jax.random.key(5), jnp.broadcast_to(row, (200_000, 12)), cfg)
    expected = np.asarray(probs[0], np.float64)
    assert 0 < np.sum(expected == 0) < 9  # some tokens filtered
    assert_follows(tokens, expected)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(temperature=float("inf")),
        dict(temperature=float("nan")),
        dict(top_k=-1),
        dict(top_k=2.5),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(min_p=1.0),
        dict(min_p=-0.1),
    ],
    ids=str,
)
def test_invalid_config_is_rejected(kwargs):
    with pytest.raises(JaxspecError, match=next(iter(kwargs))):
        SamplingConfig(**kwargs)


def test_config_is_hashable_and_greedy_flag():
    assert SamplingConfig().greedy and not SamplingConfig(temperature=0.5).greedy
    assert hash(SamplingConfig(temperature=0.5, top_k=3)) == hash(SamplingConfig(temperature=0.5, top_k=3))


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_row_rules_give_each_row_its_own_config(backend):
    """A batch whose rows follow different configs (a server's): each row's probabilities are those
    of its own config (the float64 reference), a greedy row's the one-hot of its argmax; positions
    after the row axis share the row's rules."""
    configs = [c for c in CONFIGS if c.top_k <= 64] + [SamplingConfig()]  # top_k 1000 > max_top_k: next test
    logits = 2.5 * np.random.default_rng(8).normal(size=(len(configs), 3, 257)).astype(np.float32)
    got = np.asarray(process_logits(jnp.asarray(logits), RowSampling.of(configs, max_top_k=64), backend))
    for row, cfg in enumerate(configs):
        if cfg.greedy:
            np.testing.assert_array_equal(got[row], np.eye(257)[logits[row].argmax(-1)])
            continue
        want = reference_probs(logits[row], cfg)
        np.testing.assert_array_equal(got[row] > 0, want > 0, err_msg=str(cfg))
        np.testing.assert_allclose(got[row], want, rtol=2e-5, atol=1e-7, err_msg=str(cfg))


def test_row_rules_top_k_bound():
    with pytest.raises(JaxspecError, match="top_k 1000 is above this server's maximum of 64"):
        RowSampling.of([SamplingConfig(temperature=1.0, top_k=1000)], max_top_k=64)
    wide = RowSampling.of([SamplingConfig(temperature=1.0, top_k=7)], max_top_k=1000)  # above V: every candidate
    logits = np.random.default_rng(9).normal(size=(1, 300)).astype(np.float32)
    np.testing.assert_allclose(process_logits(jnp.asarray(logits), wide), reference_probs(logits, SamplingConfig(temperature=1.0, top_k=7)),
                               rtol=2e-5, atol=1e-7)


def test_without_top_p_keeps_the_other_rules_and_runs_no_search(monkeypatch):
    """`without_top_p` (eagle's draft rules): each row's probabilities are its config's with top-p 1
    (temperature, top-k and min-p kept; greedy rows one-hot), and row rules then run no nucleus search."""
    import pallas_kernels
    from jaxspec.decoding.sampling import without_top_p

    configs = [c for c in CONFIGS if c.top_k <= 64] + [SamplingConfig()]
    logits = 2.5 * np.random.default_rng(11).normal(size=(len(configs), 2, 257)).astype(np.float32)
    monkeypatch.setattr(pallas_kernels, "top_p_threshold", lambda *a, **k: pytest.fail("a nucleus search ran"))
    got = np.asarray(process_logits(jnp.asarray(logits), without_top_p(RowSampling.of(configs, max_top_k=64))))
    for row, cfg in enumerate(configs):
        want = np.eye(257)[logits[row].argmax(-1)] if cfg.greedy else reference_probs(
            logits[row], SamplingConfig(temperature=cfg.temperature, top_k=cfg.top_k, min_p=cfg.min_p))
        np.testing.assert_array_equal(got[row] > 0, want > 0, err_msg=str(cfg))
        np.testing.assert_allclose(got[row], want, rtol=2e-5, atol=1e-7, err_msg=str(cfg))
    config = SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)
    assert without_top_p(config) == SamplingConfig(temperature=0.7, top_k=5)


def test_row_keys_make_rows_independent_of_their_neighbours():
    """With one key per row, a row's draw depends on its own key and logits only."""
    logits = jnp.asarray(np.random.default_rng(10).normal(size=(64, 50)), jnp.float32)
    cfg = SamplingConfig(temperature=1.0)
    keys = jax.random.split(jax.random.key(1), 64)
    a, _ = sample(keys, logits, cfg)
    b, _ = sample(keys[::-1], logits[::-1], cfg)
    c, _ = sample(keys[:5], logits[:5], cfg)
    np.testing.assert_array_equal(a, np.asarray(b)[::-1])
    np.testing.assert_array_equal(a[:5], c)
