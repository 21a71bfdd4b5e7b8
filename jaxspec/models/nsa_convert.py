"""A dense Llama model -> an NSA model (NSA-1B's `llama-nsa` format) with fitted gates.

Every dense weight is kept; NSA adds only the gate projection `g_proj` [3 Hq, D] per layer
(DESIGN.md section 2), here fitted by distillation: with everything else frozen, the gates minimise
KL(dense || NSA) of the next-token distributions on real text (the Python documentation of
`jaxspec.corpus`, of which a fixed split of documents is held out and never trained on).

    to_nsa(cfg, params, nsa_cfg, g_proj) -> (cfg, params)       append the gate columns to wqkv
    fit_gates(cfg, dense_params, batches, steps, lr) -> g_proj  Adam on the gates only, init 0
    write_hf(path, cfg, params, tokenizer)                      an HF directory (config.json, safetensors)
    save_gates / load_gates                                     the small gate file that ships in the repo

`g_proj` is always in the HF layout, float32 [L, 3 Hq, D] (the stacked `self_attn.g_proj.weight`s;
rows (compressed, selected, window) per query head); the decoder's params hold its transpose.

The fit's forward (`nsa_logits`) computes the same function as `decoder.score` on the NSA model, but
without a KV cache and with the selected-block and window branches as masked dense attention (matrix
products, which differentiate cheaply, instead of gathers), each layer rematerialised in the backward
pass: a 2048-token row needs a few GB, whatever the number of layers.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
import zlib
from pathlib import Path
from typing import Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import corpus, files
from jaxspec.errors import JaxspecError
from jaxspec.models import decoder
from jaxspec.models.config import ModelConfig, NSAConfig
from jaxspec.models.kvcache import cache_slots
from pallas_kernels._common import matmul_precision
from pallas_kernels.nsa_compressed import nsa_compressed_reference, select_blocks

Params = decoder.Params

# The NSA settings of the SmolLM2-derived model (DESIGN.md section 2: the measured recipe).
DEFAULT_NSA = NSAConfig(block_size=16, block_counts=16, window_size=128, topk_rule="exact")
REPO = Path(__file__).resolve().parents[2]
SHIPPED_GATES = REPO / "checkpoints" / "nsa_smollm2_gates.safetensors"
GATES_FILE = "nsa_gates.safetensors"  # the gates, beside the weights in every converted checkpoint
GATE_TENSOR = "g_proj"
GATES_FORMAT = "jaxspec-nsa-gates/1"
HELDOUT_MOD, HELDOUT_RESIDUE = 5, 2  # pydoc topics with crc32(name) % 5 == 2 are held out


# ---------------------------------------------------------------------------------------------------
# dense -> NSA


def check_dense_llama(cfg: ModelConfig) -> None:
    if cfg.model_type != "llama":
        raise JaxspecError(
            f"--to-nsa needs a dense Llama-family model (model_type 'llama'), got {cfg.model_type!r}"
        )


def gate_shape(cfg: ModelConfig) -> tuple[int, int, int]:
    """[L, 3 Hq, D]: the stacked HF g_proj weights of `cfg` (dense or NSA)."""
    return (cfg.num_layers, 3 * cfg.num_heads, cfg.hidden_size)


def nsa_model_config(cfg: ModelConfig, nsa_cfg: NSAConfig) -> ModelConfig:
    check_dense_llama(cfg)
    return cfg.replace(model_type="llama-nsa", nsa=nsa_cfg)


def to_nsa(cfg: ModelConfig, params: Params, nsa_cfg: NSAConfig, g_proj) -> tuple[ModelConfig, Params]:
    """The NSA model: `cfg` with `nsa_cfg`, and `params` with the gate columns appended to wqkv
    (g_proj [L, 3 Hq, D], HF layout; a zero gate bias where the model has qkv biases). The dense
    arrays are shared, not copied; only wqkv (and bqkv) are new."""
    nsa = nsa_model_config(cfg, nsa_cfg)
    if tuple(np.shape(g_proj)) != gate_shape(cfg):
        raise JaxspecError(f"g_proj has shape {list(np.shape(g_proj))}, the model needs {list(gate_shape(cfg))}")
    return nsa, _with_gates(params, jnp.asarray(g_proj))


def _with_gates(params: Params, g_proj: jax.Array) -> Params:
    layers = dict(params["layers"])
    dtype = layers["wqkv"].dtype
    layers["wqkv"] = jnp.concatenate([layers["wqkv"], jnp.swapaxes(g_proj, 1, 2).astype(dtype)], axis=-1)
    if "bqkv" in layers:
        zeros = jnp.zeros(layers["bqkv"].shape[:-1] + (g_proj.shape[1],), layers["bqkv"].dtype)
        layers["bqkv"] = jnp.concatenate([layers["bqkv"], zeros], axis=-1)
    return {**params, "layers": layers}


def gates_of(cfg: ModelConfig, params: Params) -> np.ndarray:
    """The float32 g_proj [L, 3 Hq, D] of an NSA model's params (inverse of `to_nsa`)."""
    gdim = decoder.gate_dim(cfg)
    return np.asarray(jnp.swapaxes(params["layers"]["wqkv"][..., -gdim:], 1, 2), np.float32)


