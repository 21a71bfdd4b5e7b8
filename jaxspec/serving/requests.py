"""What a client hands the scheduler and gets back: a `Request`, its `Handle`, the `Delta`s its
listener receives (the last one with `RequestStats`), and `QueueFull` when the queue is full."""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Callable

from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.serving.text import TextStream


class QueueFull(Exception):
    """More requests are waiting than the queue holds (HTTP 429)."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request: prompt token ids and how to continue them."""

    ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingConfig = SamplingConfig()
    seed: int | None = None  # None: a fresh random seed
    stop: tuple[str, ...] = ()  # stop strings (the text ends before the first one)
    stop_ids: tuple[int, ...] = ()  # token ids that end the request, besides the model's own
    ignore_eos: bool = False  # the model's own end tokens do not end it (fixed-length load tests)


@dataclasses.dataclass(frozen=True)
class RequestStats:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens read from the prefix cache instead of prefilled
    iterations: int  # decode iterations the request's slot ran (its first token came from prefill)
    drafted: int
    accepted: int
    accepted_by_depth: tuple[int, ...]
    queued_s: float  # submit to admission
    first_token_s: float  # submit to first token
    total_s: float


@dataclasses.dataclass(frozen=True)
class Delta:
    """What a request's listener receives: new text and tokens; `finish_reason` (stop, length,
    cancelled, error) and `stats` on the last one, `error` when it failed."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stats: RequestStats | None = None
    error: str | None = None


class Handle:
    """A submitted request: its id, and `cancel` (its slot is freed before the next segment). The
    scheduler that runs it fills in its slot, tokens and times."""

    def __init__(self, cancel: Callable[[Handle], None], request: Request, listener: Callable[[Delta], None]):
        self.id = secrets.token_hex(8)
        self.request, self.listener, self._cancel = request, listener, cancel
        self.submitted = time.perf_counter()
        self.admitted: float | None = None
        self.first_token: float | None = None
        self.slot: int | None = None  # its row in the running state
        self.tokens: list[int] = []  # every token its slot committed so far (the stop token too)
        self.cached_tokens = 0  # its prompt's tokens that its admission read from the prefix cache
        self.text: TextStream | None = None  # None without a tokenizer
        self.before_switch = (0, 0, 0, ())  # the slot's stats under earlier strategies (a switch zeroes them)

    @property
    def read(self) -> int:
        """Tokens of the slot already handed out (from the prompt's end)."""
        return len(self.tokens)

    def cancel(self) -> None:
        self._cancel(self)
