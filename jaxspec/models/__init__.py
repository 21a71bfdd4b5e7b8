"""Models: config, the decoder (dense and NSA attention), the KV cache."""