# ---------------------------------------------------------------------------------------------------
# The fit's forward: NSA logits without a cache


def nsa_attention(q, k, v, gates, nsa_cfg: NSAConfig, scale: float):
    """NSA attention of a whole sequence at positions 0..T-1: q [B, T, Hq, Dh], k/v [B, T, Hkv, Dh]
    (post-RoPE), gates [B, T, Hq, 3] after the sigmoid. Same semantics as `jaxspec.models.nsa` over a
    cache holding these keys (the compressed branch and the block selection are the kernels'
    references); the selected and window branches are masked [T, T] attention. Returns [B, T, Hq, Dh]."""
    B, T, Hq, Dh = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    bs = nsa_cfg.block_size
    S = cache_slots(T)  # the decoder's cache length: the same compressed blocks, the same selection
    NB = S // bs
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    precision = matmul_precision(q.dtype)

    def pooled(x):  # [B, T, Hkv, Dh] -> [1, B, Hkv, NB, Dh]: block means, the cache's k_cmp / v_cmp
        xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, S - T), (0, 0), (0, 0)))
        return jnp.mean(xp.reshape(B, NB, bs, Hkv, Dh), axis=2).astype(x.dtype).transpose(0, 2, 1, 3)[None]

    o_cmp, weights = nsa_compressed_reference(q, pooled(k), pooled(v), 0, pos, block_size=bs, scale=scale)
    idx = select_blocks(jax.lax.stop_gradient(weights), pos, block_size=bs, block_counts=nsa_cfg.block_counts,
                        rule=nsa_cfg.topk_rule)  # [B, T, Hkv, block_counts], -1: none
    chosen = jnp.any(idx[..., None] == jnp.arange(NB, dtype=jnp.int32), axis=-2)  # [B, T, Hkv, NB]
    t, s = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    causal = s <= t
    selected = jnp.repeat(chosen, bs, axis=-1)[..., :T] & causal[:, None, :]  # [B, T, Hkv, T]
    window = causal & (s > t - nsa_cfg.window_size)  # [T, T]

    qg = q.astype(jnp.float32).reshape(B, T, Hkv, G, Dh)
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, kf, precision=precision) * scale  # [B, Hkv, G, T, T]

    def branch(mask):  # mask broadcastable to [B, Hkv, 1, T, T]
        masked = jnp.where(mask, logits, -jnp.inf)
        m = jax.lax.stop_gradient(jnp.max(masked, axis=-1, keepdims=True))
        p = jnp.exp(masked - jnp.where(jnp.isfinite(m), m, 0.0))
        denom = jnp.sum(p, axis=-1, keepdims=True)
        p = p / jnp.where(denom > 0, denom, 1.0)
        return jnp.einsum("bkgts,bskd->btkgd", p, vf, precision=precision)

    o_slc = branch(jnp.transpose(selected, (0, 2, 1, 3))[:, :, None])
    o_swa = branch(window) if nsa_cfg.window_size else jnp.zeros_like(o_slc)
    g = gates.astype(jnp.float32).reshape(B, T, Hkv, G, 3)
    out = g[..., 0:1] * o_cmp.astype(jnp.float32).reshape(B, T, Hkv, G, Dh) + g[..., 1:2] * o_slc + g[..., 2:3] * o_swa
    return out.reshape(B, T, Hq, Dh).astype(q.dtype)


