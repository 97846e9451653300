"""Benchmark helpers: random-weight GGUF models of any supported family and size."""
