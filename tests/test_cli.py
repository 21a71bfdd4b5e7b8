"""`python -m jaxspec.generate` as a user runs it: human and --json output, and every bad input."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxspec.generate", *args], capture_output=True, text=True, env=ENV, timeout=600)


@pytest.fixture(autouse=True, scope="module")
def one_load_a_model():
    """The in-process runs load each model once (a load is ~4-12 s of dequantization on CPU; the
    loaders have their own tests): `load_model` remembers what it returned, for this module."""
    import functools

    from jaxspec import loaders

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loaders, "load_model", functools.cache(loaders.load_model))
        yield


def generate_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """`main` in this process, as `generate` runs it in its own (the same wrapper makes a bad input one
    line and exit code 2; anything else raises here), without a Python start, a model load and the
    compiles of each run (the process keeps the GGUF reader and the compiled programs)."""
    from jaxspec import generate as cli

    capsys.readouterr()
    try:
        cli.main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def assert_one_line_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert fragment in lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_human_output_smollm2():
    result = generate("--prompt", "Name three colors.", "--max-new-tokens", "12", "--method", "vegas", "--gamma", "3")
    assert result.returncode == 0, result.stderr
    text, _, stats = result.stdout.partition("--- stats ---")
    assert text.strip()
    for label in ("prompt tokens", "generated tokens", "prefill", "decode", "compile", "memory", "iterations", "acceptance"):
        assert label in stats
    assert "Traceback" not in result.stderr


def batch_args(tmp_path) -> list[str]:
    """Two prompts (one from a file) as a batch, greedy, 16 new tokens, JSON out."""
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("Write one sentence about rivers.")
    return ["--prompt", "What is 2 + 2?", "--prompt-file", str(prompt_file), "--max-new-tokens", "16", "--json"]


def run_json(capsys, *args) -> dict:
    result = generate_here(capsys, *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_json_batch_is_lossless_across_methods(capsys, tmp_path):
    """A batch: greedy vegas as a chain and the default (auto) emit plain decoding's tokens (every
    drafter's losslessness: test_engine; trees and int8 / int4 + skip drafts: the slow test below)."""
    common = batch_args(tmp_path)
    outputs = {method: run_json(capsys, *common, "--method", method, "--gamma", "4") for method in ("plain", "vegas")}
    outputs["auto"] = run_json(capsys, *common)  # the default: --method auto
    out = outputs["vegas"]
    assert out["model"] == "smollm2" and len(out["results"]) == 2
    for row in out["results"]:
        assert row["prompt_tokens"] > 0 and 0 < len(row["tokens"]) <= 16 and isinstance(row["text"], str)
        assert all(isinstance(t, int) for t in row["tokens"])
    stats = out["stats"]
    for key in ("decode_tokens_per_s", "prefill_tokens_per_s", "compile_s", "iterations", "tokens_per_iteration",
                "draft_tokens", "accepted_tokens"):
        assert isinstance(stats[key], (int, float)) and stats[key] >= 0
    assert stats["method"] == "vegas" and stats["gamma"] == 4 and len(stats["acceptance_by_depth"]) == 4
    assert stats["draft_tokens"] == 4 * stats["iterations"] and stats["tree"] is None
    plain_tokens = [r["tokens"] for r in outputs["plain"]["results"]]
    for method in ("vegas", "auto"):
        assert [r["tokens"] for r in outputs[method]["results"]] == plain_tokens
    assert stats["draft_weights"] == "exact" and stats["draft_weight_bytes"] == 0
    auto = outputs["auto"]["stats"]
    assert auto["method_requested"] == "auto" and auto["lossless"] and auto["planned"]["source"].startswith(("table:", "cost-model"))


