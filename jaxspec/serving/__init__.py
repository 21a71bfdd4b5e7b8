"""Serving: the scheduler (slots, admission by KV pages, preemption, streaming), the page pool's
allocator (prefix caching), its compiled programs, the request types, the OpenAI-compatible HTTP server
and its metrics."""