def nsa_logits(params: Params, cfg: ModelConfig, tokens: jax.Array, remat: bool = True) -> jax.Array:
    """Teacher-forced float32 logits [B, T, V] of the NSA model `cfg` over `tokens` [B, T] from
    position 0: `decoder.score` computed without a KV cache (as `decoder.forward` does otherwise,
    layer by layer), each layer rematerialised in the backward pass when `remat`."""
    if cfg.nsa is None:
        raise JaxspecError("nsa_logits needs an NSA model config")
    B, T = tokens.shape
    inv_freq, rope_scale = decoder.rope_tables(cfg)
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    dtype = jnp.dtype(cfg.dtype)

    def layer(x, p):
        h = decoder.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
        qkv = jnp.dot(h, p["wqkv"])
        if "bqkv" in p:
            qkv = qkv + p["bqkv"]
        q, k, v, g = jnp.split(qkv, [q_dim, q_dim + kv_dim, q_dim + 2 * kv_dim], axis=-1)
        gates = jax.nn.sigmoid(g.astype(jnp.float32)).reshape(B, T, cfg.num_heads, 3)
        q = q.reshape(B, T, cfg.num_heads, cfg.head_dim)
        k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = decoder.rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
            k = decoder.rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
        q = decoder.apply_rope(q, positions, inv_freq, rope_scale)
        # the decoder attends over the KV cache, which holds keys and values at the cache dtype
        k = decoder.apply_rope(k, positions, inv_freq, rope_scale).astype(dtype)
        v = v.astype(dtype)
        out = nsa_attention(q, k, v, gates, cfg.nsa, cfg.head_dim**-0.5)
        x = x + jnp.dot(out.reshape(B, T, -1), p["wo"]).astype(x.dtype)
        h = decoder.rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
        gate, up = jnp.split(jnp.dot(h, p["w_gate_up"]), 2, axis=-1)
        x = x + jnp.dot(jax.nn.silu(gate) * up, p["w_down"]).astype(x.dtype)
        return x, None

    if remat:
        layer = jax.checkpoint(layer, prevent_cse=False)
    x, _ = jax.lax.scan(layer, decoder.embed(params, cfg, tokens), params["layers"])
    return decoder.logits(params, cfg, x)


# ---------------------------------------------------------------------------------------------------
# Fitting the gates


def kl_from_logits(teacher_logp: jax.Array, student_logits: jax.Array) -> jax.Array:
    """Mean over positions of KL(teacher || student); teacher as log-probabilities [..., V]."""
    student_logp = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    return jnp.mean(jnp.sum(jnp.exp(teacher_logp) * (teacher_logp - student_logp), axis=-1))


def _teacher(dense_params, cfg, tokens):
    return jax.nn.log_softmax(decoder.score(dense_params, cfg, tokens), axis=-1)


def _kl(g_proj, dense_params, tokens, *, cfg, nsa_cfg, remat):
    nsa = nsa_model_config(cfg, nsa_cfg)
    teacher = jax.lax.stop_gradient(_teacher(dense_params, cfg, tokens))
    return kl_from_logits(teacher, nsa_logits(_with_gates(dense_params, g_proj), nsa, tokens, remat=remat))


def kl_divergence(cfg: ModelConfig, dense_params: Params, g_proj, tokens, nsa_cfg: NSAConfig = DEFAULT_NSA) -> float:
    """Mean KL(dense || NSA with gates g_proj) of the next-token distributions over `tokens` [B, T]
    (one row at a time)."""
    fn = _kl_fn(cfg, nsa_cfg)
    g = jnp.asarray(g_proj, jnp.float32)
    rows = np.asarray(tokens, np.int32)
    return float(np.mean([fn(g, dense_params, jnp.asarray(row[None])) for row in rows]))


@functools.lru_cache(maxsize=None)
def _kl_fn(cfg: ModelConfig, nsa_cfg: NSAConfig):
    return jax.jit(functools.partial(_kl, cfg=cfg, nsa_cfg=nsa_cfg, remat=False))


