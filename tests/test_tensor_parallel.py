"""Tensor parallelism (`models.sharding`, `--tp`) on simulated CPU devices (conftest sets 4): every
method, draft trees, draft models, NSA targets, mixture-of-experts models and the serving scheduler
produce the same greedy tokens over 2 and 4 devices as on one; each device holds only its shard of
the weights and the KV cache (no replicated full matrices); a `--tp` that does not divide the heads
is a one-line error.

Random float32 models (a Qwen3 with 8 query / 4 KV heads, an NSA-Llama with 8 / 2, a Qwen3-MoE with
8 / 4 and a gpt-oss with 8 / 2, its experts also in MXFP4 and also split whole across devices:
test_moe_model's and test_gpt_oss's with fewer layers) and SmolLM2 (9 / 3 heads: it divides only by 3) with a real-text prompt.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import corpus, generate as generate_cli, loaders
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.spec import SpecConfig
from jaxspec.errors import JaxspecError
from jaxspec.models import decoder, eagle, sharding
from jaxspec.models.config import ModelConfig, NSAConfig
from jaxspec.models.quantize import Quantized
from jaxspec.runner import Batch, encode_prompts, run_generation
from jaxspec.serving.requests import Request
from jaxspec.serving.scheduler import Scheduler
from test_gpt_oss import CFG as GPT_OSS_CFG
from pallas_kernels.mxfp4 import MXFP4, dequantize
from test_moe_model import CFG as QWEN3_MOE_CFG

QWEN3 = ModelConfig(model_type="qwen3", vocab_size=128, hidden_size=64, num_layers=3, num_heads=8, num_kv_heads=4,
                    head_dim=16, intermediate_size=128, qk_norm=True, dtype="float32", max_position_embeddings=512)
NSA = ModelConfig(model_type="llama-nsa", vocab_size=256, hidden_size=128, num_layers=2, num_heads=8, num_kv_heads=2,
                  head_dim=32, intermediate_size=256, max_position_embeddings=1024, dtype="float32",
                  nsa=NSAConfig(block_size=16, block_counts=4, window_size=32))
QWEN3_MOE = QWEN3_MOE_CFG.replace(num_layers=2, num_kv_heads=4)  # experts of 64 columns: 16 a device at tp 4
GPT_OSS = GPT_OSS_CFG.replace(num_layers=2, sliding_layers=(0,))  # a window of 16 keys, then a full layer
GREEDY = SamplingConfig()
slow = pytest.mark.slow


def devices_needed(tp: int):
    if len(jax.devices()) < tp:
        pytest.skip(f"needs {tp} devices (conftest asks XLA for 4 simulated CPU devices)")


def random_batch(cfg: ModelConfig, lengths, seed: int) -> Batch:
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), max(lengths)), np.int32)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(0, cfg.vocab_size, n)
    return Batch(ids, np.asarray(lengths, np.int32))


@dataclasses.dataclass
class Model:
    cfg: ModelConfig
    params: dict
    batch: Batch
    max_new: int
    outputs: dict = dataclasses.field(default_factory=dict)  # (spec, tp, sampling) -> generated tokens

    def generate(self, spec: SpecConfig, tp: int, sampling: SamplingConfig = GREEDY) -> list[list[int]]:
        """The batch's tokens with `spec` over `tp` devices (weights split by shard_params)."""
        key = (spec, tp, sampling)
        if key not in self.outputs:
            mesh = sharding.make_mesh(tp) if tp > 1 else None
            params = self.params if mesh is None else sharding.shard_params(self.params, self.cfg, mesh)
            params = generate_cli.with_draft_model(params, spec.draft_weights, spec.draft_skip, mesh,
                                                   self.cfg.expert_parallel)
            max_len = int(self.batch.lengths.max()) + self.max_new
            run = run_generation(params, self.cfg, self.batch, spec=spec, sampling=sampling, max_len=max_len,
                                 max_new_tokens=self.max_new, stop_ids=(), seed=3, mesh=mesh)
            self.outputs[key] = [g.tolist() for g in run.generated()]
        return self.outputs[key]


