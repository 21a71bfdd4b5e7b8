"""Continuous batching in the engine (`engine.admit`, `engine.release`, row sampling rules): a request
admitted into a freed slot of a running batch, mid-flight, produces exactly the tokens it produces
alone (greedy rows and sampled rows with their own seeds and rules), for every method, a chain and a
tree; the rows already running are not disturbed; a released row stops changing."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import engine
from jaxspec.decoding.sampling import RowSampling, SamplingConfig
from jaxspec.decoding.spec import METHODS, SpecConfig
from jaxspec.models import decoder
from jaxspec.models.config import ModelConfig

CFG = ModelConfig(
    model_type="qwen3", vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, intermediate_size=128, qk_norm=True, dtype="float32",
)
MAX_LEN = 320
STOP_WIDTH = 2
GREEDY = SamplingConfig()
HOT = SamplingConfig(temperature=0.9, top_p=0.9, top_k=20)


@pytest.fixture(scope="module")
def params():
    return decoder.init_params(CFG, jax.random.key(5), scale=0.1)


def prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, n).astype(np.int32)


@functools.lru_cache(maxsize=None)
def compiled(spec: SpecConfig):
    """(admit, decode, release) jitted for `spec`, row rules (sampling None)."""
    static = dict(cfg=CFG, spec=spec, sampling=None, max_len=MAX_LEN)
    admit = jax.jit(functools.partial(engine.admit, **static), donate_argnums=1)
    decode = jax.jit(functools.partial(engine.decode, **static), donate_argnums=1)
    return admit, decode, jax.jit(engine.release, donate_argnums=0)


@functools.partial(jax.jit, static_argnums=(1, 2))
def empty_state(params, spec: SpecConfig, slots: int):
    """A state of `slots` free rows (every row done), as a server starts."""
    state = engine.prefill(
        params, jnp.zeros((slots, 1), jnp.int32), jnp.ones((slots,), jnp.int32), jax.random.key(0), cfg=CFG, spec=spec,
        sampling=None, max_len=MAX_LEN, max_new_tokens=jnp.ones((slots,), jnp.int32),
        stop_ids=-jnp.ones((slots, STOP_WIDTH), jnp.int32), row_sampling=RowSampling.of([GREEDY] * slots, max_top_k=32),
    )
    return engine.release(state, jnp.ones((slots,), bool))


class Request:
    def __init__(self, seed: int, n: int, max_new: int, rules: SamplingConfig):
        self.ids, self.max_new, self.rules, self.seed = prompt(seed, n), max_new, rules, seed


def admit(params, spec, state, slot: int, r: Request):
    admit_fn = compiled(spec)[0]
    return admit_fn(
        params, state, jnp.asarray([slot]), jnp.asarray(r.ids[None]), jnp.asarray([len(r.ids)]),
        jax.random.key(r.seed)[None], jnp.asarray([r.max_new]), -jnp.ones((1, STOP_WIDTH), jnp.int32),
        RowSampling.of([r.rules], max_top_k=32),
    )


def generated(state, slot: int) -> list[int]:
    tokens, length, prompt_len = jax.device_get((state.tokens[slot], state.length[slot], state.prompt_len[slot]))
    return tokens[prompt_len:length].tolist()


def alone(params, spec, r: Request) -> list[int]:
    state = admit(params, spec, empty_state(params, spec, 1), 0, r)
    return generated(compiled(spec)[1](params, state), 0)


# all_rows, last_accepted and stream share vegas's and quest's paths here: with the slow tests
SLOW = ("all_rows", "last_accepted", "stream")
SPECS = [pytest.param(SpecConfig(method=m, gamma=3, min_tokens=32), marks=[pytest.mark.slow] if m in SLOW else [], id=m)
         for m in METHODS] + [pytest.param(SpecConfig(method="vegas", tree=(2, 2), traversal="dfs", min_tokens=32), id="vegas_tree")]


@pytest.mark.parametrize("spec", SPECS)
def test_admitted_mid_flight_equals_alone(params, spec):
    spec = spec.validate()
    _, decode, release = compiled(spec)
    a, b = Request(1, 150, 40, GREEDY), Request(2, 60, 30, HOT)
    c, d = Request(3, 90, 24, GREEDY), Request(4, 200, 20, HOT)
    state = empty_state(params, spec, 3)
    state = admit(params, spec, state, 0, a)
    state = admit(params, spec, state, 1, b)
    state = decode(params, state, max_iterations=jnp.int32(3))
    a_part = generated(state, 0)
    state = release(state, jnp.asarray([True, False, False]))  # a is cancelled mid-flight
    state = decode(params, state, max_iterations=jnp.int32(1))
    assert generated(state, 0) == a_part  # a released row stops changing
    state = admit(params, spec, state, 0, c)  # c takes a's slot while b runs
    state = decode(params, state, max_iterations=jnp.int32(2))
    state = admit(params, spec, state, 2, d)  # d takes the slot that was never used
    state = decode(params, state, max_iterations=jnp.int32(1 << 30))
    assert bool(jax.device_get(state.done).all())
    for slot, r in ((1, b), (0, c), (2, d)):
        out = generated(state, slot)
        assert len(out) == r.max_new
        assert out == alone(params, spec, r), (slot, spec.method)
    assert a_part == alone(params, spec, a)[: len(a_part)]
    stats = jax.device_get(state.stats)
    if spec.method != "plain":
        assert stats.drafted[0] > 0 and stats.iterations[0] < c.max_new  # c's own stats, from zero
