"""Where the real KV samples live (``shared/data/kv-samples``) and how to read them.

The samples (bf16 KV blocks of SmolLM2-135M with a JSON sidecar) sit in the
``shared/`` folder beside a checkout. Looked up in order: the
``KVSTORE_KV_SAMPLES`` environment variable, ``../shared/data/kv-samples``
relative to this checkout, then ``/work/shared/data/kv-samples``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

ENV = "KVSTORE_KV_SAMPLES"
SIDECAR = "kv-samples.json"


def default_dir() -> Path:
    """The first candidate directory that holds the sidecar (or the first candidate)."""
    candidates = []
    if os.environ.get(ENV):
        candidates.append(Path(os.environ[ENV]))
    checkout = Path(__file__).resolve().parent.parent
    candidates += [checkout.parent / "shared/data/kv-samples",
                   Path("/work/shared/data/kv-samples")]
    for c in candidates:
        if (c / SIDECAR).exists():
            return c
    return candidates[0]


def load(directory: Path | None = None) -> list[tuple[dict[str, Any], np.ndarray]]:
    """[(sidecar file entry, blocks as a (num_blocks, block_bytes) uint8 array)]."""
    directory = directory or default_dir()
    meta = json.loads((directory / SIDECAR).read_text())
    out = []
    for entry in meta["files"]:
        raw = np.fromfile(directory / entry["file"], dtype=np.uint8)
        out.append((entry, raw.reshape(entry["num_blocks"], entry["block_bytes"])))
    return out
