"""EAGLE-3 heads in the public layout of the EAGLE-3 authors, SpecForge, vLLM and SGLang: config.json
(a one-layer Llama config plus `draft_vocab_size`, optional `target_hidden_size` and
`eagle_aux_hidden_state_layer_ids`) and model.safetensors (or pytorch_model.bin) with the tensors
named in PUBLIC_NAMES. `load_eagle` reads one and checks that it fits the target model, each misfit a
one-line JaxspecError; `save_eagle` writes the same layout (`write_eagle` into a directory of
other files too: what training writes). A head without `lm_head.weight` shares the target's LM head
(`EagleConfig.shared_lm_head`): its draft vocabulary is the whole vocabulary, d2t zeros.

Linear weights are stored [out, in] and transposed to jaxspec's x @ W; q/k/v and gate/up are fused
as in `jaxspec.models.eagle`'s params; `t2d` (a bool mask over the target vocabulary) is derived from
`d2t` and checked against it on load.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxspec import files
from jaxspec.errors import JaxspecError
from jaxspec.loaders import hf
from jaxspec.models import eagle
from jaxspec.models.config import ModelConfig, rope_from_hf
from jaxspec.models.decoder import Params
from jaxspec.models.eagle import EagleConfig

LM_HEAD_NAME = "lm_head.weight"  # absent: the head shares the target's LM head
# jaxspec param -> (public tensor names, concatenated along jaxspec's last axis; transposed)
PUBLIC_NAMES = {
    "fc": (("fc.weight",), True),
    "embed_norm": (("midlayer.input_layernorm.weight",), False),
    "hidden_norm": (("midlayer.hidden_norm.weight",), False),
    "wqkv": (("midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
              "midlayer.self_attn.v_proj.weight"), True),
    "wo": (("midlayer.self_attn.o_proj.weight",), True),
    "mlp_norm": (("midlayer.post_attention_layernorm.weight",), False),
    "w_gate_up": (("midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight"), True),
    "w_down": (("midlayer.mlp.down_proj.weight",), True),
    "final_norm": (("norm.weight",), False),
    "lm_head": ((LM_HEAD_NAME,), True),
    "d2t": (("d2t",), False),
}
EMBED_NAME = "embed_tokens.weight"  # optional: the head's own token embedding [V, H]
T2D_NAME = "t2d"
IGNORED_SUFFIX = "rotary_emb.inv_freq"  # older torch checkpoints store RoPE's buffer


def read_config(path: Path, target_cfg: ModelConfig) -> EagleConfig:
    """The head's config from config.json and its tensors' names (whether it has an LM head of its
    own), checked against the target (one-line errors)."""
    raw = files.read_json_object(path / "config.json", "EAGLE head config")
    unsupported = {"num_hidden_layers": 1, "attention_bias": False, "mlp_bias": False,
                   "norm_before_residual": False, "hidden_act": "silu"}
    for key, supported in unsupported.items():
        if raw.get(key, supported) != supported:
            raise JaxspecError(f"EAGLE head {path}: {key} {raw[key]!r} is not supported (only {supported!r})")
    try:
        heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
        layers = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids") or eagle.default_feature_layers(target_cfg.num_layers)
        ecfg = EagleConfig(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw["intermediate_size"]),
            draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
            vocab_size=int(raw["vocab_size"]),
            target_hidden_size=int(raw.get("target_hidden_size") or hidden),
            feature_layers=tuple(int(i) for i in layers),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=rope_from_hf(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            sliding_window=int(raw.get("sliding_window") or 0),
            shared_lm_head=LM_HEAD_NAME not in tensor_names(path),
        )
    except KeyError as e:
        raise JaxspecError(f"EAGLE head config {path / 'config.json'} is missing {e.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
        raise JaxspecError(f"EAGLE head config {path / 'config.json'} has a bad value: "
                           f"{type(e).__name__}: {e}") from None
    check_fits(ecfg, target_cfg, path)
    return ecfg


def check_fits(ecfg: EagleConfig, target_cfg: ModelConfig, path: Path) -> None:
    """The head's sizes against the target's (the embedding width is checked with the tensors)."""
    misfits = [
        (ecfg.target_hidden_size, target_cfg.hidden_size, "target_hidden_size", "hidden size"),
        (ecfg.vocab_size, target_cfg.vocab_size, "vocab_size", "vocabulary size"),
        (ecfg.head_dim, target_cfg.head_dim, "head_dim", "head_dim"),
    ]
    for got, want, key, what in misfits:
        if got != want:
            raise JaxspecError(f"EAGLE head {path}: {key} {got} does not fit the target's {what} {want}")
    if ecfg.num_heads % ecfg.num_kv_heads:
        raise JaxspecError(f"EAGLE head {path}: num_attention_heads {ecfg.num_heads} is not a multiple of "
                           f"num_key_value_heads {ecfg.num_kv_heads}")
    if not 0 < ecfg.draft_vocab_size <= ecfg.vocab_size:
        raise JaxspecError(f"EAGLE head {path}: draft_vocab_size {ecfg.draft_vocab_size} is not in "
                           f"1..{ecfg.vocab_size}")
    if ecfg.shared_lm_head and ecfg.draft_vocab_size != ecfg.vocab_size:
        raise JaxspecError(f"EAGLE head {path} has no tensor {LM_HEAD_NAME} (a head without one drafts through the "
                           f"target's LM head, so its draft_vocab_size must be vocab_size {ecfg.vocab_size})")
    layers = ecfg.feature_layers
    if len(layers) != 3 or not all(0 <= i < target_cfg.num_layers for i in layers):
        raise JaxspecError(f"EAGLE head {path}: eagle_aux_hidden_state_layer_ids {list(layers)} are not three "
                           f"layers of the target's {target_cfg.num_layers}")


def read_safetensors(path: Path, read):
    """read(f) of the head's model.safetensors opened with safe_open (a bad file: one-line error)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path / "model.safetensors", framework="numpy") as f:
            return read(f)
    except (SafetensorError, OSError) as e:
        raise JaxspecError(f"corrupt or unreadable safetensors file {path / 'model.safetensors'}: {e}") from None


