"""LLM judges over an OpenAI-compatible HTTP API: the single `chat()` call, concurrent batches,
judge prompt builders with strict output parsers, and a small local server (`python judge.py serve`)."""
