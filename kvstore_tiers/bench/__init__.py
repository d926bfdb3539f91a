"""Benchmarks of the kvstore tiers (run each module with ``python -m``)."""
