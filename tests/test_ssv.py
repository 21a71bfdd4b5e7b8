"""SSV on NSA targets: reuse layers take exactly the nearest earlier refresh
layer's selection, the greedy calibration and its saved schedule, precision classes (validation,
reporting), and the engine under each class: strict is lossless for every group size, the
approximate classes run and are reported as such."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as kernels
from jaxspec.decoding.spec import PRECISIONS, SpecConfig
from jaxspec.errors import JaxspecError
from jaxspec.models import decoder, nsa, nsa_reuse
from jaxspec.models.config import ModelConfig, NSAConfig
from jaxspec.loaders.hf import hf_config
from jaxspec.decoding import engine
from test_nsa_engine import nsa_config, random_ids


@pytest.fixture(scope="module")
def model():
    cfg = nsa_config()
    return cfg, decoder.init_params(cfg, jax.random.key(31), scale=0.08)


def filled_cache(params, cfg, length: int, seed: int):
    ids = random_ids([length], cfg.vocab_size, seed)
    return engine.prefill_cache(params, jnp.asarray(ids.ids), jnp.asarray(ids.lengths), cfg=cfg, max_len=length + 64)


def test_reuse_layer_takes_the_nearest_refresh_layers_selection(model):
    cfg, params = model
    nsa_cfg = cfg.nsa
    cache = filled_cache(params, cfg, 500, seed=3)
    B, T = 1, 2
    q_pos = jnp.asarray([[498, 499]], jnp.int32)
    keys = jax.random.split(jax.random.key(7), 4)
    qs = [jax.random.normal(k, (B, T, cfg.num_heads, cfg.head_dim), jnp.float32) for k in keys[:3]]
    gates = jax.nn.sigmoid(jax.random.normal(keys[3], (B, T, cfg.num_heads, 3)))
    # jitted, the layer traced: one compile for the three layers (eagerly, every op compiles on its own)
    attend = jax.jit(nsa.attend_fn(cfg, q_pos, "reference", refresh=jnp.asarray([True, False, True])))
    own_selection = jax.jit(lambda layer, q: kernels.nsa_compressed_attention(
        q, cache.k_cmp, cache.v_cmp, cache.pages, layer, q_pos, page_size=cache.page_size, block_size=nsa_cfg.block_size, block_counts=nsa_cfg.block_counts,
        rule=nsa_cfg.topk_rule, scale=cfg.head_dim**-0.5))
    carry = nsa.initial_carry(cfg, q_pos, cache.num_slots, reuse=True)
    selections = []
    for layer, q in enumerate(qs):
        out, _, carry = attend(jnp.int32(layer), q, cache, None, gates, carry)
        selections.append((out, carry, own_selection(jnp.int32(layer), q)))
    (_, carry0, own0), (out1, carry1, own1), (_, carry2, own2) = selections
    np.testing.assert_array_equal(carry0[0], own0[2])  # layer 0 refreshes
    np.testing.assert_array_equal(carry1[0], carry0[0])  # layer 1 reuses layer 0's blocks...
    np.testing.assert_array_equal(carry1[1], carry0[1])
    assert not np.array_equal(own1[2], own0[2])  # ...which are not its own
    expected = jax.jit(lambda q, idx, o_cmp: kernels.nsa_selected_attention(
        q, cache.k, cache.v, cache.pages, 1, q_pos, idx, o_cmp, gates, page_size=cache.page_size,
        block_size=nsa_cfg.block_size, window=nsa_cfg.window_size, scale=cfg.head_dim**-0.5))(qs[1], carry0[0], jnp.zeros_like(qs[1]))
    np.testing.assert_array_equal(out1, expected)  # with layer 0's blocks and no compressed branch
    np.testing.assert_array_equal(carry2[0], own2[2])  # layer 2 refreshes again


def test_all_refresh_schedule_is_the_model(model):
    cfg, params = model
    tokens = jnp.asarray(random_ids([300], cfg.vocab_size, 4).ids)
    # jitted, the schedule traced: one compile for both schedules
    schedule_logits = jax.jit(nsa_reuse.schedule_logits, static_argnums=1)
    everything = schedule_logits(params, cfg, tokens, jnp.ones(cfg.num_layers, bool))
    np.testing.assert_allclose(everything, jax.jit(decoder.score, static_argnums=1)(params, cfg, tokens),
                               rtol=1e-5, atol=1e-5)
    reused = schedule_logits(params, cfg, tokens, jnp.asarray([True, False, False]))
    assert np.abs(np.asarray(reused - everything)).max() > 1e-3


def test_calibration_bounds_and_saved_schedule(model):
    cfg, params = model
    tokens = random_ids([200, 200], cfg.vocab_size, 5).ids
    loose, report = nsa_reuse.calibrate(params, cfg, tokens, kl_bound=np.inf, log=lambda _: None)
    assert loose == (0,) and report["reuse_layers"] == cfg.num_layers - 1
    strict, report = nsa_reuse.calibrate(params, cfg, tokens, kl_bound=0.0, log=lambda _: None)
    assert strict == tuple(range(cfg.num_layers)) and all(t["kl"] > 0 for t in report["trials"])
    # a bound between the trials' KLs keeps exactly the layers under it (greedy, in layer order)
    first_kl = report["trials"][0]["kl"]
    middle, report = nsa_reuse.calibrate(params, cfg, tokens, kl_bound=first_kl * 1.0001, log=lambda _: None)
    assert 1 not in middle and report["kl"] <= first_kl * 1.0001
    # the schedule travels in config.json
    saved = cfg.replace(model_type="llama-nsa", nsa=NSAConfig(16, 4, 32, "nsa1b", refresh_layers=middle))
    hf = hf_config(saved)
    assert hf["nsa_refresh_layers"] == list(middle)
    assert ModelConfig.from_hf(hf, dtype="float32").nsa.refresh_layers == middle
    np.testing.assert_array_equal(saved.nsa.reuse_source(3), [max(i for i in middle if i <= l) for l in range(3)])


def test_bad_schedules_and_precisions_are_one_line_errors(model):
    cfg, _ = model
    with pytest.raises(JaxspecError, match="nsa_refresh_layers"):
        NSAConfig(16, 4, 32, refresh_layers=(1, 2))
    with pytest.raises(JaxspecError, match="--precision"):
        SpecConfig(method="vegas", precision="fast").validate()
    with pytest.raises(JaxspecError, match="--group"):
        SpecConfig(method="vegas", group=-1).validate()
    dense = cfg.replace(model_type="llama", nsa=None)
    with pytest.raises(JaxspecError, match="needs an NSA model"):
        SpecConfig(method="vegas", precision="approx").validate().check_model(dense)
    with pytest.raises(JaxspecError, match="calibrated refresh/reuse schedule"):
        SpecConfig(method="vegas", precision="reuse").validate().check_model(cfg)
    SpecConfig(method="vegas", precision="approx").validate().check_model(cfg)


def test_precision_classes_are_reported():
    for precision in PRECISIONS:
        described = SpecConfig(method="vegas", precision=precision).validate().describe()
        assert described["precision"] == precision
        assert described["lossless"] == (precision == "strict")


@pytest.fixture(scope="module")
def ssv_case():
    from test_engine import Case

    cfg = nsa_config().replace(nsa=NSAConfig(16, 4, 32, "nsa1b", refresh_layers=(0, 2)))
    params = decoder.init_params(cfg, jax.random.key(5), scale=0.08)
    return Case(cfg, params, random_ids([600, 300], cfg.vocab_size, 13), max_new=24)


@pytest.mark.parametrize("group,tree,order", [  # a group of 16 with the slow tests (the default run's 20 minutes)
    (1, (3, 2, 1), "bfs"), (4, (2, 2, 2), "dfs"), (2, None, "bfs"),
    pytest.param(16, None, "bfs", marks=pytest.mark.slow)])
def test_strict_groups_are_lossless(ssv_case, group, tree, order):
    """Exact merged groups of any size verify exactly: greedy output equals plain decoding (a chain in
    groups of one row runs the decode step's attention, `nsa.attend_fn`; in larger groups the tree's)."""
    spec = SpecConfig(method="vegas", gamma=5, tree=tree, traversal=order, group=group, min_tokens=32).validate()
    out, stats = ssv_case.run(spec.check_model(ssv_case.cfg))
    assert out == ssv_case.plain
    assert stats.accepted.sum() > 0


def test_reuse_changes_the_model(ssv_case):
    """reuse changes the target's attention (opt-in): plain decoding under it (a cheaper model)
    differs from the model's own output."""
    reuse_plain, _ = ssv_case.run(SpecConfig(precision="reuse").validate().check_model(ssv_case.cfg))
    assert reuse_plain != ssv_case.plain


