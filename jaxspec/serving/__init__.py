"""Serving: the scheduler (slots, admission, streaming), its compiled programs, the request types, the
OpenAI-compatible HTTP server and its metrics."""
