"""NSA-Llama models (docs/architecture.md, "NSA and SSV") against a PyTorch reference built on fla's naive NSA oracles.

The reference (`TorchNSA`) runs the checkpoint's Llama layers with transformers' own modules in float64
(embeddings, norms, rotate-half RoPE, MLP, head) and NSA attention from `fla.ops.nsa.naive`:
`naive_nsa_compression` (compressed branch and its lse), `naive_nsa_selection` (selected branch given
block indices; fla computes both in float32), with the importance weights, the top-S selection (both
rules, `reference_selection`) and the sliding window written out here from the formulas. Tests:
each jaxspec branch (`nsa_compressed_reference`, `select_blocks`, `nsa_selected_reference`) against the
oracles on random inputs; whole-model logits and 32 greedy tokens of the `nsa_checkpoints` fixtures
(prompts of 300-600 tokens, where selection drops most blocks); one-line errors for bad NSA configs
and weights; and a `jaxspec.convert` round trip.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.errors import JaxspecError
from jaxspec.loaders import load_model
from jaxspec.models.decoder import score
from jaxspec.runner import Batch
from jaxspec.decoding.spec import SpecConfig
from pallas_kernels.nsa_compressed import nsa_compressed_reference, select_blocks
from pallas_kernels.nsa_selected import nsa_selected_reference
from paged_pools import scatter
from test_engine import generate, prefilled

import torch  # noqa: E402  (a test dependency: a missing one fails here rather than skipping)

with warnings.catch_warnings():  # fla warns that flash-attn and triton are absent (only naive_nsa needs them)
    warnings.simplefilter("ignore")
    from fla.ops.nsa import naive

REPO = Path(__file__).resolve().parents[1]
# jitted once per shape (eager dispatch compiles op by op, several times slower here)
_compressed = jax.jit(nsa_compressed_reference, static_argnames=("page_size", "block_size", "scale"))
_selected = jax.jit(nsa_selected_reference, static_argnames=("page_size", "block_size", "window", "scale"))
PAGE = 128  # the branches read their caches as pools with the rows' pages scattered (tests/paged_pools)


def compressed_branch(q, k_cmp, v_cmp, layer, q_pos, *, block_size, scale):
    """The compressed reference over contiguous blocks [L, B, Hkv, NB, Dh], scattered into a pool first."""
    (k, v), pages = scatter([k_cmp, v_cmp], PAGE // block_size, seed=1)
    return _compressed(q, k, v, pages, layer, q_pos, page_size=PAGE, block_size=block_size, scale=scale)


def selected_branch(q, k_cache, v_cache, layer, *args, **options):
    """The selected/window reference over contiguous caches [L, B, Hkv, S, Dh], scattered into a pool first."""
    (k, v), pages = scatter([k_cache, v_cache], PAGE, seed=2)
    return _selected(q, k, v, pages, layer, *args, page_size=PAGE, **options)


select = jax.jit(select_blocks, static_argnames=("block_size", "block_counts", "rule"))
jit_score = jax.jit(score, static_argnums=(1,))
NSA_KEYS = ("block_size", "block_counts", "window_size", "nsa_topk_rule")


@contextlib.contextmanager
def one_torch_thread():
    """fla's naive oracles loop over query rows in small ops, about 25x faster on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def relative_error(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


# --- the reference ------------------------------------------------------------------------------------


def mean_pool(x: np.ndarray, block_size: int) -> np.ndarray:
    """[B, T, H, D] -> [B, T // block_size, H, D]: means of the complete blocks."""
    B, T, H, D = x.shape
    n = T // block_size
    return x[:, : n * block_size].reshape(B, n, block_size, H, D).mean(axis=2)


