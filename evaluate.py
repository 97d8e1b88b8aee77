"""Evaluation: weighted/macro F1, reasoning tokens, evidence alignment, paired tests, and sampled
evaluation in-process or through an OpenAI-compatible endpoint."""