@pytest.fixture(scope="module")
def qwen3():
    params = decoder.init_params(QWEN3, jax.random.key(11), scale=0.3)
    return Model(QWEN3, params, random_batch(QWEN3, [90, 61, 140], seed=4), max_new=24)


@pytest.fixture(scope="module")
def nsa_model():
    params = decoder.init_params(NSA, jax.random.key(12), scale=0.08)
    return Model(NSA, params, random_batch(NSA, [300, 70], seed=5), max_new=24)


@pytest.fixture(scope="module")
def qwen3_moe():
    params = decoder.init_params(QWEN3_MOE, jax.random.key(13), scale=0.08)
    return Model(QWEN3_MOE, params, random_batch(QWEN3_MOE, [90, 37], seed=6), max_new=16)


@pytest.fixture(scope="module")
def gpt_oss():
    params = decoder.init_params(GPT_OSS, jax.random.key(14), scale=0.08)
    return Model(GPT_OSS, params, random_batch(GPT_OSS, [70, 29], seed=7), max_new=16)


def packed_experts(params: dict, seed: int) -> dict:
    """params with the expert stacks replaced by random MXFP4 ones (gpt-oss's released form): codes and
    scales of 2^-9..2^-6, weights of the fixture's size."""
    rng = np.random.default_rng(seed)
    layers = dict(params["layers"])
    for name in ("moe_gate_up", "moe_down"):
        *lead, K, N = layers[name].shape
        layers[name] = MXFP4(jnp.asarray(rng.integers(0, 256, (*lead, N, K // 2), dtype=np.uint8)),
                             jnp.asarray(rng.integers(118, 122, (*lead, N, K // 32), dtype=np.uint8)))
    return {**params, "layers": layers}


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(gpt_oss):
    return Model(GPT_OSS, packed_experts(gpt_oss.params, seed=8), gpt_oss.batch, max_new=16)


@pytest.fixture(scope="module")
def smollm2(smollm2_loaded):
    cfg, params, tokenizer = smollm2_loaded
    batch = encode_prompts(tokenizer, [corpus.long_prompt(tokenizer, 600, task="continue", offset=5)], chat=True)
    return Model(cfg, params, batch, max_new=32)


def spec(method: str, **kw) -> SpecConfig:
    return SpecConfig(method=method, gamma=kw.pop("gamma", 4), ratio=0.3, min_tokens=16, ngram_min=1, ngram_max=2,
                      **kw).validate()


# stream's and ngram's chains run with the slow tests: what they draft from (positions, token ids) does
# not see the sharding, and their trees run there at 4 devices. By default: a tree and a draft model at
# 2 devices, vegas at 4 (vegas at 2: sampled, below, the same tokens a seed); the rest slow (the default run's 20 minutes)
QWEN3_CASES = [
    pytest.param(2, spec("vegas"), marks=slow), pytest.param(2, spec("plain"), marks=slow),
    pytest.param(2, spec("quest"), marks=slow),
    pytest.param(2, spec("vegas", tree=(3, 2), traversal="dfs"), marks=slow),
    pytest.param(2, spec("vegas", draft_weights="int8"), marks=slow),
    (2, spec("full", tree=(3, (2, 0, 1)), draft_weights="int4", draft_skip=(1,))), (4, spec("vegas")),  # per-node tree
    pytest.param(2, spec("stream"), marks=slow), pytest.param(2, spec("ngram"), marks=slow),
    pytest.param(2, spec("all_rows"), marks=slow), pytest.param(2, spec("last_accepted", tree=(2, 2)), marks=slow),
    pytest.param(4, spec("quest", tree=(2, 1)), marks=slow),
    pytest.param(4, spec("full", draft_weights="int4"), marks=slow),
    pytest.param(4, spec("stream", tree=(2, 2), draft_weights="int8"), marks=slow),
    pytest.param(4, spec("ngram", tree=(2, 2)), marks=slow),
    pytest.param(4, spec("all_rows", draft_skip=(2,)), marks=slow),
]


@pytest.mark.parametrize("tp, spec_", QWEN3_CASES)
def test_qwen3_greedy_tokens_equal_one_device(qwen3, tp, spec_):
    devices_needed(tp)
    one = qwen3.generate(spec_, 1)
    assert one == qwen3.generate(SpecConfig(), 1)  # lossless on one device, so the comparison below means TP is
    assert qwen3.generate(spec_, tp) == one


def test_eagle_heads_greedy_tokens_and_shared_lm_head_logits_equal_one_device(qwen3):
    """EAGLE-3 heads (whole on each device): a tree with a head that shares the target's LM head (its
    vocabulary split over the devices, the logits gathered) emits one device's tokens, and its draft
    logits equal one device's; a chain with a head of its own LM head too."""
    from test_eagle_engine import head_config

    devices_needed(2)
    layers = (0, 1, 2)
    shared, own = head_config(QWEN3, 0, layers, shared=True), head_config(QWEN3, 96, layers)
    heads = {cfg: eagle.init_params(jax.random.key(i), cfg, jnp.float32, 0.1) for i, cfg in enumerate((shared, own))}
    for ecfg, shape in ((shared, dict(tree=(2, 2))), (own, dict(gamma=3))):
        model = Model(QWEN3, {**qwen3.params, "eagle": heads[ecfg]}, qwen3.batch, qwen3.max_new)
        one = model.generate(spec("eagle", eagle=ecfg, **shape), 1)
        assert one == qwen3.generate(SpecConfig(), 1)
        assert model.generate(spec("eagle", eagle=ecfg, **shape), 2) == one
    params = {**qwen3.params, "eagle": heads[shared]}
    mesh = sharding.make_mesh(2)
    h = jax.random.normal(jax.random.key(5), (2, 3, QWEN3.hidden_size))
    logits = lambda cfg: lambda params, h: eagle.draft_logits(params["eagle"], shared, params, cfg, h)
    two = sharding.Parallel(logits, QWEN3, mesh)(sharding.shard_params(params, QWEN3, mesh), h)
    assert two.shape == (2, 3, QWEN3.vocab_size)
    np.testing.assert_allclose(two, logits(QWEN3)(params, h), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("spec_", [
    spec("vegas"), pytest.param(spec("plain"), marks=slow), pytest.param(spec("quest"), marks=slow),
    pytest.param(spec("stream", tree=(2, 2)), marks=slow), pytest.param(spec("full", draft_weights="int8"), marks=slow),
])
def test_nsa_greedy_tokens_equal_one_device(nsa_model, spec_):
    devices_needed(2)
    assert nsa_model.generate(spec_, 2) == nsa_model.generate(spec_, 1)


# vegas at 4 devices, plain at 2 by default; vegas at 2 and plain at 4 with the slow tests
@pytest.mark.parametrize("tp, spec_", [(2, spec("plain")), pytest.param(2, spec("vegas"), marks=slow),
                                       (4, spec("vegas")), pytest.param(4, spec("plain"), marks=slow)])
def test_qwen3_moe_greedy_tokens_equal_one_device(qwen3_moe, tp, spec_):
    """Every expert's columns split over the devices, the router replicated."""
    devices_needed(tp)
    assert qwen3_moe.generate(spec_, tp) == qwen3_moe.generate(spec_, 1)


@pytest.mark.parametrize("spec_", [spec("plain"), spec("vegas")])
def test_gpt_oss_greedy_tokens_equal_one_device(gpt_oss, spec_):
    """gpt-oss's sinks split by query head, its expert biases with the experts' columns, its down and
    o biases added once; prompts past the sliding window."""
    devices_needed(2)
    assert gpt_oss.generate(spec_, 2) == gpt_oss.generate(spec_, 1)


@pytest.mark.parametrize("spec_", [spec("plain"), pytest.param(spec("vegas"), marks=slow)])
def test_gpt_oss_mxfp4_greedy_tokens_equal_one_device(gpt_oss_mxfp4, spec_):
    """The released MXFP4 experts split as the float ones (each device its columns of every expert),
    kept packed: the kernel decodes each device's share."""
    devices_needed(2)
    assert gpt_oss_mxfp4.generate(spec_, 2) == gpt_oss_mxfp4.generate(spec_, 1)


@pytest.mark.parametrize("spec_", [pytest.param(spec("vegas", gamma=6), marks=slow), pytest.param(spec("plain"), marks=slow),
                                   pytest.param(spec("quest", tree=(2, 2)), marks=slow),
                                   pytest.param(spec("full", draft_weights="int8"), marks=slow)])
def test_smollm2_greedy_tokens_equal_one_device(smollm2, spec_):
    """SmolLM2's 9 query / 3 KV heads split over 3 devices (2 and 4 do not divide them)."""
    devices_needed(3)
    assert smollm2.generate(spec_, 3) == smollm2.generate(spec_, 1)


def test_sampled_tokens_equal_one_device(qwen3):
    """Same seeds, same draws: the split model's logits equal the whole model's within float32 rounding."""
    devices_needed(2)
    hot = SamplingConfig(temperature=0.8, top_p=0.9)
    assert qwen3.generate(spec("vegas"), 2, hot) == qwen3.generate(spec("vegas"), 1, hot)


def test_device_watch_equals_one_device(qwen3, monkeypatch):
    """A static batch settled on plain watches ngram on the device (`programs.watched` under the
    mesh); every window crosses (thresholds of one token an iteration) and the host switches to ngram
    and back (scripted): the tokens equal plain decoding's on one device."""
    from jaxspec import planner
    from jaxspec.planner import refine
    from jaxspec.planner.strategy import Prediction, Strategy

    devices_needed(2)
    plain, ngram = Strategy(), Strategy("ngram", gamma=4)
    decisions = iter([ngram, plain])
    monkeypatch.setattr(refine, "WATCH", 4)
    monkeypatch.setattr(refine.Refinement, "thresholds", lambda self, floor: {s: 1.0 for s in self.replayed})
    monkeypatch.setattr(refine, "decide", lambda candidates, observations, current, **_: (
        next(decisions, None) or current, "scripted"))
    plan = planner.Plan((Prediction(plain, 100.0, 1.0, 0.02), Prediction(ngram, 100.0, 2.0, 0.04)), plain, "table:t", 1024)
    mesh = sharding.make_mesh(2)
    run = run_generation(sharding.shard_params(qwen3.params, qwen3.cfg, mesh), qwen3.cfg, qwen3.batch, spec=SpecConfig(),
                         sampling=GREEDY, max_len=int(qwen3.batch.lengths.max()) + qwen3.max_new,
                         max_new_tokens=qwen3.max_new, stop_ids=(), seed=3, mesh=mesh, plan=plan)
    assert [g.tolist() for g in run.generated()] == qwen3.generate(SpecConfig(), 1)
    assert [(s["from"], s["to"]) for s in run.auto.switches] == [("plain", "ngram g4"), ("ngram g4", "plain")]


def test_every_device_holds_only_its_shard(qwen3):
    """Weights, quantized draft copies and the KV cache: each device's block has the designed shape;
    only norms are replicated. The fused q/k/v columns of device s are its own heads' (TP layout)."""
    devices_needed(2)
    cfg, tp = QWEN3, 2
    mesh = sharding.make_mesh(tp)
    params = generate_cli.with_draft_model(sharding.shard_params(qwen3.params, cfg, mesh), "int8", (), mesh)
    L, D, F, V, Dh = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_heads * Dh // tp, cfg.num_kv_heads * Dh // tp
    expected = {
        "embed": (V // tp, D), "final_norm": (D,), "lm_head": (D, V // tp),
        "layers": {"attn_norm": (L, D), "mlp_norm": (L, D), "q_norm": (L, Dh), "k_norm": (L, Dh),
                   "wqkv": (L, D, q + 2 * kv), "wo": (L, q, D), "w_gate_up": (L, D, 2 * F // tp), "w_down": (L, F // tp, D)},
        "draft_layers": {"wqkv": Quantized((L, D, q + 2 * kv), (L, q + 2 * kv)), "wo": Quantized((L, q, D), (L, D)),
                         "w_gate_up": Quantized((L, D, 2 * F // tp), (L, 2 * F // tp)),
                         "w_down": Quantized((L, F // tp, D), (L, D))},
        "draft_head": Quantized((D, V // tp), (V // tp,)),
    }
    assert jax.tree.map(lambda a: a.sharding.shard_shape(a.shape), params) == expected
    replicated = [jax.tree_util.keystr(p) for p, a in jax.tree_util.tree_leaves_with_path(params)
                  if a.sharding.is_fully_replicated]
    assert all("norm" in name or name.endswith(".scale") for name in replicated), replicated

    # device 0's fused block: query heads 0..3, KV heads 0..1 (k then v); device 1's: the others
    standard = np.asarray(qwen3.params["layers"]["wqkv"])
    Q, K = cfg.num_heads * Dh, cfg.num_kv_heads * Dh
    for s, block in enumerate(sorted(params["layers"]["wqkv"].addressable_shards, key=lambda b: b.index[2].start)):
        want = np.concatenate([standard[..., s * q:(s + 1) * q], standard[..., Q + s * kv:Q + (s + 1) * kv],
                               standard[..., Q + K + s * kv:Q + K + (s + 1) * kv]], axis=-1)
        np.testing.assert_array_equal(np.asarray(block.data), want)

    scheduler = Scheduler(params, cfg, None, spec("vegas"), slots=2, max_len=200, stop_ids=(), sampling=GREEDY, mesh=mesh)
    scheduler.submit(Request(tuple(range(1, 40)), 4), lambda delta: None)
    scheduler.admit_waiting()
    cache = scheduler.state.cache
    pool = (L, cfg.num_kv_heads // tp, cache.num_pages * cache.page_size, Dh)  # the pool's KV heads split
    assert cache.k.sharding.shard_shape(cache.k.shape) == pool


def test_moe_device_holds_only_its_shard(gpt_oss):
    """gpt-oss's leaves: each device holds 1/tp of every expert (its [gate_s | up_s] columns of each,
    in the TP layout, and their down rows) and of the sinks; only the norms, the router and the
    biases added once (o, the experts' down) are replicated."""
    devices_needed(2)
    cfg, tp = GPT_OSS, 2
    params = sharding.shard_params(gpt_oss.params, cfg, sharding.make_mesh(tp))
    L, D, Hq, E, F = cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.moe.num_experts, cfg.moe.expert_size
    layers = {name: a.sharding.shard_shape(a.shape) for name, a in params["layers"].items()}
    assert {name: layers[name] for name in ("sinks", "moe_gate_up", "moe_gate_up_bias", "moe_down")} == {
        "sinks": (L, Hq // tp), "moe_gate_up": (L, E, D, 2 * F // tp), "moe_gate_up_bias": (L, E, 2 * F // tp),
        "moe_down": (L, E, F // tp, D)}
    replicated = {jax.tree_util.keystr(p) for p, a in jax.tree_util.tree_leaves_with_path(params)
                  if a.sharding.is_fully_replicated}
    assert replicated == {"['final_norm']"} | {f"['layers']['{name}']" for name in (
        "attn_norm", "mlp_norm", "router", "router_bias", "bo", "moe_down_bias")}
    standard = np.asarray(gpt_oss.params["layers"]["moe_gate_up"])
    f = F // tp
    blocks = sorted(params["layers"]["moe_gate_up"].addressable_shards, key=lambda b: b.index[3].start)
    for s, block in enumerate(blocks):
        want = np.concatenate([standard[..., s * f:(s + 1) * f], standard[..., F + s * f:F + (s + 1) * f]], axis=-1)
        np.testing.assert_array_equal(np.asarray(block.data), want)


@pytest.mark.parametrize("packed, spec_", [(True, spec("plain")), (False, spec("vegas")),
                                            pytest.param(True, spec("vegas", tree=(2, 1)), marks=slow)])
def test_expert_parallel_greedy_tokens_equal_one_device(gpt_oss, gpt_oss_mxfp4, packed, spec_):
    """Whole experts split across devices (`ModelConfig.expert_parallel`, forced here at tp 2): each
    device computes its experts' share of every row, biases included, and the all-reduce sums them."""
    devices_needed(2)
    model = gpt_oss_mxfp4 if packed else gpt_oss
    experts = Model(model.cfg.replace(expert_parallel=True), model.params, model.batch, model.max_new)
    assert experts.generate(spec_, 2) == model.generate(spec_, 1)


def test_expert_parallel_device_holds_only_its_experts(gpt_oss_mxfp4):
    """Split by experts, a device holds E / tp whole experts (bytes and scales, biases), in order; the
    split is chosen only where columns would cut a scale group."""
    devices_needed(2)
    cfg, tp = GPT_OSS.replace(expert_parallel=True), 2
    params = sharding.shard_params(gpt_oss_mxfp4.params, cfg, sharding.make_mesh(tp))
    L, D, E, F = cfg.num_layers, cfg.hidden_size, cfg.moe.num_experts, cfg.moe.expert_size
    shard = lambda w: jax.tree.map(lambda a: a.sharding.shard_shape(a.shape), w)
    assert shard(params["layers"]["moe_gate_up"]) == MXFP4((L, E // tp, 2 * F, D // 2), (L, E // tp, 2 * F, D // 32))
    assert shard(params["layers"]["moe_down_bias"]) == (L, E // tp, D)
    whole = np.asarray(gpt_oss_mxfp4.params["layers"]["moe_down"].scales)
    parts = sorted(params["layers"]["moe_down"].scales.addressable_shards, key=lambda b: b.index[1].start)
    for s, block in enumerate(parts):
        np.testing.assert_array_equal(np.asarray(block.data), whole[:, s * E // tp:(s + 1) * E // tp])
    assert [sharding.splits_experts(GPT_OSS, packed, tp) for packed, tp in ((True, 4), (True, 2), (False, 4))] == [
        True, False, False]  # 64 columns over 4 devices: 16, not whole 32-value groups


def test_loaders_split_whole_experts_when_chosen(hf_checkpoints, tmp_path, monkeypatch):
    """`load_model` over a mesh asks `splits_experts` (here made to say yes) and loads an HF checkpoint
    and its orbax conversion with whole experts on each device, the config saying so."""
    devices_needed(2)
    from jaxspec.convert import convert
    from jaxspec.loaders import load_model

    monkeypatch.setattr(sharding, "splits_experts", lambda cfg, packed, tp: True)
    convert(str(hf_checkpoints["gpt_oss"]), tmp_path / "ckpt", "float32")
    for source in (str(hf_checkpoints["gpt_oss"]), str(tmp_path / "ckpt")):
        cfg, params, _ = load_model(source, "float32", mesh=sharding.make_mesh(2))
        E = cfg.moe.num_experts
        assert cfg.expert_parallel, source
        for name in ("moe_gate_up", "moe_down", "moe_down_bias"):
            leaf = params["layers"][name]
            assert leaf.sharding.shard_shape(leaf.shape)[1] == E // 2, f"{source}: {name} not split by experts"


def test_mxfp4_device_holds_only_its_shard(gpt_oss_mxfp4):
    """Each device holds its columns of every packed expert (the TP layout's [gate_s | up_s], as
    bytes and scales) and its rows of the down matrices (whole scale groups); a --tp that would split a
    scale group is a one-line error."""
    devices_needed(4)
    cfg, tp = GPT_OSS, 2
    params = sharding.shard_params(gpt_oss_mxfp4.params, cfg, sharding.make_mesh(tp))
    L, D, E, F = cfg.num_layers, cfg.hidden_size, cfg.moe.num_experts, cfg.moe.expert_size
    shard = lambda w: jax.tree.map(lambda a: a.sharding.shard_shape(a.shape), w)
    assert shard(params["layers"]["moe_gate_up"]) == MXFP4((L, E, 2 * F // tp, D // 2), (L, E, 2 * F // tp, D // 32))
    assert shard(params["layers"]["moe_down"]) == MXFP4((L, E, D, F // (2 * tp)), (L, E, D, F // (32 * tp)))
    standard, f = gpt_oss_mxfp4.params["layers"]["moe_gate_up"], F // tp
    for leaf in ("blocks", "scales"):
        whole = np.asarray(getattr(standard, leaf))
        parts = sorted(getattr(params["layers"]["moe_gate_up"], leaf).addressable_shards, key=lambda b: b.index[2].start)
        for s, block in enumerate(parts):
            want = np.concatenate([whole[:, :, s * f:(s + 1) * f], whole[:, :, F + s * f:F + (s + 1) * f]], axis=2)
            np.testing.assert_array_equal(np.asarray(block.data), want)
    for name in ("moe_gate_up", "moe_down"):  # re-packed as words on load, each device its own share (scales 118-121)
        words, shapes = loaders._as_words(params["layers"][name]), shard(params["layers"][name])
        assert words.words and words.small_scales
        scales = shapes.scales if name == "moe_down" else (*shapes.scales[:-1], -(-shapes.scales[-1] // 4))
        assert shard(words) == MXFP4((*shapes.blocks[:-1], shapes.blocks[-1] // 4), scales, small_scales=True)
        assert words.scales.dtype == (jnp.uint8 if name == "moe_down" else jnp.uint32)  # whole rows: scale words
        assert words.blocks.sharding == params["layers"][name].blocks.sharding
        np.testing.assert_array_equal(np.asarray(dequantize(words)), np.asarray(dequantize(params["layers"][name])))
    with pytest.raises(JaxspecError, match="--tp 4: MXFP4 experts split by 32-value scale groups, and 64 expert columns give 16"):
        sharding.shard_params(gpt_oss_mxfp4.params, cfg, sharding.make_mesh(4))


@pytest.mark.slow  # 35 s; the sharded engine's tokens are checked by default above (the default run's 20 minutes)
def test_scheduler_admissions_equal_one_device(qwen3):
    """The server's path: requests admitted one at a time into running slots over a shared page pool
    (split by KV heads), a long one prefilled in chunks, rows released and reused, the state shrunk to
    one row at the end; every request's tokens equal the one-device scheduler's."""
    devices_needed(2)
    requests = [Request(tuple(int(t) for t in qwen3.batch.ids[b, :n]), 12 + 3 * b, GREEDY, seed=b)
                for b, n in enumerate(qwen3.batch.lengths)]
    requests += [Request(tuple(range(3 + i, 50 + i)), 9 + 15 * i, GREEDY, seed=7 + i) for i in range(3)]

    def serve(tp: int) -> list[tuple[int, ...]]:
        mesh = sharding.make_mesh(tp) if tp > 1 else None
        params = qwen3.params if mesh is None else sharding.shard_params(qwen3.params, QWEN3, mesh)
        scheduler = Scheduler(params, QWEN3, None, spec("vegas", tree=(2, 1)), slots=4, max_len=256, stop_ids=(),
                              segment=2, admit_rows=1, prefill_chunk=64, mesh=mesh, shrink=True, kv_pages=12,
                              page_size=64)  # a shared pool of half the rows' pages, as serve runs
        tokens = {i: [] for i in range(len(requests))}
        for i, r in enumerate(requests):
            scheduler.submit(r, lambda delta, i=i: tokens[i].extend(delta.token_ids))
        while scheduler._waiting or scheduler._running or scheduler._staged:
            scheduler.step()
        assert scheduler.rows == 1
        return [tuple(tokens[i]) for i in range(len(requests))]

    one = serve(1)
    assert all(len(t) == r.max_new_tokens for t, r in zip(one, requests))
    assert serve(2) == one

@pytest.mark.parametrize("tp, message", [
    (2, "--tp 2 does not divide the model's 9 attention heads"),
    (64, f"--tp 64 needs 64 devices; this machine has {len(jax.devices())}"),
    (0, "--tp must be at least 1, got 0"),
])
def test_bad_tp_is_a_one_line_error(smollm2_gguf, capsys, tp, message):
    devices_needed(2)
    with pytest.raises(SystemExit) as exit_:
        generate_cli.main(["--model", str(smollm2_gguf), "--tp", str(tp), "--max-new-tokens", "2"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {message}"
