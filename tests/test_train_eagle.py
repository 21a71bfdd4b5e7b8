"""Training an EAGLE-3 head (jaxspec.training.eagle, python -m jaxspec.train_eagle) on tiny dense and NSA targets.

The training-time test's forward is the inference head's: step 0 is `eagle.feature_forward` over the
same rows, and step k's row t is the state the engine's drafter reaches at draft depth k after
position t along the true tokens (`eagle.head_forward` one row at a time on a cache holding rows
0..t only, positions as `decoding.drafters.eagle` places them). A few steps reduce the loss; the
saved head reloads to the same outputs; the CLI self-distils, trains, resumes an interrupted run to
the same head, and turns bad inputs (and a step the device cannot hold) into one line and exit code 2
with nothing half-written.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import train_eagle
from jaxspec.loaders import hf, load_model
from jaxspec.loaders.eagle import head_fingerprint, load_eagle, save_eagle
from jaxspec.models import decoder, eagle
from jaxspec.models.config import ModelConfig, NSAConfig
from jaxspec.tokenizer import Tokenizer
from jaxspec.training import eagle as training

CFG = ModelConfig(model_type="qwen3", vocab_size=256, hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=128, qk_norm=True, dtype="float32")
# An NSA target whose 16-token windows are sparse (4 selected blocks of 2, a window of 4): a head for
# an NSA model trains on that model's own features (the dense model's head accepts less there)
NSA = ModelConfig(model_type="llama-nsa", vocab_size=256, hidden_size=64, num_layers=8, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=128, max_position_embeddings=256, dtype="float32",
                  nsa=NSAConfig(block_size=2, block_counts=2, window_size=4, topk_rule="exact"))


@pytest.fixture(scope="module", params=[CFG, NSA], ids=["qwen3", "nsa"])
def target(request):
    cfg = request.param
    params = decoder.init_params(cfg, jax.random.key(0), scale=0.4)  # peaked next-token distributions
    ecfg = training.head_config(cfg, 96)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    return cfg, params, ecfg, tokens


def test_ttt_forward_is_the_inference_head(target):
    cfg, params, ecfg, tokens = target
    head = eagle.init_params(jax.random.key(2), ecfg, jnp.float32, scale=0.1)
    B, T = tokens.shape
    steps = 3
    _, features = decoder.score(params, cfg, tokens, capture=ecfg.feature_layers)
    outs = jax.jit(eagle.ttt_forward, static_argnums=(1, 3, 6))(head, ecfg, params, cfg, tokens, features, steps)
    assert outs.shape == (steps, B, T - 1, ecfg.hidden_size)

    positions = jnp.broadcast_to(jnp.arange(T - 1, dtype=jnp.int32), (B, T - 1))

    @jax.jit
    def committed(t):  # the head's pass over rows 0..t only (the cache a draft after position t reads)
        return eagle.feature_forward(head, ecfg, params, cfg, tokens[:, 1:], features[:, :-1], positions,
                                     positions <= t, eagle.init_cache(ecfg, B, T + steps, "float32"))

    @jax.jit
    def depth(token, hidden, pos, cache):  # one draft row per batch row, as the engine's chain drafts it
        return eagle.head_forward(head, ecfg, eagle.token_embeds(head, params, cfg, token), hidden, pos,
                                  jnp.ones((B, 1), bool), cache)

    out0, _ = committed(T - 2)
    np.testing.assert_allclose(outs[0], out0, rtol=1e-4, atol=1e-4)
    for t in (0, 4, T - 2 - steps):
        out, cache = committed(t)
        h = out[:, t:t + 1]
        for k in range(1, steps):
            h, cache = depth(tokens[:, t + k + 1, None], h, jnp.full((B, 1), t + k, jnp.int32), cache)
            np.testing.assert_allclose(outs[k][:, t:t + 1], h, rtol=1e-4, atol=1e-4, err_msg=f"t {t}, step {k}")


@pytest.mark.parametrize("shared", [False, True], ids=["own_lm_head", "shared_lm_head"])
def test_a_few_steps_reduce_the_loss_and_the_head_reloads(target, tmp_path, shared):
    """`shared`: a head through the target's LM head over the whole vocabulary (nothing of it to train
    but the layer), saved without an LM head."""
    cfg, params, ecfg, _ = target
    if shared:
        ecfg = training.head_config(cfg, cfg.vocab_size, shared_lm_head=True)
    stream = np.random.default_rng(3).integers(0, cfg.vocab_size, 16).astype(np.int32)  # one window: every batch
    ids = training.draft_vocabulary(stream, cfg.vocab_size, ecfg.draft_vocab_size)
    head = training.init_head(jax.random.key(4), ecfg, ids)
    settings = training.Settings(tokens=len(stream), steps=8, batch=2, seq=16, ttt=3, lr=1e-2, warmup=2)
    trainable, d2t = training.trainable_part(head), head["d2t"]
    opt, _ = training.make_step(cfg, ecfg, settings.ttt, settings.lr, settings.steps, settings.warmup)
    history = []
    trainable, _ = training.train(cfg, params, ecfg, stream, trainable, opt.init(trainable), d2t, settings,
                                  history=history)
    assert history[-1]["step"] == 8 and len(history[0]["acc"]) == 3
    assert history[-1]["loss"] < 0.8 * history[0]["loss"], [r["loss"] for r in history]

    trained = {**trainable, "d2t": d2t}
    save_eagle(tmp_path / "head", ecfg, trained)
    loaded_cfg, loaded = load_eagle(tmp_path / "head", cfg, "float32")
    assert loaded_cfg == ecfg
    hidden = jax.random.normal(jax.random.key(5), (1, 3, ecfg.hidden_size))
    np.testing.assert_array_equal(eagle.draft_logits(loaded, ecfg, params, cfg, hidden),
                                  eagle.draft_logits(trained, ecfg, params, cfg, hidden))
    np.testing.assert_array_equal(loaded["d2t"], ids - np.arange(len(ids)))
    assert ("lm_head" in trainable) != shared and not (shared and loaded["d2t"].any())


def test_draft_vocabulary_is_the_most_frequent_tokens_sorted():
    stream = np.array([5, 5, 5, 2, 2, 9, 9, 9, 9, 7], np.int32)
    np.testing.assert_array_equal(training.draft_vocabulary(stream, 10, 3), [2, 5, 9])
    np.testing.assert_array_equal(training.draft_vocabulary(stream, 10, 6), [0, 1, 2, 5, 7, 9])  # then unseen, by id
    assert training.default_draft_vocab(49152) == 12288 and training.default_draft_vocab(151936) == 32768


# ---------------------------------------------------------------------------------------------------
# The CLI on a tiny HF model of 8 layers (with the llama tokenizer of conftest's hf_checkpoints)


@pytest.fixture(scope="module")
def tiny_model(hf_checkpoints, tmp_path_factory):
    cfg = ModelConfig(model_type="llama", vocab_size=400, hidden_size=32, num_layers=8, num_heads=4, num_kv_heads=2,
                      head_dim=8, intermediate_size=64, max_position_embeddings=256, dtype="float32")
    path = tmp_path_factory.mktemp("tiny8")
    hf.write_hf(path, cfg, decoder.init_params(cfg, jax.random.key(6), scale=0.1),
                Tokenizer.from_hf_dir(hf_checkpoints["llama"]))
    return path


def cli(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    try:
        train_eagle.main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


SMALL = ("--tokens", 200, "--seq", 32, "--steps", 4, "--batch", 2, "--ttt", 2, "--draft-vocab", 64, "--dtype", "float32")
UNSIZED = tuple(x for k, v in zip(SMALL[::2], SMALL[1::2]) if k != "--draft-vocab" for x in (k, v))


def test_cli_trains_and_resumes_to_the_same_head(capsys, monkeypatch, tiny_model, tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    code, err = cli(capsys, "--model", tiny_model, "--out", whole, *SMALL)
    assert code == 0, err
    assert "step 4/4" in err and "data:" in err
    log = json.loads((whole / "train_log.json").read_text())
    assert log["step"] == 4 and log["data_tokens"] >= 200 and log["settings"]["ttt"] == 2
    assert {p.name for p in whole.iterdir()} == {"config.json", "model.safetensors", "train_log.json", "data.npy",
                                                 "train_state"}

    windows, stop = training.windows, [1]

    def interrupted(stream, seq, batch, seed, step):
        if step == stop[0]:
            raise KeyboardInterrupt
        return windows(stream, seq, batch, seed, step)

    monkeypatch.setattr(train_eagle, "CHECKPOINT_EVERY", 2)
    monkeypatch.setattr(training, "windows", interrupted)
    # stopped before the first checkpoint: the data and step 0 are saved, so a resume skips the data
    assert cli(capsys, "--model", tiny_model, "--out", parts, *SMALL)[0] == 130
    assert training.read_record(parts)["step"] == 0 and not (parts / "config.json").exists()
    stop[0] = 3
    code, err = cli(capsys, "--model", tiny_model, "--out", parts, *SMALL, "--resume")
    assert code == 130 and "data:" not in err
    assert training.read_record(parts)["step"] == 2 and not (parts / "config.json").exists()
    stop[0] = None
    state = parts / training.STATE_DIR / "state.json"  # a run saved before --cut-loops existed resumes as one without
    record = json.loads(state.read_text())
    assert record["settings"].pop("cut_loops") is False
    state.write_text(json.dumps(record))
    code, err = cli(capsys, "--model", tiny_model, "--out", parts, *SMALL, "--resume")
    assert code == 0, err
    target_cfg = hf.read_config(tiny_model, "float32")
    (_, a), (_, b) = load_eagle(whole, target_cfg, "float32"), load_eagle(parts, target_cfg, "float32")
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_init_trains_on_from_a_head(capsys, tiny_model, tmp_path):
    """--init starts from a head (its weights, draft vocabulary and config) and records which: with a
    learning rate too small to move anything, the head it writes is the head it started from. Its draft
    vocabulary only grows: a smaller --draft-vocab is a one-line error."""
    first, more = tmp_path / "first", tmp_path / "more"
    assert cli(capsys, "--model", tiny_model, "--out", first, *SMALL)[0] == 0
    code, err = cli(capsys, "--model", tiny_model, "--out", more, *UNSIZED, "--seed", 1, "--lr", 1e-12, "--init", first)
    assert code == 0, err
    assert json.loads((more / "train_log.json").read_text())["init"] == head_fingerprint(first)
    target_cfg = hf.read_config(tiny_model, "float32")
    (ca, a), (cb, b) = load_eagle(first, target_cfg, "float32"), load_eagle(more, target_cfg, "float32")
    assert ca == cb
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-7, err_msg=name)
    code, err = cli(capsys, "--model", tiny_model, "--out", tmp_path / "sized", *UNSIZED, "--draft-vocab", 32,
                    "--init", first)
    assert code == 2 and "only grows, from its 64 tokens" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "sized").exists()


def test_init_grows_a_heads_draft_vocabulary(capsys, tiny_model, tmp_path):
    """--init with a larger --draft-vocab: the head keeps its tokens and their columns and takes the
    data's most frequent tokens outside them, each column the least-squares map of the target's
    embedding rows that takes the kept tokens' rows nearest to their columns (a learning rate too small
    to move anything shows the starting head); d2t stays sorted."""
    first, grown = tmp_path / "first", tmp_path / "grown"
    assert cli(capsys, "--model", tiny_model, "--out", first, *SMALL)[0] == 0
    code, err = cli(capsys, "--model", tiny_model, "--out", grown, *UNSIZED, "--draft-vocab", 96, "--lr", 1e-12,
                    "--seed", 1, "--init", first)
    assert code == 0, err
    target_cfg = hf.read_config(tiny_model, "float32")
    (ca, a), (cb, b) = load_eagle(first, target_cfg, "float32"), load_eagle(grown, target_cfg, "float32")
    assert cb == dataclasses.replace(ca, draft_vocab_size=96)
    old_ids, new_ids = (np.asarray(h["d2t"]) + np.arange(len(h["d2t"])) for h in (a, b))
    assert np.all(np.diff(new_ids) > 0) and set(old_ids) <= set(new_ids)
    counts = np.bincount(training.load_data(grown), minlength=target_cfg.vocab_size)
    added = np.setdiff1d(new_ids, old_ids)
    outside = np.setdiff1d(np.arange(target_cfg.vocab_size), old_ids)
    assert counts[added].min() >= counts[np.setdiff1d(outside, added)].max()  # the most frequent outside
    kept = np.searchsorted(new_ids, old_ids)
    np.testing.assert_allclose(b["lm_head"][:, kept], a["lm_head"], rtol=1e-6, atol=1e-7)
    for name in a.keys() - {"lm_head", "d2t"}:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-7, err_msg=name)
    _, target, _ = load_model(str(tiny_model), dtype="float32")
    rows = np.asarray(target["lm_head"]).T if "lm_head" in target else np.asarray(target["embed"])
    to_column, *_ = np.linalg.lstsq(rows[old_ids].astype(np.float64), np.asarray(a["lm_head"], np.float64).T,
                                    rcond=None)
    np.testing.assert_allclose(b["lm_head"][:, np.searchsorted(new_ids, added)], (rows[added] @ to_column).T,
                               rtol=1e-4, atol=1e-5)


def test_data_generated_apart_are_trained_on_together(capsys, tiny_model, tmp_path):
    """--steps 0 writes the data alone; --data trains on earlier runs' data after this run's new tokens, in
    that order and token for token (a run with --seed 1 generates what the data-only run of seed 1 did)."""
    a, b, both, more = tmp_path / "a", tmp_path / "b", tmp_path / "both", tmp_path / "more"
    for out, seed in ((a, 0), (b, 1)):
        code, err = cli(capsys, "--model", tiny_model, "--out", out, *SMALL, "--steps", 0, "--seed", seed)
        assert code == 0 and "no head" in err, err
        assert {p.name for p in out.iterdir()} == {"data.npy", "train_log.json"}
        assert json.loads((out / "train_log.json").read_text())["data_tokens"] == len(training.load_data(out)) >= 200
    data_a, data_b = training.load_data(a), training.load_data(b)
    assert not np.array_equal(data_a[:200], data_b[:200])
    code, err = cli(capsys, "--model", tiny_model, "--out", both, *SMALL, "--tokens", 0, "--data", f"{a},{b}")
    assert code == 0 and "data: " in err and "0 new" in err and (both / "config.json").exists(), err
    np.testing.assert_array_equal(training.load_data(both), np.concatenate([data_a, data_b]))
    assert json.loads((both / "train_log.json").read_text())["data"] == [str(a), str(b)]
    code, err = cli(capsys, "--model", tiny_model, "--out", more, *SMALL, "--seed", 1, "--data", a)
    assert code == 0, err
    np.testing.assert_array_equal(training.load_data(more), np.concatenate([data_b, data_a]))


def test_data_of_another_vocabulary_is_one_line_and_writes_nothing(capsys, tiny_model, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    tokens = np.random.default_rng().integers(0, 400, 500).astype(np.int32)
    tokens[np.random.default_rng().integers(500)] = 400  # one id past the vocabulary
    training.write_data(run / training.DATA_FILE, tokens)
    code, err = cli(capsys, "--model", tiny_model, "--out", tmp_path / "head", *SMALL, "--tokens", 0, "--data", run)
    assert code == 2 and "outside the model's vocabulary of 400" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "head").exists()


def test_shared_lm_head_trains_a_head_without_one_and_goes_on_from_a_heads_layer(capsys, tiny_model, tmp_path):
    """--shared-lm-head: the head drafts over the whole vocabulary through the model's LM head and is
    written without one; with --init of a head with its own LM head, the layer goes on (a learning
    rate too small to move anything keeps it exactly) and the LM head is dropped."""
    first, shared, more = tmp_path / "first", tmp_path / "shared", tmp_path / "more"
    target_cfg = hf.read_config(tiny_model, "float32")
    code, err = cli(capsys, "--model", tiny_model, "--out", shared, *UNSIZED, "--shared-lm-head")
    assert code == 0, err
    ecfg, head = load_eagle(shared, target_cfg, "float32")
    assert ecfg.shared_lm_head and ecfg.draft_vocab_size == 400 and "lm_head" not in head and not head["d2t"].any()
    assert json.loads((shared / "train_log.json").read_text())["settings"]["shared_lm_head"] is True
    code, err = cli(capsys, "--model", tiny_model, "--out", tmp_path / "sized", *UNSIZED, "--draft-vocab", 800,
                    "--init", shared)
    assert code == 2 and "drafts over the model's whole vocabulary" in err and len(err.strip().splitlines()) == 1

    assert cli(capsys, "--model", tiny_model, "--out", first, *SMALL)[0] == 0
    code, err = cli(capsys, "--model", tiny_model, "--out", more, *UNSIZED, "--lr", 1e-12, "--init", first,
                    "--shared-lm-head")
    assert code == 0, err
    (ca, a), (cb, b) = load_eagle(first, target_cfg, "float32"), load_eagle(more, target_cfg, "float32")
    assert cb == dataclasses.replace(ca, shared_lm_head=True, draft_vocab_size=400)
    assert b.keys() == a.keys() - {"lm_head"}
    for name in b.keys() - {"d2t"}:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_self_distill_prompts_with_requests_the_target_wrote(tiny_model, monkeypatch):
    """The pre-query template is the chat template up to the user's message; the target's own requests
    are whole messages (they ended with a stop token); and self_distill prompts `chat_share` of a
    round's rows with such requests through the chat template."""
    from jaxspec.loaders import load_model

    cfg, params, tokenizer = load_model(str(tiny_model), "float32")
    prefix = training.query_prefix(tokenizer)
    whole = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}],
                                                           add_generation_prompt=False))
    assert whole[:len(prefix)] == prefix and tokenizer.decode(whole[len(prefix):]).startswith("hello there")
    cfg = dataclasses.replace(cfg, eos_token_ids=tuple(range(0, cfg.vocab_size, 4)))  # a quarter of the ids end a request
    requests = training.asker(cfg, tokenizer, 16, "reference")(params, jax.random.key(0))
    assert 0 < len(requests) <= 16 and all(r == r.strip() and r for r in requests)
    asked = []
    monkeypatch.setattr(training, "asker", lambda *_: lambda params, key: asked.append(key) or ["tell me about fish", "why"])
    stream = training.self_distill(cfg, params, tokenizer, 300, 96, batch=4)
    text = lambda ids: " " + " ".join(map(str, ids)) + " "
    for request in ("tell me about fish", "why"):
        assert text(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": request}]))) in text(stream)
    assert len(asked) >= 1


def test_requests_begin_with_the_openers(tiny_model):
    """With openers, row i's request starts with OPENERS[i % len(OPENERS)]: where every token ends a
    message, each request is its opener alone (the "" rows, empty, left out), in row order."""
    cfg, params, tokenizer = load_model(str(tiny_model), "float32")
    cfg = dataclasses.replace(cfg, eos_token_ids=tuple(range(cfg.vocab_size)))
    rows = len(training.OPENERS) + 3
    requests = training.asker(cfg, tokenizer, rows, "reference", openers=True)(params, jax.random.key(1))
    assert requests == [o for o in (training.OPENERS * 2)[:rows] if o]
    assert training.asker(cfg, tokenizer, rows, "reference")(params, jax.random.key(1)) == []  # Magpie's rows


def loop_cut_by_hand(sequence, prompt_len):
    """training.loop_cut written out: n-grams as tuples in a set, the window counted token by token."""
    n, seen, repeats = training.LOOP_GRAM, set(), []
    for t in range(len(sequence)):
        gram = tuple(sequence[t - n + 1:t + 1]) if t >= n - 1 else None
        repeats.append(gram is not None and gram in seen)
        seen.add(gram)
    for t in range(prompt_len + training.LOOP_WINDOW - 1, len(sequence)):
        if sum(repeats[t - training.LOOP_WINDOW + 1:t + 1]) >= training.LOOP_SHARE * training.LOOP_WINDOW:
            return t + 1
    return len(sequence)


def test_loop_cut_keeps_text_up_to_where_it_repeats_itself():
    rng = np.random.default_rng()
    prompt, novel = rng.integers(0, 1000, 50), rng.integers(0, 1000, 120)
    period = rng.integers(0, 1000, 9)
    looped = np.concatenate([prompt, novel, np.tile(period, 40)])
    cut = training.loop_cut(looped, len(prompt))
    assert cut == loop_cut_by_hand(looped.tolist(), len(prompt))
    # the novel text and the loop's first repetitions stay; the cut falls within a window of its start
    assert len(prompt) + len(novel) + len(period) < cut <= len(prompt) + len(novel) + training.LOOP_WINDOW + len(period)
    fresh = np.concatenate([prompt, rng.integers(0, 1000, 400)])
    assert training.loop_cut(fresh, len(prompt)) == len(fresh)  # nothing repeats: all kept
    copied = np.concatenate([prompt, prompt, prompt[:30]])  # copying the prompt is repeating too
    assert training.loop_cut(copied, len(prompt)) == loop_cut_by_hand(copied.tolist(), len(prompt)) < len(copied)
    short = np.concatenate([prompt, np.tile(period, 5)])  # a continuation shorter than the window
    assert training.loop_cut(short, len(prompt)) == len(short)
    for _ in range(20):  # loops of every kind: the hashed n-grams against the tuples
        parts = [rng.integers(0, 50, int(rng.integers(1, 60))) for _ in range(6)]
        sequence = np.concatenate([np.tile(x, int(rng.integers(1, 6))) for x in parts])
        start = int(rng.integers(0, len(sequence)))
        assert training.loop_cut(sequence, start) == loop_cut_by_hand(sequence.tolist(), start)


def test_self_distill_cuts_each_continuation_where_loop_cut_says(tiny_model, monkeypatch):
    """With cut_loops, each row's sequence is kept up to loop_cut(sequence, its prompt's length): with
    every prompt a known request and loop_cut keeping the prompt and one token, the stream is those."""
    from jaxspec.loaders import load_model

    cfg, params, tokenizer = load_model(str(tiny_model), "float32")
    requests = ["tell me about fish", "why", "how do birds fly", "name three rivers"]
    monkeypatch.setattr(training, "asker", lambda *_: lambda params, key: requests)
    calls = []
    keep_one = lambda x, prompt_len: calls.append((len(x), prompt_len)) or prompt_len + 1
    monkeypatch.setattr(training, "loop_cut", keep_one)
    lines = []
    stream = training.self_distill(cfg, params, tokenizer, 120, 96, batch=4, chat_share=1.0, cut_loops=True,
                                   log=lines.append)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": r}])) for r in requests]
    assert len(calls) % 4 == 0 and [p for _, p in calls] == [len(x) for x in prompts] * (len(calls) // 4)
    assert all(n > p + 1 for n, p in calls)  # the target continued every prompt (no stop among the first tokens)
    at = 0
    for prompt in prompts * (len(calls) // 4):
        assert stream[at:at + len(prompt)].tolist() == prompt
        at += len(prompt) + 1
    assert at == len(stream) >= 120 and "of the generated kept" in lines[-1]


@pytest.mark.parametrize("args, fragment", [
    (("--model", "no/such/model"), "does not exist"),
    (("--tokens", 100), "fewer than 4 sequences"),
    (("--draft-vocab", 401), "--draft-vocab must be in 1..400"),
    (("--shared-lm-head",), "--draft-vocab with --shared-lm-head"),
    (("--ttt", 0), "--ttt >= 1"),
    (("--lr", "inf"), "a finite --lr > 0"),
    (("--chat-share", 1.5), "--chat-share must be in [0, 1]"),
    (("--resume",), "has no train_state"),
    (("--init", "no/such/head"), "is not an EAGLE-3 head"),
    (("--tokens", 0), "--tokens 0 trains on --data alone"),
    (("--data", "no/such/run"), "has no data.npy"),
    (("--steps", 0, "--init", "no/such/head"), "--steps 0 only generates new data"),
    (("--steps", -1), "--steps >= 0"),
])
def test_bad_inputs_are_one_line_and_write_nothing(capsys, tiny_model, tmp_path, args, fragment):
    defaults = {"--model": tiny_model, "--out": tmp_path / "head", **dict(zip(SMALL[::2], SMALL[1::2]))}
    given = dict(zip(args[::2], args[1::2])) if len(args) % 2 == 0 else {args[0]: None}
    argv = [x for k, v in {**defaults, **given}.items() for x in ((k,) if v is None else (k, v))]
    code, err = cli(capsys, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1 and fragment in err, err
    assert not (tmp_path / "head").exists()


def test_out_of_device_memory_is_one_line_and_the_run_resumes(capsys, monkeypatch, tiny_model, tmp_path):
    """A training step that does not fit the device is one line naming --batch and --seq; the data and step 0
    are saved as for an interrupted run, so the same command with --resume goes on from them."""

    def out_of_memory(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 45391589792 bytes.")

    out = tmp_path / "head"
    with monkeypatch.context() as m:
        m.setattr(training, "train", out_of_memory)
        code, err = cli(capsys, "--model", tiny_model, "--out", out, *SMALL)
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("error: out of device memory") and "--batch 2 x --seq 32" in last, err
    assert "Traceback" not in err and "RESOURCE_EXHAUSTED" not in err
    assert training.read_record(out)["step"] == 0 and not (out / "config.json").exists()
    code, err = cli(capsys, "--model", tiny_model, "--out", out, *SMALL, "--resume")
    assert code == 0 and "data:" not in err and (out / "config.json").exists(), err


def test_out_that_is_a_file_or_not_empty(capsys, tiny_model, tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("keep me")
    for out, fragment in ((tmp_path / "file", "is a file"), (tmp_path / "full", "is not empty")):
        code, err = cli(capsys, "--model", tiny_model, "--out", out, *SMALL)
        assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "full" / "notes.txt").read_text() == "keep me"
