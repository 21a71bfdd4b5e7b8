"""Decoding: method config, sampling, exact rejection sampling, drafters and the engine loop."""
