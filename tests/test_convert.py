"""`python -m jaxspec.convert`: round trips (params, config, tokenizer, logits), atomicity (a failed
conversion leaves nothing behind and never damages an existing DST), and the CLI's one-line errors."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import convert as convert_module
from jaxspec.convert import convert
from jaxspec.errors import JaxspecError
from jaxspec.loaders import load_config, load_model, orbax
from jaxspec.models.decoder import score

REPO = Path(__file__).resolve().parents[1]


def assert_same_model(a, b):
    (cfg_a, params_a, tok_a), (cfg_b, params_b, tok_b) = a, b
    assert cfg_a == cfg_b
    assert jax.tree.structure(params_a) == jax.tree.structure(params_b)
    for x, y in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for attribute in ("chat_template", "bos_token_id", "eos_token_ids"):
        assert getattr(tok_a, attribute) == getattr(tok_b, attribute)
    text = "<|im_start|>user\nHello there, 12 dogs!<|im_end|>"
    assert tok_a.encode(text) == tok_b.encode(text)


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("name", ["qwen2", "qwen3_moe", "gpt_oss"])
def test_hf_round_trip_float32(hf_checkpoints, tmp_path, name):
    src = hf_checkpoints[name]
    summary = convert(str(src), tmp_path / "ckpt", "float32")
    assert summary.startswith(f"wrote {tmp_path / 'ckpt'} ({name}, ")
    original, restored = load_model(str(src), "float32"), load_model(str(tmp_path / "ckpt"), "float32")
    assert_same_model(original, restored)
    tokens = jnp.asarray([original[2].encode("The quick brown fox jumps over the lazy dog.")])
    np.testing.assert_array_equal(score(original[1], original[0], tokens), score(restored[1], restored[0], tokens))
    assert leftovers(tmp_path) == []


def test_a_router_saved_major_first_loads_turned(hf_checkpoints, tmp_path):
    """A checkpoint written before the router took the checkpoint's own [L, E, D] layout holds it [L, D, E]:
    it loads as the same model."""
    cfg, params, tokenizer = load_model(str(hf_checkpoints["qwen3_moe"]), "float32")
    L, E, D = params["layers"]["router"].shape
    assert E != D
    old = {**params, "layers": {**params["layers"], "router": jnp.swapaxes(params["layers"]["router"], 1, 2)}}
    (tmp_path / "old").mkdir()
    orbax.save(tmp_path / "old", cfg, old, tokenizer)
    assert_same_model((cfg, params, tokenizer), load_model(str(tmp_path / "old"), "float32"))


def test_hf_round_trip_bfloat16(hf_checkpoints, tmp_path):
    src = hf_checkpoints["qwen3"]
    convert(str(src), tmp_path / "ckpt", "bfloat16")
    assert_same_model(load_model(str(src), "bfloat16"), load_model(str(tmp_path / "ckpt"), "bfloat16"))
    cfg, params, _ = load_model(str(tmp_path / "ckpt"), "float32")  # restored at bf16, cast on load
    assert cfg.dtype == "float32" and all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    assert load_config(str(tmp_path / "ckpt"), "float32") == cfg  # from the checkpoint's config alone


def test_config_json_round_trip(smollm2_loaded):
    cfg = smollm2_loaded[0]
    assert orbax.config_from_json(orbax.config_to_json(cfg)) == cfg


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "jaxspec.convert", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def test_cli_smollm2_bfloat16(smollm2_loaded, tmp_path):
    result = run_cli("smollm2", str(tmp_path / "smol"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"wrote {tmp_path / 'smol'} (llama, 134.5M params, bfloat16)")
    cfg, params, tokenizer = smollm2_loaded
    expected = (cfg.replace(dtype="bfloat16"), jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), tokenizer)
    assert_same_model(expected, load_model(str(tmp_path / "smol"), "bfloat16"))


def bad_inputs(hf_checkpoints, tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(np.random.default_rng(0).bytes(2048))
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    config = json.loads((hf_checkpoints["llama"] / "config.json").read_text())
    (mistral / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("keep")
    return {
        "missing": ([str(tmp_path / "nope"), str(tmp_path / "out")], "does not exist"),
        "garbage": ([str(garbage), str(tmp_path / "out")], "corrupt or truncated GGUF"),
        "unsupported": ([str(mistral), str(tmp_path / "out")], "unsupported architecture 'mistral'"),
        "exists": ([str(hf_checkpoints["llama"]), str(existing)], "already exists"),
        "no_parent": ([str(hf_checkpoints["llama"]), str(tmp_path / "a" / "b")], "does not exist"),
        "unwritable": ([str(hf_checkpoints["llama"]), "/proc/jaxspec_out"], "cannot write /proc/jaxspec_out"),
    }


@pytest.mark.parametrize("case", ["missing", "garbage", "unsupported", "exists", "no_parent", "unwritable"])
def test_cli_bad_input(hf_checkpoints, tmp_path, case):
    args, message = bad_inputs(hf_checkpoints, tmp_path)[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    result = run_cli(*args)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr
    assert result.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no temp dirs
    assert (tmp_path / "existing" / "keep.txt").read_text() == "keep"


def fail_while_saving(monkeypatch):
    """Makes the orbax writer fail after it has written part of the checkpoint."""

    def save(path, *args):
        (path / "partial").write_text("half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(orbax, "save", save)


def test_failure_while_writing_leaves_nothing(hf_checkpoints, tmp_path, monkeypatch):
    fail_while_saving(monkeypatch)
    with pytest.raises(JaxspecError, match="No space left on device"):
        convert(str(hf_checkpoints["llama"]), tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_force_replaces(hf_checkpoints, tmp_path):
    dst = tmp_path / "ckpt"
    convert(str(hf_checkpoints["llama"]), dst, "float32")
    (dst / "stale.txt").write_text("old")
    with pytest.raises(JaxspecError, match="already exists"):
        convert(str(hf_checkpoints["qwen3"]), dst, "float32")
    convert(str(hf_checkpoints["qwen3"]), dst, "float32", force=True)
    assert not (dst / "stale.txt").exists() and leftovers(tmp_path) == []
    assert_same_model(load_model(str(hf_checkpoints["qwen3"]), "float32"), load_model(str(dst), "float32"))


def test_force_failure_keeps_old(hf_checkpoints, tmp_path, monkeypatch):
    dst = tmp_path / "ckpt"
    dst.mkdir()
    (dst / "keep.txt").write_text("keep")
    with pytest.raises(JaxspecError):
        convert(str(tmp_path / "nope"), dst, force=True)
    fail_while_saving(monkeypatch)
    with pytest.raises(JaxspecError):
        convert(str(hf_checkpoints["llama"]), dst, force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"] and (dst / "keep.txt").read_text() == "keep"


def test_failed_rename_restores_old(hf_checkpoints, tmp_path, monkeypatch):
    """If the final rename fails after the old DST was moved aside, the old DST comes back."""
    dst = tmp_path / "ckpt"
    dst.mkdir()
    (dst / "keep.txt").write_text("keep")
    rename = Path.rename

    def failing_rename(self, target):
        if Path(target) == dst and self.name.endswith(".tmp"):
            raise OSError(5, "Input/output error")
        return rename(self, target)

    monkeypatch.setattr(convert_module.Path, "rename", failing_rename)
    with pytest.raises(OSError):
        convert(str(hf_checkpoints["llama"]), dst, force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"] and (dst / "keep.txt").read_text() == "keep"


def test_damaged_checkpoint(hf_checkpoints, tmp_path):
    dst = tmp_path / "ckpt"
    convert(str(hf_checkpoints["llama"]), dst, "float32")
    for file in (dst / orbax.PARAMS_DIR / "d").iterdir():
        file.write_bytes(b"")
    with pytest.raises(JaxspecError, match="cannot restore orbax checkpoint"):
        load_model(str(dst))
    (dst / orbax.CONFIG_FILE).write_text("{}")
    with pytest.raises(JaxspecError, match="cannot read"):
        load_model(str(dst))


def test_truncated_checkpoint_is_one_line_naming_the_cause(hf_checkpoints, tmp_path, caplog):
    """Data files cut short (a copy that stopped): orbax's loop logs a traceback for each failed read
    and raises an exception wrapping others; the user sees one line with the first cause, nothing else."""
    dst = tmp_path / "ckpt"
    convert(str(hf_checkpoints["llama"]), dst, "float32")
    arrays = list((dst / orbax.PARAMS_DIR).glob("ocdbt.process_*/d/*"))  # the arrays' data (not the tree's)
    assert arrays
    for file in arrays:
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with caplog.at_level(logging.DEBUG), pytest.raises(JaxspecError) as info:
        load_model(str(dst))
    message = str(info.value)
    assert message.startswith("cannot restore orbax checkpoint") and "\n" not in message
    assert "is not valid for value of size" in message, message  # tensorstore's own words, not orbax's wrapper
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    for file in (dst / orbax.PARAMS_DIR / "d").iterdir():  # the tree's own database: its metadata goes too
        file.write_bytes(b"")
    with pytest.raises(JaxspecError, match="cannot restore orbax checkpoint .*: the saved tree's metadata is unread"):
        load_model(str(dst))


def test_ctrl_c_during_a_save_raises_once_it_has_ended():
    """orbax's save threads write on after an interrupt, into the directory `files.write_dir` then
    removes: a Ctrl-C during the save is raised when it has ended."""
    from jaxspec.loaders import orbax as orbax_loader

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    ran = []
    with pytest.raises(KeyboardInterrupt):
        with orbax_loader._interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            ran.append("the rest of the save")
    assert ran == ["the rest of the save"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
