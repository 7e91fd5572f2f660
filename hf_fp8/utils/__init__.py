"""Shared helpers for examples, benchmarks and the CLI (built-in model, offline corpora)."""