@pytest.mark.slow  # four more CLI runs (~50 s of the default run's 20 minutes)
def test_json_batch_trees_and_quantized_drafts_are_lossless(capsys, tmp_path):
    """The same batch: a vegas tree, vegas with int8 draft weights and full drafts with int4 weights
    skipping two layers emit plain decoding's tokens, and their stats say what ran."""
    common = batch_args(tmp_path)
    plain = run_json(capsys, *common, "--method", "plain")
    tree = run_json(capsys, *common, "--method", "vegas", "--tree", "3,2,1", "--traversal", "dfs")
    int8 = run_json(capsys, *common, "--method", "vegas", "--gamma", "4", "--draft-weights", "int8")
    int4 = run_json(capsys, *common, "--method", "full", "--gamma", "3", "--draft-weights", "int4", "--draft-skip", "4,17")
    for out in (tree, int8, int4):
        assert [r["tokens"] for r in out["results"]] == [r["tokens"] for r in plain["results"]]
    stats = tree["stats"]
    assert (stats["tree"], stats["traversal"], stats["gamma"], stats["nodes"]) == ("3,2,1", "dfs", 3, 15)
    assert stats["nodes_verified_per_iteration"] == 15 and len(stats["acceptance_rate_by_depth"]) == 3
    assert stats["tokens_per_iteration"] == pytest.approx(1 + stats["accepted_per_iteration"])
    assert int8["stats"]["draft_weights"] == "int8" and int8["stats"]["draft_weight_bytes"] > 0
    stats = int4["stats"]
    assert (stats["method"], stats["draft_weights"], stats["draft_skip"]) == ("full", "int4", [4, 17])
    assert stats["draft_weight_bytes"] > 0 and stats["accepted_tokens"] > 0


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "1.5"], "top_p"),
        (["--top-k", "-3"], "top_k"),
        (["--min-p", "2"], "min_p"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--method", "vegas", "--gamma", "0"], "--gamma"),
        (["--method", "vegas", "--gamma", "64"], "--gamma"),
        (["--method", "vegas", "--tree", "4,x"], "--tree"),
        (["--method", "vegas", "--tree", "8,8"], "64"),
        (["--method", "vegas", "--tree", "2,0"], "branching"),
        (["--method", "plain", "--tree", "2,2"], "--tree"),
        (["--method", "vegas", "--tree", "2,2", "--traversal", "zigzag"], "--traversal"),
        (["--method", "vegas", "--ratio", "0"], "--ratio"),
        (["--method", "vegas", "--ratio", "1.5"], "--ratio"),
        (["--ratio", "0.1"], "--method auto chooses --ratio"),
        (["--method", "plain", "--precision", "approx"], "needs an NSA model"),
        (["--ngram-min", "3", "--ngram-max", "2"], "--ngram-min"),
        (["--method", "medusa"], "medusa"),
        (["--method", "ngram", "--draft-weights", "int8"], "needs a model drafter"),
        (["--draft-weights", "int8"], "--method auto chooses --draft-weights"),
        (["--method", "vegas", "--draft-weights", "int3"], "int3"),
        (["--draft-skip", "3"], "--method auto chooses --draft-skip"),
        (["--method", "vegas", "--draft-skip", "40"], "layer 40 does not exist"),
        (["--method", "vegas", "--draft-skip", "0-29"], "skips all 30 layers"),
        (["--method", "vegas", "--draft-skip", "x"], "takes layers and ranges"),
        (["--method", "vegas", "--draft-skip", "5-2"], "takes layers and ranges"),
        (["--method", "vegas", "--draft-skip", "/nonexistent/skip.json"], "no calibration at"),
        (["--method", "full"], "needs a cheaper draft model"),
        (["--method", "vegas", "--select-every", "0"], "--select-every must be"),
        (["--method", "stream", "--select-every", "2"], "stream selects otherwise"),
        (["--method", "eagle", "--draft-model", "/nonexistent/head"], "/nonexistent/head"),
        (["--draft-model", "/nonexistent/head"], "/nonexistent/head"),
        (["--method", "vegas", "--draft-model", "/nonexistent/head"], "drafts with --method eagle (or auto)"),
        (["--method", "ngram", "--draws", "top"], "ngram draws none"),
        (["--draws", "top"], "--method auto chooses --draws"),
        (["--method", "vegas", "--draws", "best"], "--draws"),
        (["--max-new-tokens", "many"], "many"),
        (["--prompt-file", "/nonexistent/prompt.txt"], "prompt file"),
        (["--model", "/nonexistent/model"], "/nonexistent/model"),
    ],
)
def test_bad_arguments(capsys, monkeypatch, args, fragment):
    """Each is found before the weights load, those checked against the model from its config alone."""
    from jaxspec import loaders

    def weights_loaded(*_args, **_kwargs):
        raise AssertionError("the weights were loaded before the arguments were checked")

    monkeypatch.setattr(loaders, "load_model", weights_loaded)
    assert_one_line_error(generate_here(capsys, *args), fragment)


