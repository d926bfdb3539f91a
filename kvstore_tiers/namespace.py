"""The storage namespace: which model/dtype/layout a block belongs to.

We reuse vLLM's own :class:`FileMapper` run config (model name, tokens per
hash, blocks per chunk, parallel layout, dtype, KV cache groups, canonical
format) rather than inventing another, so our namespace changes exactly when
vLLM's stock tiers would consider blocks incompatible. Its digest goes into
every frame header; its name prefixes every object.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from kvstore_tiers.frame import NAMESPACE_DIGEST_BYTES

_DTYPE_BYTES = {
    "bfloat16": 2, "float16": 2, "half": 2, "bf16": 2, "fp16": 2,
    "float32": 4, "float": 4, "fp32": 4,
    "fp8": 1, "float8": 1, "uint8": 1, "int8": 1,
}


def dtype_bytes(dtype: str) -> int | None:
    """Element size of a KV cache dtype string (``"torch.bfloat16"``, ``"fp8_e4m3"``...)."""
    name = str(dtype).lower().removeprefix("torch.")
    if name in _DTYPE_BYTES:
        return _DTYPE_BYTES[name]
    for prefix, size in (("fp8", 1), ("float8", 1)):
        if name.startswith(prefix):
            return size
    return None


@dataclass(frozen=True)
class Namespace:
    """A block namespace.

    ``name`` is ``<model with / replaced by _>_<12 hex of sha256>``, exactly
    the directory name vLLM's FileMapper uses; ``digest`` is the first 16
    bytes of the same sha256, stored in frame headers.
    """

    run_config: dict[str, Any]
    name: str
    digest: bytes
    dtype_bytes: int | None

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any], salt: str | None = None) -> Namespace:
        cfg = dict(run_config)
        if salt:
            cfg["kvstore_salt"] = salt
        canonical = json.dumps(cfg, sort_keys=True, separators=(",", ":"))
        sha = hashlib.sha256(canonical.encode()).digest()
        safe_model = str(cfg.get("model_name", "model")).replace("/", "_")
        return cls(
            run_config=cfg,
            name=f"{safe_model}_{sha.hex()[:12]}",
            digest=sha[:NAMESPACE_DIGEST_BYTES],
            dtype_bytes=dtype_bytes(cfg.get("dtype", "")),
        )

    @classmethod
    def from_offloading_spec(cls, spec: Any, salt: str | None = None) -> Namespace:
        """Build from a vLLM OffloadingSpec, through vLLM's FileMapper."""
        from vllm.v1.kv_offload.file_mapper import FileMapper

        mapper = FileMapper.from_offloading_spec(
            root_dir="",
            offloading_spec=spec,
            blocks_per_file=spec.blocks_per_chunk,
            parallel_agnostic=True,
        )
        return cls.from_run_config(mapper.get_run_config(), salt=salt)

    def object_name(self, key: bytes) -> str:
        """Backend-neutral object name of an OffloadKey.

        ``<namespace>/<hash[:3]>/<hash>_g<group>.kvf`` -- one level of 4,096
        hash-derived shards: no directory holds more than a few thousand
        files until billions of blocks, request load spreads over 4,096 S3
        prefixes, and the fs backend creates the shard directories once at
        startup, so no store ever pays for a ``mkdir``.
        """
        hash_hex = key[:-4].hex()
        group = int.from_bytes(key[-4:], "big")
        return f"{self.name}/{hash_hex[:3]}/{hash_hex}_g{group}.kvf"


#: Number of shard directories under a namespace (hash prefixes 000..fff).
SHARDS = [f"{i:03x}" for i in range(4096)]


def key_from_object_name(name: str) -> bytes | None:
    """Inverse of :meth:`Namespace.object_name` (None if ``name`` is not one)."""
    parts = name.rsplit("/", 2)
    if len(parts) != 3 or not parts[2].endswith(".kvf"):
        return None
    try:
        hash_hex, group = parts[2][:-4].rsplit("_g", 1)
        if not hash_hex.startswith(parts[1]):
            return None
        return bytes.fromhex(hash_hex) + int(group).to_bytes(4, "big")
    except (IndexError, ValueError, OverflowError):
        return None