def tensor_names(path: Path) -> set[str]:
    """The names of the head's tensors (model.safetensors' header, or the .bin mapped, not read)."""
    if (path / "model.safetensors").is_file():
        return read_safetensors(path, lambda f: set(f.keys()))
    return set(read_bin(path, mmap=True))


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of model.safetensors, or of pytorch_model.bin (through torch, if installed)."""
    if (path / "model.safetensors").is_file():
        return read_safetensors(path, lambda f: {name: f.get_tensor(name) for name in f.keys()})
    state = read_bin(path, mmap=False)
    return {name: (t.float() if t.is_floating_point() else t).numpy() for name, t in state.items()}


def read_bin(path: Path, mmap: bool) -> dict:
    """pytorch_model.bin's state dict of torch tensors (`mmap`: mapped, so reading its names costs no
    read of its data; a bad or missing file: one-line error)."""
    if not (path / "pytorch_model.bin").is_file():
        raise JaxspecError(f"EAGLE head {path} has no model.safetensors or pytorch_model.bin")
    try:
        import torch
    except ImportError:
        raise JaxspecError(f"EAGLE head {path} has only pytorch_model.bin, which needs torch installed") from None
    try:
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises many types for a bad file
        raise JaxspecError(f"cannot read {path / 'pytorch_model.bin'}: {str(e).splitlines()[0]}") from None


def build_params(ecfg: EagleConfig, tensors: dict[str, np.ndarray], dtype, path: Path) -> Params:
    """The params pytree (host arrays) from the public tensors, every name and shape checked."""
    shapes = eagle.param_shapes(ecfg)
    known = {name for names, _ in PUBLIC_NAMES.values() for name in names} | {EMBED_NAME, T2D_NAME}
    extra = sorted(n for n in tensors if n not in known and not n.endswith(IGNORED_SUFFIX))
    if extra:
        raise JaxspecError(f"EAGLE head {path} has unexpected tensor {extra[0]} (not an EAGLE-3 head of one layer?)")

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise JaxspecError(f"EAGLE head {path} has no tensor {name}")
        if tensors[name].shape != shape:
            raise JaxspecError(f"EAGLE head {path}: tensor {name} has shape {tensors[name].shape}, expected {shape}")
        return tensors[name]

    params: Params = {}
    for key, (names, transpose) in PUBLIC_NAMES.items():
        if key not in shapes:  # a shared LM head
            continue
        shape = shapes[key][::-1] if transpose else shapes[key]
        width = shape[0] if transpose else shape[-1]  # the fused axis: q, k, v and gate, up split it
        parts = split_sizes(ecfg, key) or [width]
        part_shape = lambda n: (n, *shape[1:]) if transpose else (*shape[:-1], n)
        arrays = [get(name, part_shape(n)) for name, n in zip(names, parts)]
        w = np.concatenate([a.T if transpose else a for a in arrays], axis=-1)
        params[key] = w.astype(np.int32) if key == "d2t" else w.astype(dtype)
    if EMBED_NAME in tensors:
        params["embed"] = get(EMBED_NAME, (ecfg.vocab_size, ecfg.hidden_size)).astype(dtype)
    check_vocabulary(ecfg, params["d2t"], get(T2D_NAME, (ecfg.vocab_size,)), path)
    return params


def split_sizes(ecfg: EagleConfig, key: str) -> list[int] | None:
    """The widths of a fused param's public parts (q, k, v; gate, up), None for unfused params."""
    q_dim, kv_dim = ecfg.num_heads * ecfg.head_dim, ecfg.num_kv_heads * ecfg.head_dim
    return {"wqkv": [q_dim, kv_dim, kv_dim],
            "w_gate_up": [ecfg.intermediate_size, ecfg.intermediate_size]}.get(key)