def importance(q: np.ndarray, k_cmp: np.ndarray, lse: np.ndarray, block_size: int, scale: float, q_pos) -> np.ndarray:
    """Compressed softmax weights exp(q.k_cmp * scale - lse) of visible blocks summed over the G query
    heads of each KV head: q [B, T, Hq, D], k_cmp [B, NB, H, D], lse [B, T, Hq] -> [B, T, H, NB]."""
    B, T, Hq, D = q.shape
    NB, H = k_cmp.shape[1], k_cmp.shape[2]
    G = Hq // H
    logits = np.einsum("bthgd,bchd->bthgc", q.reshape(B, T, H, G, D).astype(np.float64), k_cmp.astype(np.float64)) * scale
    visible = (np.arange(NB) + 1) * block_size - 1 <= np.asarray(q_pos)[:, :, None]  # [B, T, NB]
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(logits - lse.reshape(B, T, H, G, 1))
    return np.where(visible[:, :, None, None, :], p, 0.0).sum(axis=3)


def top_mask(scores: np.ndarray, k) -> np.ndarray:
    """True at the k (broadcastable) largest entries of the last axis that are not -inf."""
    order = np.argsort(-scores, axis=-1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(scores.shape[-1]), order.shape), axis=-1)
    return (rank < k) & (scores > -np.inf)


