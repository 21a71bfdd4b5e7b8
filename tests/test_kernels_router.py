"""moe_route (pallas_kernels/router.py): the router's choice kernel in interpret mode and its jnp reference
against NumPy in float64 from the rules' formulas, on fresh random logits and on logits full of ties (which
go to the lower expert id, as lax.top_k breaks them). Interpret mode fills unwritten outputs with NaN, so
a slot the kernel forgot shows."""
import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels.router import route_pallas, route_reference

RULES = [("softmax_topk", True), ("softmax_topk", False), ("topk_softmax", False)]


def choice_float64(logits: np.ndarray, k: int, rule: str, norm: bool):
    """(ids, weights) from the formulas: a stable sort of the negated logits puts ties in id order."""
    x = logits.astype(np.float64)
    ids = np.argsort(-x, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(x, ids, axis=-1)
    if rule == "topk_softmax":
        e = np.exp(top - top[:, :1])
        return ids, e / e.sum(-1, keepdims=True)
    p = np.exp(x - x.max(-1, keepdims=True))
    weights = np.take_along_axis(p / p.sum(-1, keepdims=True), ids, axis=-1)
    return ids, weights / weights.sum(-1, keepdims=True) if norm else weights


@pytest.mark.parametrize("rule,norm", RULES)
@pytest.mark.parametrize("E,k", [(32, 4), (128, 8), (60, 6), (8, 1)])
@pytest.mark.parametrize("ties", [False, True])
def test_route_equals_float64(rule, norm, E, k, ties):
    rng = np.random.default_rng([E, k, ties, RULES.index((rule, norm))])
    N = 5
    logits = (rng.integers(-3, 4, (N, E)) if ties else rng.standard_normal((N, E)) * 3).astype(np.float32)
    want_ids, want_weights = choice_float64(logits, k, rule, norm)
    for route in (route_reference, lambda *a: route_pallas(*a, interpret=True)):
        ids, weights = route(jnp.asarray(logits), k, rule, norm)
        np.testing.assert_array_equal(np.asarray(ids), want_ids)
        np.testing.assert_allclose(np.asarray(weights), want_weights, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rule,norm", RULES)
def test_route_adds_the_bias_at_its_layer(rule, norm):
    """A router's bias stack [L, E], read at the layer: every other layer's entry poisoned."""
    rng = np.random.default_rng([7, RULES.index((rule, norm))])
    E, k, layer = 32, 4, 2
    logits = (rng.standard_normal((5, E)) * 3).astype(np.float32)
    bias = np.full((4, E), 1e30, np.float32)
    bias[layer] = rng.standard_normal(E) * 2
    want_ids, want_weights = choice_float64(logits + bias[layer], k, rule, norm)
    for route in (route_reference, lambda *a: route_pallas(*a, interpret=True)):
        ids, weights = route(jnp.asarray(logits), k, rule, norm, jnp.asarray(bias), jnp.int32(layer))
        np.testing.assert_array_equal(np.asarray(ids), want_ids)
        np.testing.assert_allclose(np.asarray(weights), want_weights, rtol=1e-5, atol=1e-7)


def test_route_checks_its_arguments():
    logits = jnp.ones((2, 16), jnp.float32)
    with pytest.raises(ValueError, match="unknown MoE router"):
        route_pallas(logits, 2, "topk", False, interpret=True)
    with pytest.raises(ValueError, match="k <= E"):
        route_pallas(logits, 17, "topk_softmax", False, interpret=True)
