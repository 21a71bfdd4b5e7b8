"""The verifier's contract on a chain of drafts (speculative sampling: Leviathan et al. 2023, Chen et
al. 2023): every emitted token follows the target's processed p, whatever the drafter's q.

The engine accepts every draft shape with `tree.tree_accept`; a chain is the tree (1, ..., 1), and these
tests pin down its speculative-sampling behaviour (acceptance rate, recovered and bonus tokens).
Sampling tests draw N rows at once with fixed seeds and run chi-square / binomial tests at p-value
1e-3. Target distributions are given as logits log p at temperature 1, so process_logits gives back p.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from jaxspec.decoding.sampling import SamplingConfig, process_logits, sample
from jaxspec.decoding.tree import TreeShape, tree_accept
from test_sampling import assert_follows

V = 8
N = 200_000
UNIT = SamplingConfig(temperature=1.0)


def rejection_sample(key, drafts, draft_probs, target_logits, cfg):
    """tree_accept on the chain of drafts [B, γ] drawn from draft_probs [B, γ, V] (None: one-hot):
    (num_accepted [B], emitted tokens [B, γ + 1])."""
    B, gamma = drafts.shape
    tokens = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), drafts], axis=1)
    if draft_probs is not None:  # row r holds the distribution its child, draft r + 1, was drawn from
        draft_probs = jnp.pad(draft_probs, ((0, 0), (0, 1), (0, 0)))
    num_accepted, _, emitted = tree_accept(key, TreeShape.chain(gamma), tokens, draft_probs, target_logits, cfg)
    return num_accepted, emitted


def distribution(rng, zeros=()):
    p = rng.random(V) + 0.05
    p[list(zeros)] = 0.0
    return p / p.sum()


def one_hot(token):
    return np.eye(V)[token]


def verify(seed, ps, qs, pass_probs=True):
    """Drafts drawn from qs[i] (NumPy), targets log ps[i]; returns NumPy (num_accepted, tokens)."""
    rng = np.random.default_rng(seed)
    drafts = np.stack([rng.choice(V, size=N, p=q) for q in qs], axis=1).astype(np.int32)
    with np.errstate(divide="ignore"):
        target = jnp.broadcast_to(jnp.asarray(np.log(np.stack(ps)), jnp.float32), (N, len(ps), V))
    draft_probs = None
    if pass_probs:
        draft_probs = jnp.broadcast_to(jnp.asarray(np.stack(qs), jnp.float32), (N, len(qs), V))
    num_accepted, tokens = rejection_sample(jax.random.key(seed), jnp.asarray(drafts), draft_probs, target, UNIT)
    assert num_accepted.shape == (N,) and tokens.shape == (N, len(ps))
    assert num_accepted.dtype == jnp.int32 and tokens.dtype == jnp.int32
    return np.asarray(num_accepted), np.asarray(tokens)


def cases():
    """(name, ps [3], qs [2], pass_probs): γ = 2 verified positions plus the bonus."""
    rng = np.random.default_rng(0)
    p, q = [distribution(rng) for _ in range(3)], [distribution(rng) for _ in range(2)]
    yield "dense", p, q, True
    yield "q_zero_where_p_has_mass", p, [distribution(rng, zeros=(0, 1, 2)), q[1]], True
    yield "p_zero_where_q_has_mass", [distribution(rng, zeros=(3, 4)), p[1], p[2]], q, True
    yield "q_equals_p", p, p[:2], True
    yield "one_hot_fixed_draft", p, [one_hot(3), one_hot(5)], False
    yield "one_hot_random_drafts", p, q, False  # each row's q is one-hot at its own draft


@pytest.mark.parametrize("name, ps, qs, pass_probs", list(cases()), ids=[c[0] for c in cases()])
def test_first_emitted_token_follows_p0(name, ps, qs, pass_probs):
    num_accepted, tokens = verify(10, ps, qs, pass_probs)
    assert_follows(tokens[:, 0], ps[0])
    if name == "q_equals_p":
        assert np.all(num_accepted == 2)


def test_acceptance_rate_and_accepted_tokens():
    ps, qs = next(cases())[1:3]
    num_accepted, tokens = verify(11, ps, qs)
    for i in range(2):  # position i is reached iff drafts before it were accepted
        reached = num_accepted >= i
        accepted = num_accepted[reached] > i
        rate = np.minimum(ps[i], qs[i]).sum()
        assert scipy.stats.binomtest(int(accepted.sum()), int(reached.sum()), rate).pvalue > 1e-3
        # an accepted draft follows min(p, q) / sum min(p, q)
        assert_follows(tokens[reached][accepted, i], np.minimum(ps[i], qs[i]))


def test_bonus_token_follows_last_p():
    ps, qs = next(cases())[1:3]
    num_accepted, tokens = verify(12, ps, qs)
    assert_follows(tokens[num_accepted == 2, 2], ps[2])
    num_accepted, tokens = verify(13, ps, ps[:2])  # q = p: every row reaches the bonus
    assert np.all(num_accepted == 2)
    assert_follows(tokens[:, 2], ps[2])


def test_first_two_emitted_tokens_are_independent_draws_from_p0_and_p1():
    """With prefix-independent p's, decoding must emit iid tokens from p_0, p_1, ... A row that stops
    after one token gets its second from the next iteration, which drafts from q_1 and verifies
    against p_1, p_2; here that iteration runs for every row and is used where it is needed."""
    rng = np.random.default_rng(1)
    ps, qs = [distribution(rng) for _ in range(4)], [distribution(rng) for _ in range(3)]
    num_accepted, tokens = verify(14, ps[:3], qs[:2])
    _, next_tokens = verify(15, ps[1:], qs[1:])
    second = np.where(num_accepted >= 1, tokens[:, 1], next_tokens[:, 0])
    assert_follows(tokens[:, 0] * V + second, np.outer(ps[0], ps[1]).ravel())


def test_filtered_draft_and_target_on_both_sides():
    """The drafter samples with cfg through `sample`; the target's bf16 logits get the same processing."""
    cfg = SamplingConfig(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05)
    rng = np.random.default_rng(2)
    draft_logits = jnp.broadcast_to(jnp.asarray(2 * rng.normal(size=(2, V)), jnp.float32), (N, 2, V))
    target_logits = jnp.broadcast_to(jnp.asarray(2 * rng.normal(size=(3, V)), jnp.bfloat16), (N, 3, V))
    drafts, q = sample(jax.random.key(16), draft_logits, cfg)
    _, tokens = rejection_sample(jax.random.key(17), drafts, q, target_logits, cfg)
    p = np.asarray(process_logits(target_logits[0], cfg), np.float64)
    assert np.any((q[0, 0] == 0) & (p[0] > 0)) and np.any((p[0] == 0) & (q[0, 0] > 0))
    assert_follows(tokens[:, 0], p[0])