def verified_logits(case, spec: SpecConfig) -> np.ndarray:
    """The target's logits at every row of one verification of `spec`'s tree (random draft tokens)
    on the case's prompts, under `spec`'s precision class."""
    from test_engine import GREEDY
    from jaxspec.runner import decode_fns

    spec = spec.validate().check_model(case.cfg)
    start, _ = decode_fns(case.cfg, spec, GREEDY, case.max_len)
    state = start(case.params, jax.tree.map(jnp.copy, case.cache), jnp.asarray(case.batch.ids),
                  jnp.asarray(case.batch.lengths), jax.random.key(0), spec.budget(),
                  max_new_tokens=jnp.int32(case.max_new), stop_ids=jnp.asarray([-1], jnp.int32))
    tokens = jax.random.randint(jax.random.key(8), (len(case.batch.lengths), spec.shape.rows), 0, case.cfg.vocab_size)
    verify = jax.jit(engine.verify, static_argnums=(1, 2, 3, 6))
    return np.asarray(verify(case.params, case.cfg, spec, None, state, tokens, spec.shape)[0])


# both approximations in one run by default; approx alone with the slow tests (the default run's 20 minutes)
@pytest.mark.parametrize("precision", ["approx+reuse", pytest.param("approx", marks=pytest.mark.slow)])
def test_approximate_classes_run_end_to_end(ssv_case, precision):
    """An approximate class is no silent no-op: a group sharing one row's blocks verifies the same
    tree rows to other logits than the class without it (approx: strict; approx+reuse: reuse), and
    the run decodes to the end."""
    spec = SpecConfig(method="vegas", tree=(3, 2, 1), precision=precision, group=8, min_tokens=32)
    exact_groups = dataclasses.replace(spec, precision={"approx": "strict", "approx+reuse": "reuse"}[precision])
    exact = verified_logits(ssv_case, exact_groups)
    approx = verified_logits(ssv_case, spec)
    assert np.abs(approx - exact).max() > 1e-3 * np.abs(exact).max()
    out, stats = ssv_case.run(spec.validate().check_model(ssv_case.cfg))
    assert [len(o) for o in out] == [len(o) for o in ssv_case.plain] and stats.iterations.sum() > 0
