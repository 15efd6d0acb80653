"""Benchmarks of MoK against the other MoE dispatchers (``python -m megatron_mok.bench``)."""