@functools.lru_cache(maxsize=None)
def make_step(cfg: ModelConfig, nsa_cfg: NSAConfig, lr: float, micro_batch: int):
    """(optimizer, step): Adam at `lr` and step(g_proj, opt_state, dense_params, tokens [B, T]) ->
    (g_proj, opt_state, mean KL), jitted: gradients of micro-batches of `micro_batch` rows are
    averaged, then one optimizer update."""
    import optax

    optimizer = optax.adam(lr)
    grad_fn = jax.value_and_grad(lambda g, p, t: _kl(g, p, t, cfg=cfg, nsa_cfg=nsa_cfg, remat=True))

    def step(g, opt_state, dense_params, tokens):
        B, T = tokens.shape
        micro = tokens.reshape(B // micro_batch, micro_batch, T)

        def accumulate(carry, rows):
            loss, grad = grad_fn(g, dense_params, rows)
            return (carry[0] + loss, jax.tree.map(jnp.add, carry[1], grad)), None

        (loss, grad), _ = jax.lax.scan(accumulate, (jnp.float32(0), jnp.zeros_like(g)), micro)
        n = micro.shape[0]
        updates, opt_state = optimizer.update(grad / n, opt_state, g)
        return optax.apply_updates(g, updates), opt_state, loss / n

    return optimizer, jax.jit(step, donate_argnums=(0, 1))


def fit_gates(
    cfg: ModelConfig,
    dense_params: Params,
    token_batches: Iterable,
    steps: int,
    lr: float = 3e-3,
    *,
    nsa_cfg: NSAConfig = DEFAULT_NSA,
    micro_batch: int = 1,
    init=None,
    log_every: int = 25,
    log: Callable[[str], None] | None = print,
    history: list | None = None,
) -> np.ndarray:
    """Fits the gate projections of the NSA version of the dense model (`cfg`, `dense_params`) and
    returns g_proj float32 [L, 3 Hq, D] (HF layout).

    Only the gates train (from `init`, default 0: every gate 0.5): Adam at `lr`, one step per batch
    [B, T] of `token_batches` (B a multiple of `micro_batch`), loss the mean KL(dense || NSA) of the
    next-token distributions, the dense targets computed without gradients. Every `log_every` steps
    `log` gets a line with the mean loss since the last one and the time; `history` (if given)
    receives each step's loss.
    """
    check_dense_llama(cfg)
    if steps < 1:
        raise JaxspecError(f"the fit needs at least 1 step, got {steps}")
    optimizer, step_fn = make_step(cfg, nsa_cfg, float(lr), micro_batch)
    g = jnp.zeros(gate_shape(cfg), jnp.float32) if init is None else jnp.array(init, jnp.float32)  # a copy: g is donated
    if g.shape != gate_shape(cfg):
        raise JaxspecError(f"initial g_proj has shape {list(g.shape)}, the model needs {list(gate_shape(cfg))}")
    opt_state = optimizer.init(g)
    batches = iter(token_batches)
    start = last = time.perf_counter()
    since: list[float] = []
    for i in range(1, steps + 1):
        tokens = jnp.asarray(next(batches), jnp.int32)
        if tokens.shape[0] % micro_batch:
            raise JaxspecError(f"batch of {tokens.shape[0]} rows is not a multiple of the micro-batch {micro_batch}")
        g, opt_state, loss = step_fn(g, opt_state, dense_params, tokens)
        loss = float(loss)
        if not np.isfinite(loss):
            raise JaxspecError(f"the gate fit diverged at step {i} (loss {loss}); lower the learning rate")
        since.append(loss)
        if history is not None:
            history.append(loss)
        now = time.perf_counter()
        if log and (i == 1 or i % log_every == 0 or i == steps):
            what = "first step, compile included" if i == 1 else f"mean of {len(since)}"
            per_step = (now - last) / len(since)
            log(f"step {i}/{steps}  KL {np.mean(since):.4f} ({what})  {per_step:.2f} s/step  {now - start:.0f} s")
            since, last = [], now
        elif i == 1:
            since, last = [], now
    return np.asarray(g, np.float32)


# ---------------------------------------------------------------------------------------------------
# Training and held-out text


def heldout_topic(name: str) -> bool:
    """Whether the pydoc topic `name` is held out: crc32(name) % 5 == 2, 15 of Python 3.12's 79 topics,
    about a fifth of the text (by name, so the split stays the same where the texts or sizes differ)."""
    return zlib.crc32(name.encode()) % HELDOUT_MOD == HELDOUT_RESIDUE


def split_documents() -> tuple[list[str], list[str]]:
    """(training, held-out) documents of `jaxspec.corpus`, in its order (`heldout_topic`); the fit
    never sees the held-out ones."""
    from pydoc_data.topics import topics

    names = sorted(topics, key=lambda name: (-len(topics[name]), name))  # the order of corpus.documents()
    docs = corpus.documents()
    train = [doc for name, doc in zip(names, docs) if not heldout_topic(name)]
    held = [doc for name, doc in zip(names, docs) if heldout_topic(name)]
    return train, held


def heldout_fingerprint() -> str:
    """A short hash of the held-out documents (they come from the running Python's pydoc topics)."""
    return hashlib.sha256("\x00".join(split_documents()[1]).encode()).hexdigest()[:16]


def token_stream(tokenizer, docs: list[str]) -> np.ndarray:
    """The documents, separated by blank lines, as one int32 token array."""
    return np.asarray(tokenizer.encode("\n\n".join(docs)), np.int32)


def training_batches(tokenizer, tokens: int, batch: int, seed: int = 0) -> Iterator[np.ndarray]:
    """Endless [batch, tokens] windows at random offsets of the training documents' token stream."""
    stream = token_stream(tokenizer, split_documents()[0])
    if len(stream) < tokens + 1:
        raise JaxspecError(f"the training text has {len(stream)} tokens, fewer than a window of {tokens}")
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(stream) - tokens + 1, batch)
        yield np.stack([stream[s : s + tokens] for s in starts])


