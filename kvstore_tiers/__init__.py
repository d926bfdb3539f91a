"""FileSystem, S3 and Redis secondary tiers for vLLM's multi-tier KV offloading."""

__version__ = "0.1.0"
