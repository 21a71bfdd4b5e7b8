"""Training: the local-text data split and token batches, and fits of extra weights to a frozen model
(the NSA gates, an EAGLE-3 draft head)."""