def reference_selection(weights: np.ndarray, q_pos, block_size: int, block_counts: int, rule: str) -> np.ndarray:
    """Selected blocks [B, T, H, S] (ascending, -1 padded) from importance weights [B, T, H, NB].

    The own block t // bs is forced; only blocks before it compete. exact: the S best. nsa1b (chunks
    of bs compressed blocks): the S best of (the bs/2 best blocks of the earlier chunks) + (the bs/2
    best of the query's own chunk, or all of it when it is chunk 0).
    """
    B, T, H, NB = weights.shape
    own = (np.asarray(q_pos) // block_size)[:, :, None, None]
    NC = max(NB, int(own.max()) + 1)  # the own block of a row in an incomplete last block is past NB
    w = np.concatenate([weights, np.zeros((B, T, H, NC - NB))], axis=-1)
    c = np.arange(NC)
    scores = np.where(c < own, w, np.where(c == own, np.inf, -np.inf))
    if rule == "exact":
        chosen = top_mask(scores, block_counts)
    else:
        start = own // block_size * block_size
        history = top_mask(np.where(c < start, scores, -np.inf), block_size // 2)
        current = top_mask(np.where(c >= start, scores, -np.inf), np.where(start == 0, block_size, block_size // 2))
        chosen = top_mask(np.where(history | current, scores, -np.inf), block_counts)
    assert chosen.sum(axis=-1).max() <= block_counts
    out = np.full((B, T, H, block_counts), -1, np.int64)
    for b, t, h in zip(*np.nonzero(chosen.any(axis=-1))):
        blocks = np.flatnonzero(chosen[b, t, h])
        out[b, t, h, : len(blocks)] = blocks
    return out


def normalized(idx) -> np.ndarray:
    """Block indices as ascending sets, -1 padding last."""
    idx = np.asarray(idx).astype(np.int64)
    big = np.iinfo(np.int64).max
    ordered = np.sort(np.where(idx < 0, big, idx), axis=-1)
    return np.where(ordered == big, -1, ordered)


def sliding_window(q, k, v, window: int, scale: float):
    """Softmax attention of q [B, T, Hq, D] over keys [t - window + 1, t] (torch, float64)."""
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    k, v = (x.double().repeat_interleave(G, dim=2) for x in (k, v))
    logits = torch.einsum("bthd,bshd->bhts", q.double(), k) * scale
    t, s = torch.arange(T)[:, None], torch.arange(T)[None, :]
    logits = logits.masked_fill(~((s <= t) & (s > t - window)), float("-inf"))
    return torch.einsum("bhts,bshd->bthd", logits.softmax(-1), v)


class TorchNSA:
    """The reference model of an NSA checkpoint directory (float64, full sequence from position 0)."""

    def __init__(self, path: Path):
        import transformers
        from safetensors.torch import load_file

        config = json.loads((path / "config.json").read_text())
        self.block_size, self.block_counts, self.window = (int(config.pop(k)) for k in NSA_KEYS[:3])
        self.rule = config.pop("nsa_topk_rule", "nsa1b")
        for key in ("model_type", "architectures"):
            config.pop(key)
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
        weights = {}
        for file in sorted(path.glob("*.safetensors")):
            weights.update(load_file(file))
        self.g_proj = [weights.pop(f"model.layers.{i}.self_attn.g_proj.weight").double() for i in range(config["num_hidden_layers"])]
        missing, unexpected = self.model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
        assert not unexpected and set(missing) <= ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
        self.model.double()
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config.get("head_dim") or config["hidden_size"] // self.heads

    def attention(self, q, k, v, gates, block_counts, rule):
        """NSA of post-RoPE q [B, T, Hq, D], k/v [B, T, H, D] with sigmoid gates [B, T, Hq, 3]:
        returns (o [B, T, Hq, D], selected blocks [B, T, H, S])."""
        B, T = q.shape[:2]
        bs, scale = self.block_size, self.head_dim**-0.5
        k_cmp = torch.from_numpy(mean_pool(k.numpy(), bs))
        v_cmp = torch.from_numpy(mean_pool(v.numpy(), bs))
        o_cmp, lse = naive.naive_nsa_compression(q, k_cmp, v_cmp, block_size=bs, scale=scale)
        q_pos = np.broadcast_to(np.arange(T), (B, T))
        weights = importance(q.numpy(), k_cmp.numpy(), lse.double().numpy(), bs, scale, q_pos)
        idx = reference_selection(weights, q_pos, bs, block_counts, rule)
        o_slc = naive.naive_nsa_selection(q, k, v, torch.from_numpy(idx), block_size=bs, scale=scale)
        o_swa = sliding_window(q, k, v, self.window, scale)
        g = gates[..., None]
        return g[:, :, :, 0] * o_cmp + g[:, :, :, 1] * o_slc + g[:, :, :, 2] * o_swa, idx

    @torch.no_grad()
    @one_torch_thread()
    def forward(self, tokens: np.ndarray, block_counts: int | None = None, rule: str | None = None):
        """Logits [B, T, V] float64 and the selected blocks of each layer."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        block_counts, rule = block_counts or self.block_counts, rule or self.rule
        inner = self.model.model
        ids = torch.from_numpy(np.asarray(tokens, np.int64))
        B, T = ids.shape
        x = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(x, torch.arange(T)[None].expand(B, T))
        selections = []
        for layer, w_gate in zip(inner.layers, self.g_proj):
            h = layer.input_layernorm(x)
            attn = layer.self_attn
            q = attn.q_proj(h).view(B, T, self.heads, self.head_dim)
            k = attn.k_proj(h).view(B, T, self.kv_heads, self.head_dim)
            v = attn.v_proj(h).view(B, T, self.kv_heads, self.head_dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
            gates = torch.sigmoid(h @ w_gate.T).view(B, T, self.heads, 3)
            o, idx = self.attention(q, k, v, gates, block_counts, rule)
            selections.append(idx)
            x = x + attn.o_proj(o.reshape(B, T, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(inner.norm(x)).numpy(), selections

    def argmax_after(self, prompt, tokens) -> list[int]:
        """The argmax of the logits before each of `tokens` following `prompt`, from one forward (the
        model is causal: a position's logits are its prefix's own), so `tokens` are greedy decoding's
        continuation iff they equal it (a forward per token took ~12 s at 300 tokens)."""
        logits, _ = self.forward(np.asarray([list(prompt) + list(tokens)]))
        return np.argmax(logits[0, len(prompt) - 1 : -1], axis=-1).tolist()


def random_tokens(rows: int, length: int, seed: int, vocab: int = 384) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (rows, length))


# --- branches against the oracles ---------------------------------------------------------------------


def random_branch_inputs(seed: int, T: int, Hq: int, Hkv: int, D: int = 32, bs: int = 16, B: int = 2):
    """q, k, v (float32) with scaled keys so that attention is peaked, the jaxspec caches [L=2, B, Hkv,
    slots, D] (layer 1 real, layer 0 and slots past T junk) and their compressed blocks."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, Hq, D)).astype(np.float32)
    k = (2.0 * rng.standard_normal((B, T, Hkv, D))).astype(np.float32)
    v = rng.standard_normal((B, T, Hkv, D)).astype(np.float32)
    slots = -(-T // 128) * 128
    cache = rng.standard_normal((2, 2, B, Hkv, slots, D)).astype(np.float32)
    cache[:, 1, :, :, :T] = np.stack([k, v]).transpose(0, 1, 3, 2, 4)
    k_cmp = cache[:, 1:].reshape(2, 1, B, Hkv, slots // bs, bs, D).mean(axis=5)
    k_cmp = np.concatenate([rng.standard_normal(k_cmp.shape).astype(np.float32), k_cmp], axis=1)  # [2, L, ...]
    k_cmp[:, 1, :, :, T // bs :] = rng.standard_normal(k_cmp[:, 1, :, :, T // bs :].shape)  # incomplete blocks: junk
    return q, k, v, cache, k_cmp


BRANCH_CASES = [(0, 300, 4, 2), (1, 455, 6, 2), (2, 600, 16, 1)]  # seed, T, Hq, Hkv (G = 2, 3, 16)


@pytest.mark.parametrize("seed, T, Hq, Hkv", BRANCH_CASES)
def test_compressed_branch_matches_fla(seed, T, Hq, Hkv):
    bs, D = 16, 32
    scale = D**-0.5
    q, k, v, _, cmp = random_branch_inputs(seed, T, Hq, Hkv, D, bs)
    k_cmp, v_cmp = mean_pool(k, bs), mean_pool(v, bs)
    np.testing.assert_allclose(np.moveaxis(cmp[0, 1], 1, 2)[:, : T // bs], k_cmp, rtol=1e-5, atol=1e-6)
    o_ref, lse = naive.naive_nsa_compression(torch.from_numpy(q), torch.from_numpy(k_cmp), torch.from_numpy(v_cmp), bs, scale)
    q_pos = np.broadcast_to(np.arange(T, dtype=np.int32), q.shape[:2])
    o, weights = compressed_branch(jnp.asarray(q), jnp.asarray(cmp[0]), jnp.asarray(cmp[1]), 1, jnp.asarray(q_pos), block_size=bs, scale=scale)
    np.testing.assert_allclose(np.asarray(o), o_ref.numpy(), rtol=1e-5, atol=1e-5)
    expected = importance(q, k_cmp, lse.double().numpy(), bs, scale, q_pos)
    np.testing.assert_allclose(np.asarray(weights)[..., : T // bs], expected, rtol=1e-5, atol=1e-6)
    assert not np.asarray(weights)[..., T // bs :].any()  # junk blocks past the sequence never visible
    early = np.arange(T) < bs - 1  # no complete block yet: zero output, zero weights, lse -inf
    assert np.all(np.isneginf(lse.numpy()[:, early])) and not np.asarray(o)[:, early].any()
    np.testing.assert_allclose(np.asarray(weights)[:, ~early].sum(axis=-1), Hq // Hkv, rtol=1e-5)
    # A few decode rows alone (any positions) are the same rows of the full pass.
    rows = np.array([0, bs - 1, bs, 255, 256, T - 1])
    o_rows, w_rows = compressed_branch(jnp.asarray(q[:, rows]), jnp.asarray(cmp[0]), jnp.asarray(cmp[1]), 1,
                                       jnp.asarray(q_pos[:, rows]), block_size=bs, scale=scale)
    np.testing.assert_allclose(np.asarray(o_rows), o_ref.numpy()[:, rows], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(w_rows)[..., : T // bs], expected[:, rows], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed, T, Hq, Hkv", BRANCH_CASES)
def test_select_blocks_matches_formula(seed, T, Hq, Hkv):
    bs = 16
    q, k, v, _, cmp = random_branch_inputs(seed, T, Hq, Hkv, bs=bs)
    q_pos = np.broadcast_to(np.arange(T, dtype=np.int32), q.shape[:2])
    _, weights = compressed_branch(jnp.asarray(q), jnp.asarray(cmp[0]), jnp.asarray(cmp[1]), 1, jnp.asarray(q_pos), block_size=bs, scale=32**-0.5)
    weights = np.asarray(weights)
    results = {}
    for S in (1, 4, 12, 40):
        for rule in ("nsa1b", "exact"):
            got = select(jnp.asarray(weights), jnp.asarray(q_pos), block_size=bs, block_counts=S, rule=rule)
            assert got.shape == (*weights.shape[:3], S) and got.dtype == jnp.int32
            expected = reference_selection(weights, q_pos, bs, S, rule)
            np.testing.assert_array_equal(normalized(got), expected, err_msg=f"S={S} rule={rule}")
            assert np.all((expected == (q_pos // bs)[:, :, None, None]).any(axis=-1))  # own block always in
            results[S, rule] = expected
    assert np.array_equal(results[4, "nsa1b"], results[4, "exact"])  # S <= bs / 2: the rules agree
    # S > bs / 2: rows of chunk 0 (positions < 256) have no history, the rules agree; rows of chunk 1
    # keep at most bs / 2 of the 16 earlier blocks under nsa1b, and the rules differ.
    assert np.array_equal(results[12, "nsa1b"][:, :256], results[12, "exact"][:, :256])
    assert not np.array_equal(results[12, "nsa1b"][:, 256:], results[12, "exact"][:, 256:])


@pytest.mark.parametrize("seed, T, Hq, Hkv", BRANCH_CASES)
def test_selected_and_window_branches_match_fla(seed, T, Hq, Hkv):
    bs, D, window = 16, 32, 32
    scale = D**-0.5
    q, k, v, cache, cmp = random_branch_inputs(seed, T, Hq, Hkv, D, bs)
    q_pos = np.broadcast_to(np.arange(T, dtype=np.int32), q.shape[:2])
    o_cmp, weights = compressed_branch(jnp.asarray(q), jnp.asarray(cmp[0]), jnp.asarray(cmp[1]), 1, jnp.asarray(q_pos), block_size=bs, scale=scale)
    idx = reference_selection(np.asarray(weights), q_pos, bs, 5, "nsa1b")
    assert (idx[:, :100] == -1).any() and (idx[:, -1] >= 0).all()  # early rows: fewer blocks than S
    qt, kt, vt = map(torch.from_numpy, (q, k, v))
    with one_torch_thread():
        o_slc = naive.naive_nsa_selection(qt, kt, vt, torch.from_numpy(idx), block_size=bs, scale=scale).numpy()
    o_swa = sliding_window(qt, kt, vt, window, scale).numpy()

    def ours(gates):
        g = np.broadcast_to(np.asarray(gates, np.float32), (*q.shape[:3], 3))
        return np.asarray(selected_branch(
            jnp.asarray(q), jnp.asarray(cache[0]), jnp.asarray(cache[1]), 1, jnp.asarray(q_pos), jnp.asarray(idx, jnp.int32),
            o_cmp, jnp.asarray(g), block_size=bs, window=window, scale=scale,
        ))

    np.testing.assert_allclose(ours([0, 1, 0]), o_slc, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours([0, 0, 1]), o_swa, rtol=1e-5, atol=1e-5)
    gates = np.random.default_rng(seed).random((*q.shape[:3], 3)).astype(np.float32)
    expected = gates[..., :1] * np.asarray(o_cmp) + gates[..., 1:2] * o_slc + gates[..., 2:] * o_swa
    np.testing.assert_allclose(ours(gates), expected, rtol=1e-5, atol=1e-5)


# --- whole models -------------------------------------------------------------------------------------

PARITY = {"nsa": 520, "nsa_g4": 600, "nsa_exact": 600, "nsa_tied": 333, "nsa_sharded": 300, "nsa_bf16": 450}


@pytest.fixture(scope="module")
def references(nsa_checkpoints):
    return {}


def reference(references, nsa_checkpoints, name) -> TorchNSA:
    if name not in references:
        references[name] = TorchNSA(nsa_checkpoints[name])
    return references[name]


# nsa_g4 (more blocks and heads) and nsa_exact (the exact rule, also decoded in test_nsa_engine) with
# the slow tests (the default run's 20 minutes)
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in ("nsa_g4", "nsa_exact") else [])
                                  for n in PARITY])
def test_logits_match_reference(nsa_checkpoints, references, name):
    ref = reference(references, nsa_checkpoints, name)
    T = PARITY[name]
    tokens = random_tokens(2, T, seed=T)
    cfg, params, _ = load_model(str(nsa_checkpoints[name]), "float32")
    assert (cfg.nsa.block_size, cfg.nsa.block_counts, cfg.nsa.window_size, cfg.nsa.topk_rule) == (
        ref.block_size, ref.block_counts, ref.window, ref.rule)
    expected, selections = ref.forward(tokens)
    assert relative_error(jit_score(params, cfg, jnp.asarray(tokens)), expected) <= 1e-4
    # Selection matters: most rows keep S of many more visible blocks, and attending to every block
    # (or the other rule, where it differs) gives other logits.
    own = np.arange(T) // ref.block_size
    assert np.mean(own + 1 > ref.block_counts) > 0.6
    S, half, start = ref.block_counts, ref.block_size // 2, own // ref.block_size * ref.block_size
    candidates = own + 1 if ref.rule == "exact" else np.where(start == 0, own + 1, np.minimum(start, half) + np.minimum(own - start + 1, half))
    for idx in selections:  # nsa1b early in a chunk: fewer than S candidates
        assert np.all((idx >= 0).sum(axis=-1) == np.minimum(candidates, S)[None, :, None])
    dense, _ = ref.forward(tokens, block_counts=T // ref.block_size + 1)
    assert relative_error(dense, expected) > 1e-2
    if ref.block_counts > ref.block_size // 2:
        other, other_sel = ref.forward(tokens, rule="exact" if ref.rule == "nsa1b" else "nsa1b")
        assert any(not np.array_equal(a, b) for a, b in zip(selections, other_sel))
        assert relative_error(other, expected) > 1e-4


@pytest.mark.parametrize("name, T", [pytest.param("nsa_g4", 290, marks=pytest.mark.slow), ("nsa_tied", 300)])
def test_greedy_matches_reference(nsa_checkpoints, references, name, T):
    """Plain greedy decoding (prefill in chunks of 256, then one-token steps over the cache). nsa_g4
    (G = 4, 12 blocks): the 32 new rows lie in chunk 1, where the nsa1b rule is not exact; nsa_tied:
    G = 3 and the tied head."""
    ref = reference(references, nsa_checkpoints, name)
    cfg, params, _ = load_model(str(nsa_checkpoints[name]), "float32")
    prompt = random_tokens(1, T, seed=T + 1)
    batch = Batch(prompt.astype(np.int32), np.array([T], np.int32))
    max_new = 32
    cache = prefilled(params, cfg, batch, T + max_new)
    out, _ = generate(params, cfg, batch, cache, SpecConfig(), T + max_new, max_new)
    assert len(out[0]) == max_new and out[0] == ref.argmax_after(prompt[0], out[0])


def test_bfloat16_checkpoint_at_bfloat16(nsa_checkpoints, references):
    """The bf16 file loads at bf16 unchanged (the values of its float32 load) and stays close to the
    reference (bf16 rounding may flip a few selections, hence the loose bound)."""
    path = nsa_checkpoints["nsa_bf16"]
    cfg, params, _ = load_model(str(path), "bfloat16")
    _, params32, _ = load_model(str(path), "float32")
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(params32)):
        assert x.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y))
    tokens = random_tokens(1, 450, seed=3)
    expected, _ = reference(references, nsa_checkpoints, "nsa_bf16").forward(tokens)
    got = np.asarray(jit_score(params, cfg, jnp.asarray(tokens)))
    assert relative_error(got, expected) <= 0.3 and np.mean(got.argmax(-1) == expected.argmax(-1)) >= 0.9


# --- bad input ----------------------------------------------------------------------------------------


def broken_copy(src: Path, dst: Path, drop=(), **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key in drop:
        del config[key]
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def expect_error(path: Path, *fragments: str) -> str:
    with pytest.raises(JaxspecError) as info:
        load_model(str(path), "float32")
    message = str(info.value)
    assert "\n" not in message and all(f in message for f in fragments), message
    return message


def with_g_proj(src: Path, dst: Path, shape) -> Path:
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    name = "model.layers.1.self_attn.g_proj.weight"
    if shape is None:
        del weights[name]
    else:
        weights[name] = np.zeros(shape, np.float32)
    save_file(weights, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize(
    "drop, changes, fragments",
    [
        (("block_size",), {}, ("missing", "block_size")),
        ((), dict(block_counts=0), ("block_counts", "0")),
        ((), dict(window_size=2048), ("window_size", "2048", "1024")),
        ((), dict(block_size=12), ("block_size", "12")),
        ((), dict(nsa_topk_rule="paper"), ("nsa_topk_rule", "paper")),
    ],
)
def test_bad_nsa_config(nsa_checkpoints, tmp_path, drop, changes, fragments):
    expect_error(broken_copy(nsa_checkpoints["nsa"], tmp_path / "bad", drop, **changes), *fragments)


@pytest.mark.parametrize("shape, fragments", [((12, 65), ("g_proj", "(12, 65)")), ((4, 64), ("g_proj", "(4, 64)")), (None, ("g_proj",))])
def test_bad_g_proj(nsa_checkpoints, tmp_path, shape, fragments):
    expect_error(with_g_proj(nsa_checkpoints["nsa"], tmp_path / "bad", shape), *fragments)


def test_cli_bad_g_proj_is_one_line(nsa_checkpoints, tmp_path):
    path = with_g_proj(nsa_checkpoints["nsa"], tmp_path / "bad", (4, 64))
    result = subprocess.run(
        [sys.executable, "-m", "jaxspec.generate", "--model", str(path), "--max-new-tokens", "2"],
        cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "g_proj" in lines[0], result.stderr
    assert result.stdout == ""


# --- conversion ---------------------------------------------------------------------------------------


def test_convert_round_trip(nsa_checkpoints, tmp_path):
    from jaxspec.convert import convert

    src = nsa_checkpoints["nsa_tied"]
    summary = convert(str(src), tmp_path / "ckpt", "float32")
    assert summary.startswith(f"wrote {tmp_path / 'ckpt'} (llama-nsa, ")
    (cfg_a, params_a, _), (cfg_b, params_b, _) = load_model(str(src), "float32"), load_model(str(tmp_path / "ckpt"), "float32")
    assert cfg_a == cfg_b and cfg_b.nsa is not None
    assert jax.tree.structure(params_a) == jax.tree.structure(params_b)
    for x, y in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    tokens = jnp.asarray(random_tokens(1, 300, seed=9))
    np.testing.assert_array_equal(np.asarray(jit_score(params_a, cfg_a, tokens)), np.asarray(jit_score(params_b, cfg_b, tokens)))