def target_mask(ecfg: EagleConfig, d2t: np.ndarray) -> np.ndarray:
    """t2d: [V] bool, true at the target ids of the draft vocabulary."""
    mask = np.zeros(ecfg.vocab_size, bool)
    mask[np.arange(ecfg.draft_vocab_size) + d2t] = True
    return mask


def check_vocabulary(ecfg: EagleConfig, d2t: np.ndarray, t2d: np.ndarray, path: Path) -> None:
    """d2t maps the draft vocabulary to distinct target ids, the ones t2d marks; a whole vocabulary's
    to the same ids (`eagle.to_target_probs` takes its distribution as it is)."""
    targets = np.arange(ecfg.draft_vocab_size) + d2t
    if targets.min() < 0 or targets.max() >= ecfg.vocab_size:
        raise JaxspecError(f"EAGLE head {path}: d2t maps draft ids outside the target vocabulary "
                           f"0..{ecfg.vocab_size - 1}")
    if not np.array_equal(target_mask(ecfg, d2t), t2d.astype(bool)) or len(np.unique(targets)) != len(targets):
        raise JaxspecError(f"EAGLE head {path}: t2d does not mark exactly the d2t target ids")
    if ecfg.draft_vocab_size == ecfg.vocab_size and d2t.any():
        raise JaxspecError(f"EAGLE head {path}: its draft vocabulary is the whole vocabulary, but d2t is not zeros")


SHIPPED = {"smollm2": "eagle3-smollm2"}  # model name -> its head in the repository's checkpoints/


def shipped_head(model: str) -> Path | None:
    """The head the repository ships for the model named `model` (checkpoints/, beside an editable
    install's package), or None."""
    name = SHIPPED.get(model)
    path = Path(__file__).resolve().parents[2] / "checkpoints" / name if name else None
    return path if path is not None and (path / "config.json").is_file() else None


