"""Benchmarks behind `kvflash bench`: decode speed, snapshot restore, retrieval (niah, ruler)."""
