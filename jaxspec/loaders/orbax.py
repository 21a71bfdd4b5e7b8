"""jaxspec checkpoints: an orbax PyTree checkpoint of the params plus the config and tokenizer files.

Layout of a checkpoint directory (written by `python -m jaxspec.convert`):
    params/               orbax StandardCheckpointer output (the params pytree, at the saved dtype;
                          MXFP4 expert stacks as their uint8 bytes and scales)
    jaxspec_config.json   the ModelConfig as JSON
    tokenizer.json, tokenizer_config.json   see `Tokenizer.save`
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import signal
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxspec.models import sharding
from jaxspec.models.config import ModelConfig, MoEConfig, NSAConfig, RopeConfig
from jaxspec.errors import JaxspecError
from jaxspec.models.decoder import Params, param_shapes
from jaxspec.tokenizer import Tokenizer
from pallas_kernels.mxfp4 import MXFP4, MXFP4_GROUP, to_bytes

CONFIG_FILE = "jaxspec_config.json"
PARAMS_DIR = "params"


def is_checkpoint(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file()


def config_to_json(cfg: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(cfg), indent=1)


def config_from_json(text: str) -> ModelConfig:
    fields = json.loads(text)
    fields["rope"] = RopeConfig(**fields["rope"])
    fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
    fields["nsa"] = NSAConfig(**fields["nsa"]) if fields.get("nsa") else None
    fields["moe"] = MoEConfig(**fields["moe"]) if fields.get("moe") else None
    fields["sliding_layers"] = tuple(fields.get("sliding_layers", ()))
    return ModelConfig(**fields)


def save(path: Path, cfg: ModelConfig, params: Params, tokenizer: Tokenizer) -> None:
    """Writes a checkpoint into the existing, empty directory `path` (MXFP4 stacks as the released bytes,
    whichever form they are in)."""
    params = jax.tree.map(lambda x: to_bytes(x) if isinstance(x, MXFP4) else x, params,
                          is_leaf=lambda x: isinstance(x, MXFP4))
    with _interrupts_deferred(), ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path.absolute() / PARAMS_DIR, params)
        checkpointer.wait_until_finished()
    (path / CONFIG_FILE).write_text(config_to_json(cfg))
    tokenizer.save(path)


@contextlib.contextmanager
def _interrupts_deferred():
    """A Ctrl-C during the block raises once it has ended: orbax's save threads write on after an
    interrupt, into a directory the caller then removes, and fail at the interpreter's exit (on the
    main thread only: no other can take a signal)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


@contextlib.contextmanager
def _restoring(path: Path):
    """Reading the params: any failure is one JaxspecError naming the first cause (orbax and
    tensorstore raise many types for missing or damaged files, each wrapping the one before), and the
    tracebacks orbax's asyncio loop logs for its other failed reads on the way are dropped."""
    quiet = lambda record: record.levelno < logging.ERROR  # noqa: E731 (a filter may be any callable)
    logging.getLogger("asyncio").addFilter(quiet)
    try:
        yield
    except Exception as e:
        while e.__cause__ is not None:
            e = e.__cause__
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise JaxspecError(f"cannot restore orbax checkpoint {path / PARAMS_DIR}: {first}") from None
    finally:
        logging.getLogger("asyncio").removeFilter(quiet)


def read_saved_config(path: Path) -> ModelConfig:
    """The checkpoint's config as saved (its dtype is the saved params')."""
    try:
        return config_from_json((path / CONFIG_FILE).read_text())
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise JaxspecError(f"cannot read {path / CONFIG_FILE}: {e}") from None


def saved_layers(path: Path) -> dict:
    """Orbax's metadata of the saved layer stacks: {name: its leaf's metadata (a dict for an MXFP4
    stack: its bytes' and scales')}."""
    with _restoring(path):
        with ocp.StandardCheckpointer() as checkpointer:
            metadata = checkpointer.metadata(path.absolute() / PARAMS_DIR).item_metadata
        if metadata is None:  # how orbax reads a damaged tree's metadata
            raise ValueError("the saved tree's metadata is unreadable")
    return metadata.tree.get("layers", {})


def packed_stacks(layers: dict) -> tuple[str, ...]:
    """The layer stacks held in MXFP4 (gpt-oss's released experts: saved as their bytes and scales,
    `pallas_kernels.mxfp4.MXFP4`)."""
    return tuple(name for name, leaf in layers.items() if isinstance(leaf, dict) and "blocks" in leaf)


def router_transposed(layers: dict, shapes: dict) -> bool:
    """Whether the MoE router was saved [L, D, E], as jaxspec wrote it before 2026-12-07 (now [L, E, D],
    the checkpoint's own layout: `models.moe.route`); such a checkpoint loads with it turned."""
    want = shapes["layers"].get("router")
    return want is not None and want[1] != want[2] and tuple(layers["router"].shape) == (want[0], want[2], want[1])


def load(path: Path, dtype: str, mesh: Mesh | None = None) -> tuple[ModelConfig, Params, Tokenizer]:
    """Restores the params at the saved dtype (MXFP4 stacks as their bytes), then casts the others to
    `dtype`: onto the default device, or with a `mesh` each leaf split as tensor parallelism splits it
    (no device reads a full copy)."""
    saved = read_saved_config(path)
    shapes = param_shapes(saved)
    layers = saved_layers(path)
    packed, turned = packed_stacks(layers), router_transposed(layers, shapes)
    if turned:
        L, E, D = shapes["layers"]["router"]
        shapes["layers"]["router"] = (L, D, E)
    if mesh is not None:
        saved = saved.replace(expert_parallel=sharding.splits_experts(saved, bool(packed), mesh.size))
    for name in packed:
        *lead, K, N = shapes["layers"][name]
        shapes["layers"][name] = MXFP4((*lead, N, K // 2), (*lead, N, K // MXFP4_GROUP))
    is_shape = lambda x: isinstance(x, tuple)
    if mesh is None:
        placement = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), shapes, is_leaf=is_shape)
    else:
        sharding.check(saved, mesh.size)
        empty = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32), shapes, is_leaf=is_shape)
        placement = jax.tree.map(lambda spec: NamedSharding(mesh, spec), sharding.param_specs(empty, saved.expert_parallel),
                                 is_leaf=lambda x: isinstance(x, PartitionSpec))
    target = jax.tree.map(
        lambda shape, where: jax.ShapeDtypeStruct(shape, jnp.dtype(saved.dtype), sharding=where),
        shapes, placement, is_leaf=is_shape,
    )
    target["layers"] = {name: jax.tree.map(lambda t: t.update(dtype=jnp.uint8), t) if isinstance(t, MXFP4) else t
                        for name, t in target["layers"].items()}
    if mesh is not None:
        sharding.check_packed(target, saved, mesh.size)
    with _restoring(path):
        with ocp.StandardCheckpointer() as checkpointer:
            params = checkpointer.restore(path.absolute() / PARAMS_DIR, target)
    if turned:
        params["layers"]["router"] = jnp.swapaxes(params["layers"]["router"], 1, 2)
    cfg = saved.replace(dtype=dtype)
    params = jax.tree.map(lambda x: x if isinstance(x, MXFP4) else x.astype(jnp.dtype(dtype)), params,
                          is_leaf=lambda x: isinstance(x, MXFP4))
    return cfg, params, Tokenizer.from_saved(path)
