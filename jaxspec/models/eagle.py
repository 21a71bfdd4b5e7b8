"""The EAGLE-3 draft head: pure functions over a params pytree (issue 59; the architecture of the
EAGLE-3 authors, SpecForge and vLLM's `llama_eagle3`).

The head drafts from the target's features: the residual stream entering three of the target's
layers (`EagleConfig.feature_layers`, HF `output_hidden_states[i]`), concatenated and projected by
`fc` to the head's width. One Llama decoder layer (the "midlayer") reads, at each position, the
token's embedding (the target's table) and that feature, each RMS-normed and concatenated, so its
q/k/v read 2 x hidden; its residual is the feature itself. The head keeps its own one-layer KV cache
over every position (`init_cache`). A final norm and an LM head over a reduced draft vocabulary give
draft logits; draft id i is target id i + d2t[i]. A head may instead share the target's own LM head
(`EagleConfig.shared_lm_head`, EAGLE-1's and vLLM's shared head): it drafts over the whole vocabulary
(d2t zeros), so no token is out of its reach, and carries no LM head of its own. Draft step k > 0
feeds the head's own output (`head_forward`'s pre-norm state) back in place of the projected feature.

Params layout (x @ W convention; H = hidden, Ht = target hidden, F = intermediate, Vd = draft vocab):
    fc [3 Ht, H], embed_norm [H] (the public `input_layernorm`, on the token embedding),
    hidden_norm [H], wqkv [2H, (Hq + 2 Hkv) Dh] (q, k, v side by side), wo [Hq Dh, H],
    mlp_norm [H] (`post_attention_layernorm`), w_gate_up [H, 2F] (gate then up), w_down [F, H],
    final_norm [H] (`norm`), lm_head [H, Vd] (absent with a shared LM head), d2t [Vd] int32, and
    embed [V, H] only when the head carries its own token embedding.
The layer is the decoder's own (`decoder.attention_inputs`, `residual_add_norm`, `swiglu`, and
`decoder.attention` by default), so the backend switch and the cache code path are the decoder's.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models import decoder, kvcache
from jaxspec.models.config import ModelConfig, RopeConfig
from jaxspec.models.decoder import AttendFn, Params, matmul
from jaxspec.models.kvcache import KVCache
from pallas_kernels._common import matmul_precision
from pallas_kernels.rope_write import rms_norm


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    """Shape and numerics of an EAGLE-3 head, and the target layers whose inputs are its features."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    draft_vocab_size: int
    vocab_size: int  # the target's
    target_hidden_size: int
    feature_layers: tuple[int, int, int]  # target layers whose input stream is a feature (low, mid, high)
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 4096
    # > 0: the head attends only keys less than this many positions back, the relative distances its
    # training sequences held (config.json's `sliding_window`; `attention`)
    sliding_window: int = 0
    # the target's LM head gives the draft logits over the whole vocabulary (draft_vocab_size =
    # vocab_size, d2t zeros; a checkpoint without lm_head.weight): no draft token is out of reach
    shared_lm_head: bool = False


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's and vLLM's default feature layers of an L-layer target: (2, L // 2, L - 3)."""
    return (2, num_layers // 2, num_layers - 3)


def layer_config(ecfg: EagleConfig, dtype: str = "float32") -> ModelConfig:
    """The midlayer as a one-layer Llama ModelConfig: the decoder's layer functions, attention and
    cache take it (`dtype` is the cache's; the layer functions do not read it)."""
    return ModelConfig(
        model_type="llama", vocab_size=ecfg.draft_vocab_size, hidden_size=ecfg.hidden_size, num_layers=1,
        num_heads=ecfg.num_heads, num_kv_heads=ecfg.num_kv_heads, head_dim=ecfg.head_dim,
        intermediate_size=ecfg.intermediate_size, rms_norm_eps=ecfg.rms_norm_eps, rope=ecfg.rope,
        max_position_embeddings=ecfg.max_position_embeddings, dtype=dtype)


def attention(ecfg: EagleConfig, q_slot: jax.Array, positions: jax.Array, backend: str, tree=None) -> AttendFn:
    """The head's attention for rows at cache slots q_slot [B, T] and RoPE positions [B, T]: causal
    over its cache (a draft tree's rows: the committed cache and their ancestors, `tree`), and with
    `ecfg.sliding_window` W no key more than W - 1 positions back (a committed key's slot is its
    position; a tree's own keys lie within W of its rows). A head trained on sequences of W tokens
    has seen no longer distances: at 4-6K tokens of context its top-1 agreement with the target fell
    from 0.49 to 0.36 at the first draft and from 0.38 to 0.18 at the fifth, and a window of W keeps
    them (bench/NOTES.md, "the head's window")."""
    lo = decoder.window_start(positions, ecfg.sliding_window) if ecfg.sliding_window else None
    return decoder.attention(layer_config(ecfg), q_slot, backend, tree=tree, lo=lo)


def param_shapes(ecfg: EagleConfig) -> Params:
    """The exact shapes of a head's params (without the optional `embed` [V, H]; no lm_head when the
    head shares the target's)."""
    H, F = ecfg.hidden_size, ecfg.intermediate_size
    q_dim, kv_dim = ecfg.num_heads * ecfg.head_dim, ecfg.num_kv_heads * ecfg.head_dim
    shapes = {
        "fc": (3 * ecfg.target_hidden_size, H),
        "embed_norm": (H,), "hidden_norm": (H,),
        "wqkv": (2 * H, q_dim + 2 * kv_dim), "wo": (q_dim, H),
        "mlp_norm": (H,), "w_gate_up": (H, 2 * F), "w_down": (F, H),
        "final_norm": (H,), "lm_head": (H, ecfg.draft_vocab_size),
        "d2t": (ecfg.draft_vocab_size,),
    }
    if ecfg.shared_lm_head:
        del shapes["lm_head"]
    return shapes


def init_params(key: jax.Array, ecfg: EagleConfig, dtype, scale: float = 0.05) -> Params:
    """Random weights (normal * scale, norms near 1) and a random sorted draft vocabulary, for tests.
    The noise is drawn once and cut on the host: op by op, the many small shapes compile for seconds."""
    shapes = param_shapes(ecfg)
    noise_key, vocab_key = jax.random.split(key)
    sizes = [math.prod(shape) for shape in shapes.values()]
    noise = np.split(np.asarray(jax.random.normal(noise_key, (sum(sizes),), jnp.float32)), np.cumsum(sizes)[:-1])
    params = {name: (1.0 + 0.1 * x if name.endswith("norm") else scale * x).reshape(shape).astype(jnp.dtype(dtype))
              for (name, shape), x in zip(shapes.items(), noise)}
    ids = np.sort(np.asarray(jax.random.permutation(vocab_key, ecfg.vocab_size))[:ecfg.draft_vocab_size])
    params["d2t"] = (ids - np.arange(ecfg.draft_vocab_size)).astype(np.int32)
    return jax.device_put(params)


def init_cache(ecfg: EagleConfig, batch: int, length: int, dtype: str = "bfloat16",
               page_size: int = kvcache.DEFAULT_PAGE_SIZE) -> KVCache:
    """The head's empty KV cache: the decoder's, with one layer."""
    return kvcache.init_cache(layer_config(ecfg, dtype), batch, length, page_size)


def init_pool(ecfg: EagleConfig, pages: jax.Array, num_pages: int, dtype: str = "bfloat16",
              page_size: int = kvcache.DEFAULT_PAGE_SIZE) -> KVCache:
    """The head's empty pool of `num_pages` pages under the target's page table `pages`."""
    return kvcache.init_pool(layer_config(ecfg, dtype), pages, num_pages, page_size)


def token_embeds(params: Params, target_params: Params, target_cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Embeddings [B, T, H] of `tokens`: the head's own table if it carries one, else the target's."""
    if "embed" in params:
        return params["embed"][tokens]
    return decoder.embed(target_params, target_cfg, tokens)


def project_features(params: Params, features: jax.Array, backend: str = "reference") -> jax.Array:
    """The target's three feature rows, concatenated [B, T, 3 Ht], projected to the head's input [B, T, H]."""
    return matmul(features, decoder.row_kernel_matrix(params["fc"], features, backend))


def head_forward(
    params: Params,
    ecfg: EagleConfig,
    embeds: jax.Array,
    hidden: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    cache: KVCache,
    attend: AttendFn | None = None,
    slots: jax.Array | None = None,
    backend: str = "reference",
) -> tuple[jax.Array, KVCache]:
    """One pass of the midlayer over T rows: token embeddings `embeds` [B, T, H] with `hidden`
    [B, T, H] (the projected features, or at a later draft step the head's own previous output) at
    RoPE `positions` [B, T].

    Keys and values of rows with `valid` true are written into the head's cache at `slots` (default:
    the positions) before `attend` reads it; by default each row attends causally to the cache slots
    up to its own (`attention`; pass `attention(ecfg, q_slot, positions, backend, tree=...)` for a
    draft tree's rows, which see the committed cache and their ancestors).
    Returns the pre-norm output [B, T, H] (`draft_logits` reads it; the next draft step's `hidden`)
    and the cache.
    """
    B, T, _ = embeds.shape
    cfg = layer_config(ecfg)
    write_pos = jnp.where(valid, positions if slots is None else slots, cache.num_slots)  # past the end: not written
    if attend is None:
        attend = attention(ecfg, positions if slots is None else slots, positions, backend)
    layer = jnp.int32(0)  # the cache's one layer, and the entry of the one-entry norm stack below
    no_stacks = {"bqkv": None, "q_norm": None, "k_norm": None}
    w = {name: decoder.row_kernel_matrix(params[name], embeds, backend)
         for name in ("wqkv", "wo", "w_gate_up", "w_down")}

    eps = ecfg.rms_norm_eps
    pair = jnp.concatenate([rms_norm(embeds, params["embed_norm"], eps), rms_norm(hidden, params["hidden_norm"], eps)],
                           axis=-1)  # [B, T, 2H]: q, k and v read both
    q, cache, _ = decoder.attention_inputs(cfg, pair, w["wqkv"], no_stacks, layer, positions, write_pos,
                                           cache.slots(write_pos), cache, layer, backend)
    attn, _, _ = attend(layer, q, cache, None, None, ())
    # the residual is the pre-norm hidden input; the MLP's norm is fused with the add
    x, h = decoder.residual_add_norm(cfg, hidden, attn.reshape(B, T, -1), w["wo"], params["mlp_norm"][None],
                                     layer, backend)
    x = x + matmul(decoder.swiglu(h, w["w_gate_up"]), w["w_down"])
    return x, cache


def feature_forward(params: Params, ecfg: EagleConfig, target_params: Params, target_cfg: ModelConfig,
                    next_tokens: jax.Array, features: jax.Array, positions: jax.Array, valid: jax.Array,
                    cache: KVCache, backend: str = "reference", attend: AttendFn | None = None) -> tuple[jax.Array, KVCache]:
    """`head_forward` over rows of the target's own sequence: at position p, the target's features
    there [B, T, 3 Ht] with the embedding of the token that followed (`next_tokens` [B, T], the
    target's position p + 1), as EAGLE-3 pairs them. The prompt's prefill and the catch-up on an
    accepted path run this; draft steps feed the head's own state instead. `attend`: as `head_forward`
    takes it (default causal over the whole cache)."""
    embeds = token_embeds(params, target_params, target_cfg, next_tokens)
    return head_forward(params, ecfg, embeds, project_features(params, features, backend), positions, valid, cache,
                        attend, backend=backend)


def ttt_forward(params: Params, ecfg: EagleConfig, target_params: Params, target_cfg: ModelConfig,
                tokens: jax.Array, features: jax.Array, steps: int, remat: bool = False) -> jax.Array:
    """EAGLE-3's training-time test over a teacher-forced sequence: the head's pre-norm outputs
    [steps, B, T - 1, H] of `steps` unrolled draft steps, for rows t = 0 .. T - 2 of `tokens` [B, T]
    with the target's `features` [B, T, 3 Ht] at those positions.

    Step 0 is the inference pass over the target's own sequence (`feature_forward`): row t pairs f_t
    with embed(x_{t+1}) at RoPE position t; its output predicts x_{t+2}. Step k >= 1 is draft depth k
    of a chain drafted after position t along the true tokens: row t pairs the previous step's output
    at the same t with embed(x_{t+k+1}) (teacher forcing) at position t + k, as inference places draft
    depth k at position first + k (`decoding.drafters.eagle`, first = t), and attends to the step-0
    keys at indices <= t and to its own chain's keys of steps 1..k at index t (`ttt_attention`); its
    output predicts x_{t+k+2}. Rows whose tokens run past T - 1 (t + k + 1 > T - 1) read the last token
    and are garbage, seen only by themselves: the loss masks them. Step k writes its keys at slots
    k (T - 1) + t of one cache of `steps` blocks. `remat` recomputes each step in the backward pass.
    """
    B, T = tokens.shape
    rows = T - 1
    t = jnp.arange(rows, dtype=jnp.int32)
    cache = init_cache(ecfg, B, steps * rows, params["fc"].dtype.name)
    valid = jnp.ones((B, rows), bool)
    hidden = project_features(params, features[:, :rows])
    outs = []
    for k in range(steps):
        embeds = token_embeds(params, target_params, target_cfg, tokens[:, jnp.minimum(t + k + 1, T - 1)])
        positions = jnp.broadcast_to(t + k, (B, rows))
        slots = jnp.broadcast_to(k * rows + t, (B, rows))

        def step(p, e, h, c, positions=positions, slots=slots, attend=ttt_attention(ecfg, rows, k)):
            return head_forward(p, ecfg, e, h, positions, valid, c, attend, slots=slots)

        hidden, cache = (jax.checkpoint(step) if remat else step)(params, embeds, hidden, cache)
        outs.append(hidden)
    return jnp.stack(outs)


def ttt_attention(ecfg: EagleConfig, rows: int, step: int) -> AttendFn:
    """Attention of `ttt_forward`'s step `step` over its cache (step j's keys at slots j * rows + t):
    row t sees the step-0 keys at t' <= t and the keys of steps 1..step at t (its own chain), one
    softmax over both. Differentiable plain jnp: the causal part is [B, Hq, T, T] float32 logits."""
    scale, G = ecfg.head_dim**-0.5, ecfg.num_heads // ecfg.num_kv_heads

    def attend(layer, q, cache, _lx, _gates, carry):
        B, T, Hq, Dh = q.shape
        precision = matmul_precision(q.dtype)
        blocks = lambda c: c[:, :, :(step + 1) * rows].reshape(B, -1, step + 1, rows, Dh)  # [B, Hkv, j, t, Dh]
        k, v = map(blocks, cache.view(layer))
        qg = q.reshape(B, T, -1, G, Dh)
        causal = jnp.einsum("btkgd,bksd->bkgts", qg, k[:, :, 0], precision=precision,
                            preferred_element_type=jnp.float32)
        causal = jnp.where(jnp.arange(T)[None, :] <= jnp.arange(T)[:, None], causal, -jnp.inf)
        chain = jnp.einsum("btkgd,bkjtd->bkgtj", qg, k[:, :, 1:], precision=precision,
                           preferred_element_type=jnp.float32)
        p = jax.nn.softmax(jnp.concatenate([causal, chain], axis=-1) * scale, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgts,bksd->btkgd", p[..., :T], v[:, :, 0], precision=precision,
                         preferred_element_type=jnp.float32)
        out += jnp.einsum("bkgtj,bkjtd->btkgd", p[..., T:], v[:, :, 1:], precision=precision,
                          preferred_element_type=jnp.float32)
        return out.reshape(B, T, Hq, Dh).astype(q.dtype), None, carry

    return attend


def draft_logits(params: Params, ecfg: EagleConfig, target_params: Params, target_cfg: ModelConfig,
                 prenorm_out: jax.Array, backend: str = "reference") -> jax.Array:
    """The head's final norm and its LM head, or the target's (`EagleConfig.shared_lm_head`, read as
    the target's logits are): float32 logits [B, T, Vd] over the draft vocabulary."""
    h = rms_norm(prenorm_out, params["final_norm"], ecfg.rms_norm_eps)
    if ecfg.shared_lm_head:
        return decoder.output_logits(target_params, target_cfg, h)
    return matmul(h, decoder.row_kernel_matrix(params["lm_head"], h, backend), jnp.float32)


def to_target_ids(d2t: jax.Array, draft_ids: jax.Array) -> jax.Array:
    """Target token ids of draft ids (any shape): id + d2t[id]."""
    return draft_ids + d2t[draft_ids]


def to_target_probs(d2t: jax.Array, draft_probs: jax.Array, vocab_size: int) -> jax.Array:
    """The head's distribution over the target vocabulary [..., V] from its draft-vocabulary one
    [..., Vd] (after the logits processing, which commutes with the scatter: tokens outside the draft
    vocabulary have logit -inf, so probability 0): the q of exact rejection sampling. A whole
    vocabulary's d2t is zeros (`loaders.eagle.check_vocabulary`): its distribution is already q."""
    if draft_probs.shape[-1] == vocab_size:
        return draft_probs
    targets = to_target_ids(d2t, jnp.arange(d2t.shape[0]))
    zeros = jnp.zeros((*draft_probs.shape[:-1], vocab_size), draft_probs.dtype)
    return zeros.at[..., targets].set(draft_probs)