def head_fingerprint(path: Path) -> str:
    """A head's id for the planner's tables, which record the head an eagle entry measured:
    'eagle3-<draft vocabulary>-<hash of config.json and the weights file>' (a retrained head is
    another head)."""
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            digest.update((path / name).read_bytes())
    vocab = json.loads((path / "config.json").read_text()).get("draft_vocab_size")
    return f"eagle3-{vocab}-{digest.hexdigest()[:10]}"


def load_eagle(path: str | Path, target_cfg: ModelConfig, dtype: str = "bfloat16") -> tuple[EagleConfig, Params]:
    """A head in the public layout at `path`, checked to fit `target_cfg`; params as host arrays in
    `dtype` (d2t int32). A head without its own embedding reads the target's, so then its width must
    be the target's."""
    path = Path(path)
    if dtype not in ("bfloat16", "float32"):
        raise JaxspecError(f"dtype must be bfloat16 or float32, got {dtype!r}")
    if not path.is_dir():
        raise JaxspecError(f"EAGLE head {path} is not a directory")
    ecfg = read_config(path, target_cfg)
    tensors = read_tensors(path)
    if EMBED_NAME not in tensors and ecfg.hidden_size != target_cfg.hidden_size:
        raise JaxspecError(f"EAGLE head {path}: hidden_size {ecfg.hidden_size} does not fit the target's hidden "
                           f"size {target_cfg.hidden_size} (and the head has no {EMBED_NAME})")
    params = build_params(ecfg, tensors, jnp.dtype(dtype), path)
    return ecfg, params


def public_config(ecfg: EagleConfig, dtype: str) -> dict:
    """config.json of a head: the one-layer Llama config (`loaders.hf.hf_config`'s keys, RoPE
    included) plus the EAGLE-3 keys, and `sliding_window` for a head that attends a window."""
    config = hf.hf_config(eagle.layer_config(ecfg, dtype))
    for key in ("bos_token_id", "eos_token_id", "use_cache"):
        config.pop(key)
    config.update(architectures=["LlamaForCausalLMEagle3"], vocab_size=ecfg.vocab_size,
                  draft_vocab_size=ecfg.draft_vocab_size, target_hidden_size=ecfg.target_hidden_size,
                  eagle_aux_hidden_state_layer_ids=list(ecfg.feature_layers))
    if ecfg.sliding_window:
        config["sliding_window"] = ecfg.sliding_window
    return config


def public_tensors(ecfg: EagleConfig, params: Params) -> dict[str, np.ndarray]:
    """The params under their public names and layouts ([out, in]; d2t int64, t2d bool)."""
    out = {}
    for key, (names, transpose) in PUBLIC_NAMES.items():
        if key not in params:  # a shared LM head
            continue
        w = np.asarray(params[key])
        parts = np.split(w, np.cumsum(split_sizes(ecfg, key) or [w.shape[-1]])[:-1], axis=-1)
        out.update({name: np.ascontiguousarray(p.T if transpose else p) for name, p in zip(names, parts)})
    out["d2t"] = out["d2t"].astype(np.int64)
    out[T2D_NAME] = target_mask(ecfg, np.asarray(params["d2t"]))
    if "embed" in params:
        out[EMBED_NAME] = np.asarray(params["embed"])
    return out


def write_eagle(directory: Path, ecfg: EagleConfig, params: Params) -> None:
    """Writes config.json and model.safetensors (at the params' dtype) into an existing directory."""
    from safetensors.numpy import save_file

    dtype = np.asarray(params["fc"]).dtype.name
    (directory / "config.json").write_text(json.dumps(public_config(ecfg, dtype), indent=2) + "\n")
    save_file(public_tensors(ecfg, params), str(directory / "model.safetensors"), metadata={"format": "pt"})
    files.usual_mode(directory / "model.safetensors")


def save_eagle(path: str | Path, ecfg: EagleConfig, params: Params) -> None:
    """Writes the head at `path` (replaced atomically) in the public layout (`write_eagle`)."""
    files.write_dir(Path(path), lambda tmp: write_eagle(tmp, ecfg, params))
