"""Tokenizer: GGUF-built BPE against llama.cpp (the reference for GGUF files) and transformers'
conversion, HF tokenizer.json against transformers, chat templates against `apply_chat_template`,
and the end-of-sequence ids."""

from __future__ import annotations

import re

import numpy as np
import pytest

from jaxspec.errors import JaxspecError
from jaxspec.loaders.gguf import read_metadata
from jaxspec.serving.text import CONTEXT, TextStream
from jaxspec.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "",
    " ",
    "Hello, World! HELLO world... hello?!",
    "I'm sure you'll see we've DON'T they'd it's",
    "in 2024, 3.14159 and 1,000,000 or 0x1F; 12345678901234567890",
    "x  1",
    "a   12   b\t\t7\n\n 8",
    "  leading and trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "émoji 🤖🚀 中文 日本語のテキスト 한국어 Ελληνικά русский العربية",
    "Zero\u200bwidth and\u00a0nbsp and combining e\u0301",
    "def f(x):\n    return x**2  # comment\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i] * 2; }",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>glued<|endoftext|>more<repo_name>x",
    "<|im_sta partial special <|im_end",
    "https://example.com/path?query=1&other=two#frag",
    "$100.50 + 20% = ??? !!! ... ---",
]


def without_space_runs_before_digits(texts):
    """transformers' GGUF conversion drops SmolLM's Digits pre-tokenizer; it differs from llama.cpp (and
    from SmolLM2's own tokenizer.json) only where two or more whitespace characters precede a digit."""
    return [t for t in texts if not re.search(r"\s{2,}\d", t)]


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_loaded) -> Tokenizer:
    return smollm2_loaded[2]


@pytest.fixture(scope="module")
def smollm2_metadata(smollm2_gguf) -> dict:
    import gguf

    return read_metadata(gguf.GGUFReader(smollm2_gguf))


def llama_cpp_vocab(path):
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def llama_cpp_encode(vocab, text: str) -> list[int]:
    return vocab.tokenize(text.encode(), add_bos=False, special=True)


def test_gguf_tokenizer_matches_llama_cpp(smollm2_gguf, smollm2_tokenizer):
    vocab = llama_cpp_vocab(smollm2_gguf)
    for text in TEXTS:
        assert smollm2_tokenizer.encode(text) == llama_cpp_encode(vocab, text), text


def test_gguf_tokenizer_matches_transformers(smollm2_tokenizer, smollm2_hf_tokenizer):
    for text in without_space_runs_before_digits(TEXTS):
        assert smollm2_tokenizer.encode(text) == smollm2_hf_tokenizer.encode(text, add_special_tokens=False), text
    # SmolLM2's tokenizer.json splits digits before the byte-level regex: "x  1" -> x, "  ", 1.
    assert smollm2_tokenizer.encode("x  1") == [smollm2_tokenizer.backend.token_to_id(t) for t in ["x", "ĠĠ", "1"]]


def test_gguf_decode_round_trip(smollm2_tokenizer):
    for text in TEXTS:
        assert smollm2_tokenizer.decode(smollm2_tokenizer.encode(text)) == text
    ids = smollm2_tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe"])  # gpt-2: see test_loaders (hf_ggufs)
def test_gguf_pre_tokenizers_match_llama_cpp(smollm2_gguf, smollm2_metadata, rewrite_gguf, tmp_path, pre):
    """The same vocabulary with another `tokenizer.ggml.pre`: our regexes against llama.cpp's."""
    path = rewrite_gguf(smollm2_gguf, tmp_path / f"{pre}.gguf", fields={"tokenizer.ggml.pre": pre}, tensors=False)
    vocab = llama_cpp_vocab(path)
    ours = Tokenizer.from_gguf_metadata({**smollm2_metadata, "tokenizer.ggml.pre": pre})
    for text in TEXTS:
        assert ours.encode(text) == llama_cpp_encode(vocab, text), text