def heldout_windows(tokenizer, tokens: int, count: int | None = None) -> np.ndarray:
    """[N, tokens] consecutive non-overlapping windows of the held-out documents' token stream."""
    stream = token_stream(tokenizer, split_documents()[1])
    n = len(stream) // tokens
    if count is not None:
        n = min(n, count)
    if n == 0:
        raise JaxspecError(f"the held-out text has {len(stream)} tokens, fewer than a window of {tokens}")
    return stream[: n * tokens].reshape(n, tokens)


# ---------------------------------------------------------------------------------------------------
# Files: the gate file and the HF directory


def save_gates(path: Path, g_proj, metadata: dict) -> None:
    """Writes g_proj (float32 [L, 3 Hq, D]) and `metadata` (JSON) to a safetensors file, atomically."""
    from safetensors.numpy import save_file

    meta = {"format": GATES_FORMAT, "jaxspec": json.dumps(metadata, sort_keys=True, default=str)}
    tensors = {GATE_TENSOR: np.ascontiguousarray(np.asarray(g_proj, np.float32))}
    files.write_file(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def load_gates(path: Path, cfg: ModelConfig | None = None, nsa_cfg: NSAConfig | None = None) -> tuple[np.ndarray, dict]:
    """(g_proj float32, metadata) of a gate file, checked against the dense model `cfg` and the NSA
    settings `nsa_cfg` it is meant for (when given)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise JaxspecError(f"gate file {path} does not exist")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            if meta.get("format") != GATES_FORMAT or GATE_TENSOR not in f.keys():
                raise JaxspecError(f"{path} is not a jaxspec NSA gate file")
            g = f.get_tensor(GATE_TENSOR).astype(np.float32)
        info = json.loads(meta.get("jaxspec", "{}"))
    except (SafetensorError, OSError, ValueError) as e:
        raise JaxspecError(f"cannot read gate file {path}: {e}") from None
    if cfg is not None and tuple(g.shape) != gate_shape(cfg):
        raise JaxspecError(
            f"gate file {path} holds g_proj {list(g.shape)}, this model needs {list(gate_shape(cfg))} "
            "(fit gates for it with --fit-steps N)"
        )
    if nsa_cfg is not None and info.get("nsa") and info["nsa"] != nsa_dict(nsa_cfg):
        raise JaxspecError(
            f"gate file {path} was fitted for NSA {info['nsa']}, not {nsa_dict(nsa_cfg)} (refit with --fit-steps N)"
        )
    return g, info


def model_fingerprint(params: Params) -> str:
    """A short hash of the dense model's embedding matrix (float32): which weights gates were fitted to."""
    return hashlib.sha256(np.asarray(params["embed"], np.float32).tobytes()).hexdigest()[:16]


def nsa_dict(nsa_cfg: NSAConfig) -> dict:
    return {"block_size": nsa_cfg.block_size, "block_counts": nsa_cfg.block_counts,
            "window_size": nsa_cfg.window_size, "nsa_topk_rule": nsa_cfg.topk_rule}


def hf_config(cfg: ModelConfig) -> dict:
    """config.json of `cfg` in the HF Llama layout (plus NSA-1B's keys for llama-nsa models)."""
    if cfg.model_type not in ("llama", "llama-nsa") or cfg.qk_norm:
        raise JaxspecError(f"cannot write a {cfg.model_type!r} model as an HF Llama directory")
    rope = cfg.rope
    hf = {
        "architectures": ["LlamaNSAForCausalLM" if cfg.nsa else "LlamaForCausalLM"],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": rope.theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.qkv_bias,
        "mlp_bias": False,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if len(cfg.eos_token_ids) != 1 else cfg.eos_token_ids[0],
        "torch_dtype": cfg.dtype,
        "use_cache": True,
    }
    if rope.kind == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": rope.factor}
        if rope.original_max_position:
            hf["rope_scaling"]["original_max_position_embeddings"] = rope.original_max_position
    elif rope.kind == "llama3":
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
                              "high_freq_factor": rope.high_freq_factor,
                              "original_max_position_embeddings": rope.original_max_position}
    elif rope.kind == "yarn":
        hf["rope_scaling"] = {"rope_type": "yarn", "factor": rope.factor, "beta_fast": rope.beta_fast,
                              "beta_slow": rope.beta_slow, "attention_factor": rope.attention_factor,
                              "original_max_position_embeddings": rope.original_max_position, "truncate": rope.truncate}
    if cfg.nsa:
        hf.update(nsa_dict(cfg.nsa))
        if cfg.nsa.refresh_layers:
            hf["nsa_refresh_layers"] = list(cfg.nsa.refresh_layers)
    return hf