@pytest.mark.parametrize("args, fragment", [(["--top-p", "1.5"], "top_p"), (["--method", "vegas", "--draft-skip", "40"], "layer 40")])
def test_bad_arguments_in_their_own_process(args, fragment):
    """As a user meets them: an argument checked before the model loads, and one checked against it."""
    assert_one_line_error(generate(*args), fragment)


def test_bad_model_files(capsys, tmp_path, hf_checkpoints):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(random.Random(181).randbytes(4096))
    assert_one_line_error(generate_here(capsys, "--model", str(garbage)), "garbage.gguf")

    mistral = tmp_path / "mistral"
    mistral.mkdir()
    config = json.loads((hf_checkpoints["llama"] / "config.json").read_text())
    (mistral / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    assert_one_line_error(generate_here(capsys, "--model", str(mistral)), "mistral")

    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for f in hf_checkpoints["llama"].iterdir():
        data = f.read_bytes()
        (truncated / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".safetensors" else data)
    assert_one_line_error(generate_here(capsys, "--model", str(truncated), "--prompt", "hi"), "safetensors")


def test_prompt_errors(capsys, hf_checkpoints):
    model = str(hf_checkpoints["llama"])
    assert_one_line_error(generate_here(capsys, "--model", model, "--prompt", "  "), "empty prompt")
    long_prompt = " ".join(["word"] * 50)
    assert_one_line_error(generate_here(capsys, "--model", model, "--no-chat", "--prompt", long_prompt, "--max-len", "8"), "--max-len")


def test_prompt_longer_than_the_model_context(capsys, hf_checkpoints):
    long_prompt = " ".join(["word"] * 400)  # the test checkpoints have 256 positions
    assert_one_line_error(generate_here(capsys, "--model", str(hf_checkpoints["llama"]), "--no-chat", "--prompt", long_prompt), "model's context")
    assert_one_line_error(generate_here(capsys, "--model", str(hf_checkpoints["llama"]), "--max-len", "100000"),
                          "--max-len must be in [2, 256]")


@pytest.mark.parametrize("method", ["plain", "auto"])
def test_out_of_device_memory_is_one_line(monkeypatch, hf_checkpoints, capsys, method):
    """XLA's RESOURCE_EXHAUSTED becomes one line that names the KV cache size."""
    import jax

    from jaxspec import generate as cli
    from jaxspec.serving.scheduler import Scheduler

    def out_of_memory(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1234 bytes.")

    monkeypatch.setattr(Scheduler, "admit_waiting", out_of_memory)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--model", str(hf_checkpoints["llama"]), "--prompt", "hi", "--max-new-tokens", "4", "--method", method])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1
    assert err[0].startswith("error: out of device memory") and "GiB of KV cache" in err[0]


def test_stream_prints_the_same_greedy_text(capsys):
    """--stream (one prompt through the serving scheduler) prints the text the batch path prints."""
    common = ["--prompt", "Name three colors.", "--max-new-tokens", "20", "--method", "vegas", "--gamma", "3"]
    batch = generate_here(capsys, *common, "--no-stream")
    streamed = generate_here(capsys, *common, "--stream")
    assert batch.returncode == 0 and streamed.returncode == 0, streamed.stderr
    text = lambda r: r.stdout.partition("--- stats ---")[0].strip()
    assert text(streamed) == text(batch) and text(batch)
    assert "streamed" in streamed.stdout and "tokens/iteration" in streamed.stdout
    assert_one_line_error(generate_here(capsys, *common, "--stream", "--json"), "--stream prints one prompt")


def tiny_args(model, *args: str) -> list[str]:
    return ["--model", str(model), "--prompt", "The quick brown fox jumps over the lazy dog.", "--max-new-tokens", "12",
            "--max-len", "64", "--json", *args]


def test_approximate_precision_is_announced_and_reported(capsys, nsa_checkpoints):
    """--precision approx on an NSA model says NOT lossless on stderr and in the human stats, and its
    JSON stats carry `lossless: false` and the class; strict's say lossless."""
    model = nsa_checkpoints["nsa"]
    common = tiny_args(model, "--method", "vegas", "--gamma", "3", "--min-tokens", "16")
    approx = generate_here(capsys, *common, "--precision", "approx")
    assert approx.returncode == 0, approx.stderr
    assert "precision approx: NOT lossless" in approx.stderr
    stats = json.loads(approx.stdout)["stats"]
    assert (stats["precision"], stats["lossless"]) == ("approx", False)
    human = generate_here(capsys, *[a for a in common if a != "--json"], "--precision", "approx")
    assert "precision        approx: NOT lossless" in human.stdout and "NOT lossless" in human.stderr
    strict = generate_here(capsys, *common)
    assert strict.returncode == 0 and "NOT lossless" not in strict.stderr + strict.stdout
    assert (json.loads(strict.stdout)["stats"]["precision"], json.loads(strict.stdout)["stats"]["lossless"]) == ("strict", True)


def test_draft_skip_calibrated_reads_the_saved_file(capsys, tmp_path, hf_checkpoints):
    """`--draft-skip calibrated` reads the skip list saved beside the model (calibrate_skip's default
    --out), drafts without those layers, and still emits plain's tokens."""
    import shutil

    from jaxspec.calibrate_skip import SKIP_FILE

    model = tmp_path / "llama"
    shutil.copytree(hf_checkpoints["llama"], model)
    (model / SKIP_FILE).write_text(json.dumps({"skip": [1]}))
    plain = run_json(capsys, *tiny_args(model, "--method", "plain"))
    skipping = run_json(capsys, *tiny_args(model, "--method", "vegas", "--gamma", "3", "--draft-skip", "calibrated"))
    assert skipping["stats"]["draft_skip"] == [1] and skipping["stats"]["draft_tokens"] > 0
    assert [r["tokens"] for r in skipping["results"]] == [r["tokens"] for r in plain["results"]]


@pytest.mark.slow  # a duplicate: serve --tp loads through the same `load` onto a mesh (test_server), and
# test_tensor_parallel runs run_generation under a mesh
def test_tensor_parallel_generate_equals_one_device(capsys, hf_checkpoints):
    """`generate --tp 2` (conftest's simulated CPU devices) emits the tokens of one device, speculative."""
    import jax

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (conftest asks XLA for 4 simulated CPU devices)")
    args = tiny_args(hf_checkpoints["llama"], "--method", "vegas", "--gamma", "3", "--min-tokens", "8")
    one, two = run_json(capsys, *args), run_json(capsys, *args, "--tp", "2")
    assert two["stats"]["tp"] == 2 and one["stats"]["tp"] == 1
    assert [r["tokens"] for r in two["results"]] == [r["tokens"] for r in one["results"]]


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2: the head whole on each device
def test_eagle_draft_model_is_lossless(capsys, tmp_path, hf_checkpoints, llama_deep_head, tp):
    """`--method eagle --draft-model DIR` (a head in the public layout) emits plain's tokens, on one
    device and tensor-parallel over 2 (the head whole on each); so does `--method auto` with the head,
    given a planner table that measured it (auto then starts with eagle); a table that measured another
    head plans plain and says how to profile this one."""
    import jax

    from jaxspec.loaders import load_config
    from jaxspec.loaders.eagle import head_fingerprint
    from jaxspec.planner import Strategy, tables

    if len(jax.devices()) < tp:
        pytest.skip(f"needs {tp} devices")
    model = hf_checkpoints["llama_deep"]
    head = llama_deep_head
    plain = run_json(capsys, *tiny_args(model, "--method", "plain", "--dtype", "float32"))
    eagle = tiny_args(model, "--method", "eagle", "--draft-model", str(head), "--gamma", "3", "--dtype", "float32")
    for run in [run_json(capsys, *eagle, "--tp", str(tp))]:
        assert run["stats"]["method"] == "eagle" and run["stats"]["draft_tokens"] > 0
        assert [r["tokens"] for r in run["results"]] == [r["tokens"] for r in plain["results"]]
    if tp == 1:
        table = tables.new_table(load_config(str(model), "float32"), "test", "cpu", "reference", {"new_tokens": 12})
        measured = lambda strategy, rate, tpi: {"strategy": strategy.to_json(), "tokens_per_s": rate, "runs": 3,
                                                "tokens_per_iteration": tpi, "iteration_s": tpi / rate}
        tables.set_cell(table, 1, "greedy", 1024, "strict", [measured(Strategy(), 100, 1), {
            **measured(Strategy("eagle", gamma=3), 300, 3), "head": head_fingerprint(head)}])
        tables.save_table(tmp_path / "table.json", table)
        auto_args = tiny_args(model, "--draft-model", str(head), "--dtype", "float32", "--planner-table",
                              str(tmp_path / "table.json"))
        measured_here = generate_here(capsys, *auto_args)
        auto = json.loads(measured_here.stdout)
        assert auto["stats"]["planned"]["strategy"] == "eagle g3" and auto["stats"]["lossless"]
        assert [r["tokens"] for r in auto["results"]] == [r["tokens"] for r in plain["results"]]
        assert "measured another draft head" not in measured_here.stderr
        # a head the table never measured where it measured another: auto plans without it and says how to profile it
        next(e for e in table["cells"][0]["ranked"] if e["strategy"]["method"] == "eagle")["head"] = "eagle3-another"
        tables.save_table(tmp_path / "table.json", table)
        unmeasured = generate_here(capsys, *auto_args)
        assert unmeasured.returncode == 0 and json.loads(unmeasured.stdout)["stats"]["planned"]["strategy"] == "plain"
        assert f"measured another draft head than {head} for runs like this one" in unmeasured.stderr
        assert f"--eagle-cells --draft-model {head} --out {tmp_path / 'table.json'}" in unmeasured.stderr


def test_method_eagle_finds_the_shipped_head(capsys, hf_checkpoints):
    """`--method eagle` without --draft-model drafts with the head shipped for the model (smollm2's in
    checkpoints/); a model without one is a one-line error naming the flag."""
    from argparse import Namespace

    from jaxspec.generate import head_path
    from jaxspec.loaders.eagle import shipped_head

    assert shipped_head("smollm2") is not None and (shipped_head("smollm2") / "model.safetensors").is_file()
    assert head_path(Namespace(model="smollm2", method="eagle", draft_model=None)) == shipped_head("smollm2")
    assert head_path(Namespace(model="smollm2", method="auto", draft_model=None)) == shipped_head("smollm2")
    assert head_path(Namespace(model="smollm2", method="vegas", draft_model=None)) is None
    result = generate_here(capsys, *tiny_args(hf_checkpoints["llama_deep"], "--method", "eagle"))
    assert_one_line_error(result, "needs a draft head")
