"""Serving: the scheduler (slots, admission, streaming), the OpenAI-compatible HTTP server and its metrics."""