def hf_tensors(cfg: ModelConfig, params: Params) -> dict[str, jax.Array]:
    """The params under their HF names and layouts ([out, in] projections, one tensor per layer)."""
    from jaxspec.loaders.hf import LAYER_TENSORS, TOP_TENSORS, layer_tensor_names  # the loader's own name map

    shapes = decoder.param_shapes(cfg)
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    split_sizes = {
        "wqkv": [q_dim, kv_dim, kv_dim] + ([decoder.gate_dim(cfg)] if cfg.nsa else []),
        "bqkv": [q_dim, kv_dim, kv_dim] + ([decoder.gate_dim(cfg)] if cfg.nsa else []),
        "w_gate_up": [cfg.intermediate_size, cfg.intermediate_size],
    }
    out = {}
    for key in ("embed", "final_norm", "lm_head"):
        if key in shapes:
            name, transpose = TOP_TENSORS[key]
            out[name] = params[key].T if transpose else params[key]
    for key in shapes["layers"]:
        names, transpose = layer_tensor_names(cfg, key), LAYER_TENSORS[key][1]
        stacked = params["layers"][key]
        bounds = np.cumsum(split_sizes.get(key, [stacked.shape[-1]]))[:-1]
        for i in range(cfg.num_layers):
            for name, part in zip(names, jnp.split(stacked[i], bounds, axis=-1)):
                out[f"model.layers.{i}.{name}"] = part.T if transpose else part
    return {name: jnp.asarray(x) for name, x in out.items()}


def write_hf(path: Path, cfg: ModelConfig, params: Params, tokenizer) -> None:
    """Writes an HF directory into the existing directory `path`: config.json, generation_config.json,
    model.safetensors (HF names, at the params' dtype), tokenizer.json and tokenizer_config.json
    (what `load_model` and transformers read)."""
    from safetensors.flax import save_file

    config = hf_config(cfg.replace(bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(hf_tensors(cfg, params), str(path / "model.safetensors"), metadata={"format": "pt"})
    files.usual_mode(path / "model.safetensors")
    tokenizer.backend.save(str(path / "tokenizer.json"))
    token = lambda i: None if i is None else tokenizer.backend.id_to_token(i)
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token(tokenizer.bos_token_id),
        "eos_token": token(tokenizer.eos_token_ids[0]) if tokenizer.eos_token_ids else None,
        "model_max_length": cfg.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    }
    if tokenizer.chat_template:
        tok_config["chat_template"] = tokenizer.chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")
