"""Server metrics in the Prometheus text format (`/metrics`): requests by outcome, queue and running
requests, generated tokens and tokens/s, the speculation figures (tokens per iteration, acceptance by
draft depth) over finished requests, and the KV page pool (pages in use, cached and free, the prefix
cache's hit rate, preemptions)."""

from __future__ import annotations

import collections
import threading
import time

RATE_WINDOW_S = 10.0  # tokens/s is measured over the segments of the last this many seconds


class Metrics:
    def __init__(self, depth: int):
        self._lock = threading.Lock()
        self.requests: collections.Counter[str] = collections.Counter()
        self.waiting = self.running = 0
        self.generated = self.iterations = self.accepted = self.drafted = 0
        self.by_depth = [0] * depth
        self.segments: collections.deque[tuple[float, int, float]] = collections.deque()  # (time, tokens, seconds)
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.preemptions = 0
        self.pool = None  # the scheduler's PagePool, read when rendering

    def count_preemption(self) -> None:
        with self._lock:
            self.preemptions += 1

    def count_request(self, outcome: str) -> None:
        with self._lock:
            self.requests[outcome] += 1

    def set_queue(self, waiting: int, running: int) -> None:
        with self._lock:
            self.waiting, self.running = waiting, running

    def add_segment(self, tokens: int, seconds: float) -> None:
        now = time.monotonic()
        with self._lock:
            self.generated += tokens
            self.segments.append((now, tokens, seconds))
            while self.segments and self.segments[0][0] < now - RATE_WINDOW_S:
                self.segments.popleft()

    def finish_request(self, reason: str, stats) -> None:
        with self._lock:
            self.requests[reason] += 1
            self.iterations += stats.iterations
            self.accepted += stats.accepted
            self.drafted += stats.drafted
            for d, n in enumerate(stats.accepted_by_depth[: len(self.by_depth)]):
                self.by_depth[d] += n
            if stats.completion_tokens:
                self.ttft_sum += stats.first_token_s
                self.ttft_count += 1

    def render(self) -> str:
        with self._lock:
            now = time.monotonic()
            recent = [s for s in self.segments if s[0] >= now - RATE_WINDOW_S]
            rate = sum(s[1] for s in recent) / RATE_WINDOW_S
            per_iteration = (self.accepted + self.iterations) / self.iterations if self.iterations else 0.0
            lines = [
                "# HELP jaxspec_requests_total Requests by outcome (stop, length, cancelled, error, rejected).",
                "# TYPE jaxspec_requests_total counter",
                *(f'jaxspec_requests_total{{outcome="{k}"}} {v}' for k, v in sorted(self.requests.items())),
                "# HELP jaxspec_requests_waiting Requests queued for a slot.",
                "# TYPE jaxspec_requests_waiting gauge",
                f"jaxspec_requests_waiting {self.waiting}",
                "# HELP jaxspec_requests_running Requests holding a slot.",
                "# TYPE jaxspec_requests_running gauge",
                f"jaxspec_requests_running {self.running}",
                "# HELP jaxspec_generated_tokens_total Tokens generated.",
                "# TYPE jaxspec_generated_tokens_total counter",
                f"jaxspec_generated_tokens_total {self.generated}",
                f"# HELP jaxspec_tokens_per_second Tokens generated per second over the last {RATE_WINDOW_S:g} s.",
                "# TYPE jaxspec_tokens_per_second gauge",
                f"jaxspec_tokens_per_second {rate:.3f}",
                "# HELP jaxspec_iterations_total Decode iterations of finished requests (one per slot and iteration).",
                "# TYPE jaxspec_iterations_total counter",
                f"jaxspec_iterations_total {self.iterations}",
                "# HELP jaxspec_draft_tokens_total Draft tokens verified for finished requests.",
                "# TYPE jaxspec_draft_tokens_total counter",
                f"jaxspec_draft_tokens_total {self.drafted}",
                "# HELP jaxspec_accepted_tokens_total Draft tokens accepted for finished requests.",
                "# TYPE jaxspec_accepted_tokens_total counter",
                f"jaxspec_accepted_tokens_total {self.accepted}",
                "# HELP jaxspec_tokens_per_iteration Tokens per decode iteration over finished requests.",
                "# TYPE jaxspec_tokens_per_iteration gauge",
                f"jaxspec_tokens_per_iteration {per_iteration:.4f}",
                "# HELP jaxspec_accepted_by_depth_total Iterations whose draft at this depth was accepted.",
                "# TYPE jaxspec_accepted_by_depth_total counter",
                *(f'jaxspec_accepted_by_depth_total{{depth="{d + 1}"}} {n}' for d, n in enumerate(self.by_depth)),
                "# HELP jaxspec_acceptance_rate_by_depth Share of iterations whose draft at this depth was accepted.",
                "# TYPE jaxspec_acceptance_rate_by_depth gauge",
                *(f'jaxspec_acceptance_rate_by_depth{{depth="{d + 1}"}} {n / self.iterations if self.iterations else 0.0:.4f}'
                  for d, n in enumerate(self.by_depth)),
                "# HELP jaxspec_time_to_first_token_seconds_avg Mean time from submit to first token.",
                "# TYPE jaxspec_time_to_first_token_seconds_avg gauge",
                f"jaxspec_time_to_first_token_seconds_avg {self.ttft_sum / self.ttft_count if self.ttft_count else 0.0:.4f}",
                "# HELP jaxspec_preemptions_total Requests preempted (pages freed, prefilled again) when the KV pool ran out.",
                "# TYPE jaxspec_preemptions_total counter",
                f"jaxspec_preemptions_total {self.preemptions}",
            ]
            pool = self.pool
            if pool is not None:
                lines += [
                    "# HELP jaxspec_kv_pages KV pool pages by state (in use by requests, cached prefixes, free).",
                    "# TYPE jaxspec_kv_pages gauge",
                    *(f'jaxspec_kv_pages{{state="{k}"}} {v}' for k, v in
                      (("in_use", pool.in_use), ("cached", pool.cached), ("free", pool.free))),
                    "# HELP jaxspec_prefix_cache_hit_rate Prompt tokens read from the prefix cache over prompt tokens.",
                    "# TYPE jaxspec_prefix_cache_hit_rate gauge",
                    f"jaxspec_prefix_cache_hit_rate {pool.hit_rate:.4f}",
                ]
        return "\n".join(lines) + "\n"
