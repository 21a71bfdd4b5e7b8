"""Text <-> token ids and chat templates, from an HF tokenizer directory or GGUF metadata.

One class wraps a `tokenizers.Tokenizer` with the chat template (rendered with sandboxed jinja2 exactly
as transformers does) and the token ids that end a generation. End-of-sequence ids are collected from
every place a checkpoint declares them, plus the token the chat template closes an assistant turn
with (e.g. `<|im_end|>`), because chat models stop on that even where the files name another EOS.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from jaxspec import files
from jaxspec.errors import JaxspecError

# GGUF `tokenizer.ggml.token_type` values (llama.cpp's llama_token_type).
CONTROL_TOKEN, USER_DEFINED_TOKEN = 3, 4

# The regexes llama.cpp applies for each `tokenizer.ggml.pre` value we support (llama-vocab.cpp).
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_SPLIT_DIGITS = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")  # + gpt-2 regex
_REGEX_PRE = {"gpt-2": _GPT2_REGEX, "qwen2": _QWEN2_REGEX, "llama-bpe": _LLAMA3_REGEX}


class Tokenizer:
    """Encode/decode, chat template and stop ids of one model."""

    def __init__(
        self,
        backend: Backend,
        chat_template: str | None = None,
        bos_token_id: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self._template = _compile_template(chat_template) if chat_template else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token text such as `<|im_start|>` becomes its single id.

        `add_special_tokens` applies the tokenizer's post-processor (e.g. a BOS for Llama 3); it is off by
        default because chat-template text already carries the model's BOS where it needs one.
        """
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Renders `messages` ([{"role", "content"}]) with the model's template, as transformers does."""
        if self._template is None:
            raise JaxspecError("this model has no chat template")
        special = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_ids[0] if self.eos_token_ids else None}
        # transformers passes only the special tokens that exist: a missing one is undefined, not "None".
        special = {name: self.backend.id_to_token(i) for name, i in special.items() if i is not None}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=None, documents=None, **special
            )
        except jinja2.TemplateError as e:
            raise JaxspecError(f"chat template failed: {e}") from None

    def save(self, path: Path) -> None:
        """Writes tokenizer.json and a tokenizer_config.json holding the template and the resolved ids."""
        self.backend.save(str(path / "tokenizer.json"))
        config = dict(chat_template=self.chat_template, bos_token_id=self.bos_token_id, eos_token_ids=self.eos_token_ids)
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))

    @classmethod
    def from_saved(cls, path: Path) -> Tokenizer:
        """Reads what `save` wrote (ids are stored resolved, so nothing is derived again)."""
        backend = _read_backend(path / "tokenizer.json")
        config = files.read_json_object(path / "tokenizer_config.json", "tokenizer config")
        return cls(backend, config.get("chat_template"), config.get("bos_token_id"), tuple(config.get("eos_token_ids", ())))

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, generation_config.json, config.json)."""
        backend = _read_backend(path / "tokenizer.json")
        optional = lambda name, what: files.read_json_object(path / name, what) if (path / name).exists() else {}
        tok_config = optional("tokenizer_config.json", "tokenizer config")
        gen_config = optional("generation_config.json", "generation config")
        model_config = optional("config.json", "model config")

        template = tok_config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").exists():  # transformers 5 saves the template here
            template = (path / "chat_template.jinja").read_text()

        def token_id(token) -> int | None:
            content = token.get("content") if isinstance(token, dict) else token
            return None if content is None else backend.token_to_id(content)

        bos = token_id(tok_config.get("bos_token"))
        if bos is None:
            bos = gen_config.get("bos_token_id", model_config.get("bos_token_id"))
        eos = [token_id(tok_config.get("eos_token"))]
        for config in (gen_config, model_config):
            value = config.get("eos_token_id")
            eos += value if isinstance(value, list) else [value]
        return cls.with_turn_end(backend, template, bos, eos)

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        """Byte-level BPE (`tokenizer.ggml.model` = gpt2) rebuilt from the GGUF vocabulary and merges.

        Control and user-defined tokens become added tokens, so template text maps to their single ids;
        the pre-tokenizer reproduces llama.cpp's regexes for `tokenizer.ggml.pre`.
        """
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise JaxspecError(f"unsupported GGUF tokenizer model {kind!r} (supported: byte-level BPE 'gpt2')")
        pre = meta.get("tokenizer.ggml.pre", "default")
        tokens = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", ())]
        types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))

        vocab = {token: i for i, token in enumerate(tokens)}
        backend = Backend(models.BPE(vocab, merges, ignore_merges=pre == "llama-bpe"))
        backend.pre_tokenizer = _gguf_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        backend.add_tokens(
            [
                AddedToken(token, special=t == CONTROL_TOKEN, normalized=False)
                for token, t in zip(tokens, types)
                if t in (CONTROL_TOKEN, USER_DEFINED_TOKEN)
            ]
        )
        bos = meta.get("tokenizer.ggml.bos_token_id")
        if bos is not None and meta.get("tokenizer.ggml.add_bos_token", False):
            backend.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
            )
        eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return cls.with_turn_end(backend, meta.get("tokenizer.chat_template"), bos, eos)

    @classmethod
    def with_turn_end(cls, backend: Backend, template: str | None, bos: int | None, eos: list) -> Tokenizer:
        """The tokenizer with ids `eos` (None entries and duplicates dropped) plus the template's turn end."""
        turn_end = cls(backend, template).turn_end_token_id()
        ids = tuple(dict.fromkeys(int(i) for i in [*eos, turn_end] if i is not None))
        return cls(backend, template, None if bos is None else int(bos), ids)

    def turn_end_token_id(self) -> int | None:
        """The special token the chat template writes right after an assistant message's content."""
        if self._template is None:
            return None
        marker = "\x00jaxspec-end-of-turn-probe\x00"
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": marker}]
        try:
            text = self.apply_chat_template(messages, add_generation_prompt=False)
        except JaxspecError:
            return None
        if marker not in text:
            return None
        ids = self.encode(text.split(marker, 1)[1])
        special = {t.content for t in self.backend.get_added_tokens_decoder().values() if t.special}
        return ids[0] if ids and self.backend.id_to_token(ids[0]) in special else None


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _SPLIT_DIGITS:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    if pre not in _REGEX_PRE:
        raise JaxspecError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: {', '.join([*_SPLIT_DIGITS, *_REGEX_PRE])})")
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_REGEX_PRE[pre]), behavior="isolated"), byte_level])


def _compile_template(source: str) -> jinja2.Template:
    """The jinja2 environment of transformers' `apply_chat_template` (same helpers and whitespace rules)."""

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise JaxspecError(f"cannot parse chat template: {e}") from None


def _read_backend(path: Path) -> Backend:
    if not path.exists():
        raise JaxspecError(f"missing tokenizer file {path}")
    try:
        return Backend.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for any parse error
        raise JaxspecError(f"cannot read tokenizer {path}: {str(e).splitlines()[0]}") from None