def test_gguf_add_bos(smollm2_metadata):
    ours = Tokenizer.from_gguf_metadata({**smollm2_metadata, "tokenizer.ggml.add_bos_token": True})
    assert ours.encode("hi", add_special_tokens=True) == [1, *ours.encode("hi")]


def test_gguf_unsupported_tokenizers(smollm2_metadata):
    with pytest.raises(JaxspecError, match="unsupported GGUF tokenizer model 'llama'"):
        Tokenizer.from_gguf_metadata({**smollm2_metadata, "tokenizer.ggml.model": "llama"})
    with pytest.raises(JaxspecError, match="unsupported GGUF pre-tokenizer 'deepseek-llm'"):
        Tokenizer.from_gguf_metadata({**smollm2_metadata, "tokenizer.ggml.pre": "deepseek-llm"})


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "  Hi!  "},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
]


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_gguf_chat_template_matches_transformers(smollm2_tokenizer, smollm2_hf_tokenizer, generation_prompt):
    for messages in CONVERSATIONS:
        ours = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt)
        ref = smollm2_hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert ours == ref
        assert smollm2_tokenizer.encode(ours) == smollm2_hf_tokenizer.encode(ref, add_special_tokens=False)


def test_smollm2_special_ids(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.has_chat_template
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, (2,), 49152)
    assert tok.encode("<|im_start|>") == [1]


def test_turn_end_token_joins_eos(smollm2_metadata):
    """A GGUF whose eos is <|endoftext|> still stops on <|im_end|>, which its template ends turns with."""
    ours = Tokenizer.from_gguf_metadata({**smollm2_metadata, "tokenizer.ggml.eos_token_id": 0})
    assert ours.eos_token_ids == (0, 2)
    no_template = {k: v for k, v in smollm2_metadata.items() if k != "tokenizer.chat_template"}
    ours = Tokenizer.from_gguf_metadata({**no_template, "tokenizer.ggml.eos_token_id": 0})
    assert ours.eos_token_ids == (0,) and not ours.has_chat_template
    with pytest.raises(JaxspecError, match="no chat template"):
        ours.apply_chat_template(CONVERSATIONS[0])


# ---- HF tokenizer directories ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "qwen2"])  # chat_template.jinja / inline in tokenizer_config.json
def test_hf_tokenizer_matches_transformers(hf_checkpoints, name):
    import transformers

    path = hf_checkpoints[name]
    ours = Tokenizer.from_hf_dir(path)
    ref = transformers.AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == ref.encode(text), text
        assert ours.decode(ours.encode(text)) == ref.decode(ref.encode(text))  # qwen normalizes to NFC
    for messages in CONVERSATIONS:
        for generation_prompt in (True, False):
            expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            assert ours.apply_chat_template(messages, add_generation_prompt=generation_prompt) == expected
    endoftext, im_end = ours.backend.token_to_id("<|endoftext|>"), ours.backend.token_to_id("<|im_end|>")
    assert ours.eos_token_ids == (endoftext, im_end)
    assert ours.bos_token_id is None
    assert ours.vocab_size == ref.backend_tokenizer.get_vocab_size() <= 384


