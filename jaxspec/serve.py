"""`python -m jaxspec.serve`: an OpenAI-compatible HTTP server with continuous batching and speculative decoding.

One model, one decoding method (generate's flags), `--slots` rows decoding at once; requests beyond
them wait in a bounded queue (beyond `--queue`: HTTP 429). The KV cache is a pool of `--kv-pages`
pages of `--page-size` tokens (default: KV_MEMORY_FRACTION of the device memory left after the weights)
that the slots share as their requests grow; when it runs out the latest request is preempted and
prefilled again later. Full prompt pages stay cached for later prompts with the same prefix
(`--no-prefix-cache`: not). `--method auto` starts with the planner's
choice for `--slots` rows at half the context and refines it over the first segments served (switching
every slot's strategy in place, as `generate` does). SIGINT or SIGTERM stops accepting
connections, lets the requests in flight finish, then exits.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sys

import jax
import uvicorn

from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.errors import ArgumentParser, JaxspecError, cli_main
from jaxspec.models import kvcache
from jaxspec.models.kvcache import DEFAULT_PAGE_SIZE
from jaxspec.generate import add_method_flags, add_model_flags, announce_precision, check_draft, load, plan_auto, spec_from_args
from jaxspec.runner import describe_device
from jaxspec.xla_flags import set_gpu_flags

KV_MEMORY_FRACTION = 0.85  # of the device memory free after the weights: the rest for activations and programs


def parse_args(argv):
    p = ArgumentParser(prog="python -m jaxspec.serve", description=__doc__.splitlines()[0])
    add_model_flags(p)
    add_method_flags(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--slots", type=int, default=8, help="requests decoded at once (the batch rows)")
    p.add_argument("--queue", type=int, default=256, help="requests that may wait for a slot (beyond: HTTP 429)")
    p.add_argument("--segment", type=int, default=2, help="decode iterations between admissions and streamed chunks")
    p.add_argument("--admit-rows", type=int, default=1,
                   help="the most waiting requests one admission prefills together (the others' decoding waits for it)")
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="chunked prefill: prompts longer than this are prefilled this many tokens per decode segment (0: whole)")
    p.add_argument("--batching", choices=("continuous", "static"), default="continuous",
                   help="static: admit only when every slot is free (the baseline continuous batching is measured against)")
    p.add_argument("--warm-up-tokens", type=int, default=64,
                   help="compile the admission of prompts up to this many tokens at start")
    p.add_argument("--max-top-k", type=int, default=64, help="the largest top_k a request may ask for")
    p.add_argument("--shrink", action="store_true",
                   help="once at most a quarter of the slots run and none wait, decode them in fewer rows (a waiting "
                        "request grows the state back); the warm-up also compiles every smaller row count")
    p.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help="tokens per KV page (a multiple of 64)")
    p.add_argument("--kv-pages", type=int, default=0,
                   help=f"KV pages in the pool, the null page included (0: {KV_MEMORY_FRACTION:.0%}% of the device memory "
                        "left after the weights; on a CPU, every slot's --max-len)")
    p.add_argument("--no-prefix-cache", action="store_true", help="prefill every prompt whole, sharing no pages")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API (default: --model)")
    return p.parse_args(argv)


@cli_main
def main(argv=None):
    args = parse_args(argv)
    for flag, value, low in (("--slots", args.slots, 1), ("--queue", args.queue, 0), ("--segment", args.segment, 1),
                             ("--admit-rows", args.admit_rows, 1), ("--warm-up-tokens", args.warm_up_tokens, 1),
                             ("--prefill-chunk", args.prefill_chunk, 0),
                             ("--max-top-k", args.max_top_k, 0), ("--kv-pages", args.kv_pages, 0)):
        if value < low:
            raise JaxspecError(f"{flag} must be at least {low}, got {value}")
    check_address(args.host, args.port)  # --port's range too
    try:  # before the weights load (the scheduler checks it against an NSA model's blocks too)
        kvcache.paging.check_page_size(args.page_size)
    except ValueError as e:
        raise JaxspecError(f"--page-size: {e}") from None
    spec = spec_from_args(args, batch=args.slots)  # --tuned settings for a batch of its slots

    from jaxspec.serving.scheduler import Scheduler, row_pages
    from jaxspec.serving.server import create_app

    print(describe_device(), file=sys.stderr)
    spec = check_draft(args, spec)
    cfg, params, tokenizer, mesh = load(args, spec)
    announce_precision(args)
    max_len = args.max_len or cfg.max_position_embeddings
    if max_len < 2 or max_len > cfg.max_position_embeddings:
        raise JaxspecError(f"--max-len must be in [2, {cfg.max_position_embeddings}] for this model, got {max_len}")
    plan = None
    if args.method == "auto":
        plan, spec, params = plan_auto(args, spec, cfg, params, mesh, batch=args.slots, prompt_tokens=max_len // 2,
                                       new_tokens=max_len // 4, sampling=SamplingConfig(temperature=1.0),
                                       closed=args.batching == "static")
    kv_pages = args.kv_pages or default_pages(cfg, spec, args.slots, row_pages(max_len, args.page_size), args.page_size,
                                                mesh.size if mesh else 1)
    scheduler = Scheduler(params, cfg, tokenizer, spec, slots=args.slots, max_len=max_len, plan=plan, queue_limit=args.queue,
                          segment=args.segment, admit_rows=args.admit_rows, static=args.batching == "static",
                          prefill_chunk=args.prefill_chunk or None, max_top_k=args.max_top_k, mesh=mesh,
                          shrink=args.shrink, kv_pages=kv_pages, page_size=args.page_size,
                          prefix_cache=not args.no_prefix_cache)
    spec = scheduler.spec
    print(f"compiling ({spec.method}, {args.slots} slots, context {max_len}, "
          f"{describe_pool(kv_pages, scheduler.row_pages, args.page_size, args.slots, args.shrink)}) ...", file=sys.stderr)
    scheduler.warm_up(min(args.warm_up_tokens, max_len - 1))
    scheduler.start()
    name = args.served_model_name or args.model
    logging.basicConfig(level=logging.WARNING)
    config = uvicorn.Config(create_app(scheduler, name), host=args.host, port=args.port, log_level="warning")
    print(f"serving {name} ({spec.method}) on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    try:
        DrainingServer(config).run()  # returns after SIGINT/SIGTERM, once the open requests have finished
    finally:
        scheduler.stop()
    print("stopped", file=sys.stderr)


def check_address(host: str, port: int) -> None:
    """That this host can listen on (host, port), before the weights load (uvicorn would find out only
    after them, in a traceback)."""
    if not 0 <= port <= 65535:
        raise JaxspecError(f"--port must be in [0, 65535], got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind(address)
    except OSError as e:
        raise JaxspecError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def default_pages(cfg, spec, slots: int, row_pages: int, page_size: int, devices: int) -> int:
    """KV_MEMORY_FRACTION of the device memory free after the weights, in pages (every layer's keys and
    values, an EAGLE-3 head's one layer beside them; split over `devices` by KV heads); a device that reports no memory (a CPU) gets
    every slot's --max-len, as a batch's cache."""
    memory = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" not in memory:
        return slots * row_pages + 1
    per_page = kvcache.page_bytes(cfg, page_size) * (1 + (1 / cfg.num_layers if spec.eagle else 0)) / devices
    return int(KV_MEMORY_FRACTION * (memory["bytes_limit"] - memory["bytes_in_use"]) / per_page)


def describe_pool(kv_pages: int, row_pages: int, page_size: int, slots: int, shrink: bool) -> str:
    """The KV pool in the start-up line: its pages, how many requests of the whole context it holds (page 0
    is the null page), and, when that is fewer than the slots without --shrink, what the rest cost."""
    whole = (kv_pages - 1) // row_pages
    text = f"{kv_pages} KV pages of {page_size} tokens: {whole} requests of the whole context at once"
    if whole < slots and not shrink:
        text += (f"; when fewer than {slots} requests fit it, each iteration still decodes {slots} rows "
                 f"(--shrink decodes only the rows in use)")
    return text


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose SIGINT/SIGTERM handling (stop accepting, finish the open requests)
    returns instead of re-raising the signal, so the scheduler drains and the exit status is 0."""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


if __name__ == "__main__":
    set_gpu_flags()
    main()