def test_same_key_same_result():
    rng = np.random.default_rng(3)
    drafts = jnp.asarray(rng.integers(0, V, size=(64, 3)), jnp.int32)
    target = jnp.asarray(rng.normal(size=(64, 4, V)), jnp.float32)
    a = rejection_sample(jax.random.key(0), drafts, None, target, UNIT)
    b = rejection_sample(jax.random.key(0), drafts, None, target, UNIT)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_greedy_by_hand(dtype):
    argmax = np.array([[2, 0, 5, 1]] * 3 + [[1, 2, 3, 4]])
    target = np.random.default_rng(4).normal(size=(4, 4, 6))
    np.put_along_axis(target, argmax[..., None], 5.0, axis=-1)
    target[3, 0, 4] = target[3, 1, 5] = 5.0  # ties: the first index is the argmax
    drafts = np.array(
        [
            [2, 0, 5],  # all accepted: bonus 1
            [2, 3, 5],  # mismatch at 1: emit 0 there
            [4, 0, 5],  # mismatch at 0: emit 2
            [1, 5, 3],  # tie at 0 on the first index (accepted), tie at 1 on the second (rejected)
        ],
        np.int32,
    )
    cfg = SamplingConfig(top_k=2, top_p=0.5, min_p=0.1)  # filters keep the argmax: greedy is unchanged
    for draft_probs in (None, jax.nn.one_hot(drafts, 6)):
        num_accepted, tokens = rejection_sample(
            jax.random.key(0), jnp.asarray(drafts), draft_probs, jnp.asarray(target, dtype), cfg
        )
        np.testing.assert_array_equal(num_accepted, [3, 1, 0, 1])
        for row, n in enumerate([3, 1, 0, 1]):
            np.testing.assert_array_equal(tokens[row, : n + 1], argmax[row, : n + 1])