def test_template_raise_exception(hf_checkpoints):
    ours = Tokenizer.from_hf_dir(hf_checkpoints["llama"])
    with pytest.raises(JaxspecError, match="unexpected role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "42"}])


def test_save_round_trip(hf_checkpoints, tmp_path):
    ours = Tokenizer.from_hf_dir(hf_checkpoints["qwen2"])
    ours.save(tmp_path)
    again = Tokenizer.from_saved(tmp_path)
    assert (again.chat_template, again.bos_token_id, again.eos_token_ids) == (ours.chat_template, None, ours.eos_token_ids)
    for text in TEXTS:
        assert again.encode(text) == ours.encode(text)


def test_hf_bad_tokenizer_files(hf_checkpoints, tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(JaxspecError, match="cannot read tokenizer"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((hf_checkpoints["llama"] / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{% if %}"}')
    with pytest.raises(JaxspecError, match="cannot parse chat template"):
        Tokenizer.from_hf_dir(tmp_path)


def full_decode_stream(tokenizer, chunks, stop=()):
    """What a text stream hands out by definition: at each push the text of every id so far, less a
    trailing incomplete character and the last len(longest stop) - 1 characters, cut at a stop that
    ends past what was handed out."""
    hold = max((len(s) for s in stop), default=1) - 1
    ids, sent, out = [], 0, []
    for chunk in chunks:
        ids += chunk
        text = tokenizer.decode(ids, skip_special_tokens=True)
        cuts = [i for i in (text.find(s, max(0, sent - len(s) + 1)) for s in stop) if i >= 0]
        if cuts:
            out.append((text[sent : min(cuts)], True))
            return out, ""
        end = len(text) - hold
        while end > sent and text[end - 1] == "\ufffd":
            end -= 1
        out.append((text[sent:end] if end > sent else "", False))
        sent = max(sent, end)
    return out, text[sent:]


class StrippedStart:
    """A decoder that strips a text's first space (SentencePiece-style): a window's text drops the
    space a full decode keeps."""

    def __init__(self, tokenizer):
        self.inner = tokenizer

    def decode(self, ids, skip_special_tokens=False):
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens).removeprefix(" ")


class Reversed(StrippedStart):
    """A decoder whose window texts are not prefixes of longer ones' (the stream's fallback)."""

    def decode(self, ids, skip_special_tokens=False):
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)[::-1]


@pytest.mark.parametrize("wrap", [None, StrippedStart, Reversed])
def test_text_stream_hands_out_what_a_full_decode_would(smollm2_tokenizer, wrap):
    """Every push hands out what decoding all ids so far would (the stream decodes a few ids of context
    only): characters split across tokens (byte tokens, emoji), invalid byte runs, special tokens
    skipped, stop strings across pushes; random chunk sizes and stops."""
    tokenizer = wrap(smollm2_tokenizer) if wrap else smollm2_tokenizer
    rng = np.random.default_rng(244)
    base = smollm2_tokenizer.encode("".join(TEXTS[10:14]) + " 🤖🚀 中文 日本語 ok")
    for trial in range(12):
        ids = list(base)
        for _ in range(rng.integers(1, 6)):  # random tokens: lone UTF-8 bytes and special tokens among them
            ids.insert(int(rng.integers(0, len(ids))), int(rng.integers(0, 300)))
        cuts = np.sort(rng.choice(np.arange(1, len(ids)), size=rng.integers(1, len(ids) // 2), replace=False))
        chunks = [c.tolist() for c in np.split(np.array(ids), cuts)]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        stop = () if trial % 3 == 0 else tuple({text[i : i + int(rng.integers(1, 5))]
                                                for i in rng.integers(len(text) // 3, len(text), 2)})
        want, rest = full_decode_stream(tokenizer, chunks, stop)
        stream = TextStream(tokenizer, stop)
        got = [stream.push(c) for c in chunks[: len(want)]]
        assert got == want
        assert stream.flush() == (rest if not want[-1][1] else "")


def test_text_stream_decodes_a_few_ids_a_push(smollm2_tokenizer):
    """A push decodes its ids with CONTEXT ids before them, whatever the length so far (decoding all
    of them made a push O(length)); characters split across tokens (emoji) included."""
    lengths = []

    class Counting(StrippedStart):
        def decode(self, ids, skip_special_tokens=False):
            lengths.append(len(ids))
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = smollm2_tokenizer.encode(" ".join(TEXTS) * 4)
    stream = TextStream(Counting(smollm2_tokenizer))
    for n, i in enumerate(ids):
        lengths.clear()
        pending = n - stream.done  # ids of a character not yet whole
        stream.push([i])
        assert max(lengths) <= CONTEXT + pending + 1
    assert stream.text == smollm2_tokenizer.decode(ids, skip_special_tokens=True) and len(ids) > 400
