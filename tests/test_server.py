"""`python -m jaxspec.serve` as users run it: a real server on 127.0.0.1, driven by the real `openai`
client (and raw HTTP for what the client cannot send).

Two servers on a tiny random Llama checkpoint: `main` (vegas, 4 slots) and `small` (plain, 1 slot, a
queue of 1, for the queue limit, disconnects and shutdown). Greedy requests, alone or among others
(admitted mid-flight into freed slots), emit plain greedy decoding's tokens, computed in the test
process; sampled requests with a seed repeat; streams concatenate to the whole response; bad input is
a 400 with an OpenAI-style body while the requests in flight complete.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request

import numpy as np
import pytest

openai = pytest.importorskip("openai")

MAX_LEN = 256
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jaxspec.serve", "--model", str(model), "--served-model-name", "tiny",
             "--max-len", str(MAX_LEN), "--port", str(self.port), *flags],
            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        deadline = time.time() + 600
        while True:
            try:
                if self.get("/health")[0] == 200:
                    break
            except OSError:
                pass
            if self.process.poll() is not None or time.time() > deadline:
                self.process.kill()
                raise RuntimeError(f"the server did not start: {self.process.stderr.read()}")
            time.sleep(0.5)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path: str, body: bytes) -> tuple[int, dict]:
        request = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def metric(self, name: str) -> float:
        text = self.get("/metrics")[1]
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=120)


@pytest.fixture(scope="module")
def model(hf_checkpoints):
    return hf_checkpoints["llama"]


@pytest.fixture(scope="module")
def main(model):
    server = Server(model, "--method", "vegas", "--gamma", "3", "--min-tokens", "16", "--slots", "4", "--queue", "64",
                    "--admit-rows", "2", "--prefill-chunk", "16")  # group admission and chunked prefill
    yield server
    server.stop()


@pytest.fixture(scope="module")
def small(model):
    server = Server(model, "--method", "plain", "--slots", "1", "--queue", "1")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def plain_greedy(model):
    """tokens(ids, n): plain greedy decoding of n tokens in this process (the reference)."""
    from jaxspec.decoding.sampling import SamplingConfig
    from jaxspec.decoding.spec import SpecConfig
    from jaxspec.loaders import load_model
    from jaxspec.runner import Batch, run_generation

    cfg, params, tokenizer = load_model(str(model), dtype="float32")

    def tokens(ids: list[int], n: int) -> list[int]:
        batch = Batch(np.asarray([ids], np.int32), np.asarray([len(ids)], np.int32))
        run = run_generation(params, cfg, batch, spec=SpecConfig(), sampling=SamplingConfig(), max_len=MAX_LEN,
                             max_new_tokens=n, stop_ids=tokenizer.eos_token_ids)
        return run.generated()[0].tolist()

    tokens.tokenizer = tokenizer
    return tokens


# Greedy, the random model ends prompts 0, 1, 2 and 7 within 62 tokens, and 3 to 6 not within 200.
PROMPTS = ["The quick brown fox", "Speculative decoding drafts tokens", "def add(a, b):", "In 2024 there were",
           "Paris is the capital", "emoji and tabs", "user: What is", "jumps over the lazy dog"]


def complete(server: Server, prompt, max_tokens: int, **kw):
    return server.client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, **kw)


def test_models_health_and_metrics(main):
    assert main.get("/health") == (200, '{"status":"ok"}')
    models = main.client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].max_model_len == MAX_LEN and models.data[0].jaxspec["method"] == "vegas"
    status, text = main.get("/metrics")
    assert status == 200 and "jaxspec_requests_running 0" in text and 'jaxspec_accepted_by_depth_total{depth="3"}' in text


def test_greedy_completion_is_plain_decoding(main, plain_greedy):
    ids = plain_greedy.tokenizer.encode(PROMPTS[0], add_special_tokens=True)
    want = plain_greedy(ids, 40)
    out = complete(main, PROMPTS[0], 40, temperature=0)
    choice = out.choices[0]
    assert choice.token_ids == [t for t in want if t not in plain_greedy.tokenizer.eos_token_ids]
    assert choice.text == plain_greedy.tokenizer.decode(want, skip_special_tokens=True)
    assert choice.finish_reason == ("length" if len(want) == 40 else "stop")
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == len(choice.token_ids)
    assert out.usage.jaxspec["iterations"] > 0 and len(out.usage.jaxspec["acceptance_by_depth"]) == 3
    by_ids = complete(main, ids, 40, temperature=0)  # a prompt of token ids
    assert by_ids.choices[0].token_ids == choice.token_ids


def test_concurrent_requests_equal_each_alone(main, plain_greedy):
    """Eight greedy requests of different lengths on four slots: later ones are admitted into slots
    freed mid-flight; each emits exactly its plain greedy tokens."""
    lengths = [30, 5, 50, 12, 25, 8, 40, 17]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: complete(main, PROMPTS[i], lengths[i], temperature=0), range(8)))
    for i, out in enumerate(outs):
        ids = plain_greedy.tokenizer.encode(PROMPTS[i], add_special_tokens=True)
        want = [t for t in plain_greedy(ids, lengths[i]) if t not in plain_greedy.tokenizer.eos_token_ids]
        assert out.choices[0].token_ids == want, i


def test_seeded_sampling_repeats_alone_and_among_others(main):
    kw = dict(temperature=0.9, top_p=0.9, seed=1234)
    alone = complete(main, PROMPTS[1], 30, **kw).choices[0].token_ids
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(complete, main, PROMPTS[j], 30, temperature=1.0) for j in (2, 3, 4)]
        among = complete(main, PROMPTS[1], 30, **kw).choices[0].token_ids
        [f.result() for f in others]
    assert among == alone
    assert complete(main, PROMPTS[1], 30, temperature=0.9, top_p=0.9, seed=99).choices[0].token_ids != alone
    extra = main.client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=0.8,
                                           extra_body={"top_k": 5, "min_p": 0.05})
    assert extra.usage.completion_tokens > 0


def test_streams_concatenate_to_the_whole_response(main):
    whole = complete(main, PROMPTS[4], 40, temperature=0)
    chunks = list(complete(main, PROMPTS[4], 40, temperature=0, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 2 and "".join(texts) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason and chunks[-1].usage.completion_tokens == 40
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    chat = main.client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0, logprobs=False)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens > 0
    stream = main.client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == chat.choices[0].message.content


def test_stop_strings_and_stop_token_ids(main, plain_greedy):
    ids = plain_greedy.tokenizer.encode(PROMPTS[3], add_special_tokens=True)
    want = [t for t in plain_greedy(ids, 40) if t not in plain_greedy.tokenizer.eos_token_ids]
    text = plain_greedy.tokenizer.decode(want, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = complete(main, PROMPTS[3], 40, temperature=0, stop=[stop])
    assert out.choices[0].text == text[: text.index(stop)] and out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in complete(main, PROMPTS[3], 40, temperature=0, stop=stop, stream=True))
    assert streamed == out.choices[0].text
    by_id = main.client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=40, temperature=0,
                                           extra_body={"stop_token_ids": [want[5]]})
    assert by_id.choices[0].token_ids == want[: want.index(want[5])] and by_id.choices[0].finish_reason == "stop"


BAD = [
    (b"{not json", "not valid JSON"),
    (b'["a list"]', "JSON object"),
    (json.dumps({"prompt": "hi", "max_tokens": 4, "frobnicate": 1}).encode(), "unknown field 'frobnicate'"),
    (json.dumps({"prompt": "hi", "temperature": 2.5}).encode(), "temperature"),
    (json.dumps({"prompt": "hi", "top_p": 0}).encode(), "top_p"),
    (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"prompt": "hi", "n": 2}).encode(), "n must be"),
    (json.dumps({"prompt": "hi", "ignore_eos": 1}).encode(), "ignore_eos must be"),
    (json.dumps({"prompt": "hi", "top_k": 1000}).encode(), "top_k 1000"),
    (json.dumps({"prompt": "hi", "presence_penalty": 0.5}).encode(), "presence_penalty is not supported"),
    (json.dumps({"prompt": "hi", "logprobs": 2}).encode(), "logprobs is not supported"),
    (json.dumps({"prompt": ""}).encode(), "prompt is empty"),
    (json.dumps({"prompt": [5, 100000]}).encode(), "outside the vocabulary"),
    (json.dumps({"prompt": "word " * 400}).encode(), "context"),
    (json.dumps({"prompt": "hi", "max_tokens": MAX_LEN}).encode(), "context"),
    (b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", "is not valid JSON text"),  # > 4,300 digits: json's own limit
    (b'{"prompt": "hi", "top_k": 1' + b"0" * 400 + b"}", "top_k 1" + "0" * 20),  # > a float: compared exactly
    (b'{"prompt": "hi", "max_tokens": 1e400}', "max_tokens must be"),
    (b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", "is not valid JSON text"),
    (b'{"prompt": "\\ud800 alone"}', "is not valid JSON text"),  # a lone surrogate is no text
    (json.dumps({"prompt": "hi", "stop_token_ids": 0}).encode(), "stop_token_ids must be"),
    (json.dumps({"prompt": "hi", "stream_options": {"include_usage": "yes"}}).encode(), "stream_options"),
    (json.dumps({"prompt": "hi", "user": 5}).encode(), "user must be"),
    (json.dumps({"prompt": "hi", "model": None}).encode(), "model must be a string"),
]


def test_bad_requests_are_400s_and_others_complete(main):
    """Every bad request is a 400 with an OpenAI error body, while a streamed request runs beside them."""
    result = {}
    runner = threading.Thread(target=lambda: result.update(
        out="".join(c.choices[0].text for c in complete(main, PROMPTS[5], 60, temperature=0, stream=True))))
    runner.start()
    for body, fragment in BAD:
        status, answer = main.post("/v1/completions", body)
        assert status == 400, (body, answer)
        assert fragment in answer["error"]["message"] and answer["error"]["type"] == "invalid_request_error", answer
    status, answer = main.post("/v1/chat/completions", json.dumps({"messages": []}).encode())
    assert status == 400 and answer["error"]["param"] == "messages"
    status, answer = main.post("/v1/completions", json.dumps({"prompt": "x" * (70_000 + 64 * MAX_LEN)}).encode())
    assert status == 413 and "larger than this server takes" in answer["error"]["message"]
    for path, want in (("/v1/nope", 404), ("/v1/completions/", 404), ("/health", 405)):
        status, answer = main.post(path, b"{}")  # unknown routes and methods: OpenAI-style errors too
        assert status == want and answer["error"]["type"] == "invalid_request_error", (path, answer)
    with pytest.raises(openai.NotFoundError):
        main.client.completions.create(model="other", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        main.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=-1)
    runner.join()
    assert result["out"]
    assert main.get("/health")[0] == 200


def test_load_64_requests_on_4_slots(main):
    """64 concurrent requests against 4 slots and a queue of 64: all complete, none lost, all counted."""
    before = main.metric("jaxspec_requests_total")
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        outs = list(pool.map(lambda i: complete(main, PROMPTS[i % 8], 4 + i % 5, temperature=0.7, seed=i), range(64)))
    assert [o.usage.completion_tokens for o in outs if o.choices[0].finish_reason == "length"] == \
        [4 + i % 5 for i, o in enumerate(outs) if o.choices[0].finish_reason == "length"]
    assert main.metric("jaxspec_requests_total") - before == 64
    assert main.metric("jaxspec_requests_running") == 0 and main.metric("jaxspec_requests_waiting") == 0


def test_queue_limit_disconnect_and_drain(small):
    """One slot and a queue of one: of ten requests sent at once, those beyond the slot and the queue
    are 429s and the rest complete; a client that leaves mid-stream frees the slot (the next request
    completes); SIGTERM lets the open request finish, then the server exits 0."""
    rejected = small.metric('jaxspec_requests_total{outcome="rejected"}')

    def attempt(i):
        try:
            return complete(small, PROMPTS[3], 120, temperature=0).usage.completion_tokens
        except openai.RateLimitError:
            return "429"

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        results = list(pool.map(attempt, range(10)))
    assert 0 < results.count("429") < 10 and set(results) == {"429", 120}
    assert small.metric('jaxspec_requests_total{outcome="rejected"}') - rejected == results.count("429")

    cancelled = small.metric('jaxspec_requests_total{outcome="cancelled"}')
    stream = complete(small, PROMPTS[4], 200, temperature=0, stream=True)
    next(iter(stream))
    stream.close()  # the client goes away mid-stream
    out = complete(small, PROMPTS[5], 6, temperature=0)  # served: the slot came back
    assert out.usage.completion_tokens == 6
    deadline = time.time() + 30
    while small.metric('jaxspec_requests_total{outcome="cancelled"}') == cancelled and time.time() < deadline:
        time.sleep(0.2)
    assert small.metric('jaxspec_requests_total{outcome="cancelled"}') == cancelled + 1

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(complete, small, PROMPTS[6], 150, temperature=0)
        time.sleep(1.0)
        small.process.send_signal(signal.SIGTERM)
        assert pending.result().usage.completion_tokens == 150
    assert small.process.wait(timeout=120) == 0
    assert "stopped" in small.process.stderr.read()


@pytest.mark.parametrize("flags,fragment", [
    (["--slots", "0"], "--slots must be at least 1"),
    (["--method", "vegas", "--tree", "0,2"], "tree"),
    (["--model", "/nonexistent/model.gguf"], "nonexistent"),
    (["--page-size", "96"], "--page-size: page size must be a positive multiple of 64, got 96"),
    (["--max-len", "512", "--kv-pages", "4"], "holds fewer than one request of --max-len 512"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--host", "999.1.1.1"], "cannot listen on 999.1.1.1"),
])
def test_bad_command_lines_are_one_line_errors(flags, fragment):
    result = subprocess.run([sys.executable, "-m", "jaxspec.serve", *flags], capture_output=True, text=True, env=ENV, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines[-1].startswith("error:") and fragment in lines[-1], result.stderr
    assert "Traceback" not in result.stderr


def test_a_port_in_use_is_a_one_line_error_before_the_weights_load(monkeypatch, capsys):
    from jaxspec import loaders, serve

    monkeypatch.setattr(loaders, "load_model", lambda *a, **k: pytest.fail("the weights loaded"))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        with pytest.raises(SystemExit) as e:
            serve.main(["--port", str(taken.getsockname()[1])])
    assert e.value.code == 2 and "cannot listen on 127.0.0.1" in capsys.readouterr().err


def test_start_up_line_says_what_the_pool_holds():
    """The pool's requests of the whole context (page 0 is null), and the cost of more slots than that
    unless --shrink is on."""
    from jaxspec.serve import describe_pool

    assert describe_pool(4 * 9 + 1, 9, 128, 4, False) == "37 KV pages of 128 tokens: 4 requests of the whole context at once"
    short = describe_pool(4 * 9, 9, 128, 4, False)
    assert short.startswith("36 KV pages of 128 tokens: 3 requests") and "each iteration still decodes 4 rows" in short
    assert "--shrink" not in describe_pool(4 * 9, 9, 128, 4, True)


def test_model_flags_fail_before_the_weights_load(monkeypatch, capsys):
    """A flag that does not fit the model (a --draft-skip layer it lacks) fails from its config alone."""
    from jaxspec import loaders, serve

    monkeypatch.setattr(loaders, "load_model", lambda *_a, **_k: pytest.fail("the weights were loaded"))
    with pytest.raises(SystemExit) as info:
        serve.main(["--method", "vegas", "--draft-skip", "40"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and err[-1].startswith("error:") and "layer 40 does not exist" in err[-1]


@pytest.mark.slow  # the default run's 20 minutes: --tp's tokens are test_tensor_parallel's, the server's path the others here
def test_tensor_parallel_server_emits_plain_decoding(monkeypatch, model, plain_greedy, capsys):
    """`serve --tp 2` (conftest's simulated CPU devices), in this process: the weights split over two
    devices, a greedy speculative completion emits plain greedy decoding's tokens."""
    import jax
    from starlette.testclient import TestClient

    from jaxspec import serve

    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (conftest asks XLA for 4 simulated CPU devices)")
    replies = []

    def one_request(self):  # instead of listening on a port: one request through the app
        with TestClient(self.config.app) as client:
            replies.append(client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 16,
                                                                "temperature": 0}).json())

    monkeypatch.setattr(serve.DrainingServer, "run", one_request)
    # uvicorn's config sets up logging with dictConfig, which closes pytest's log-capture handlers
    monkeypatch.setattr(serve.uvicorn, "Config", lambda app, **_: types.SimpleNamespace(app=app))
    serve.main(["--model", str(model), "--served-model-name", "tiny", "--max-len", str(MAX_LEN), "--tp", "2",
                "--method", "vegas", "--gamma", "3", "--min-tokens", "16", "--slots", "2", "--warm-up-tokens", "8"])
    assert "stopped" in capsys.readouterr().err
    ids = plain_greedy.tokenizer.encode(PROMPTS[3], add_special_tokens=True)
    want = [t for t in plain_greedy(ids, 16) if t not in plain_greedy.tokenizer.eos_token_ids]
    choice = replies[0]["choices"][0]
    assert choice["token_ids"] == want and replies[0]["usage"]["jaxspec"]["iterations"] > 0
