"""Real KV samples (bf16 KV blocks with a JSON sidecar) for the benchmarks and tests.

The directory holds ``kv-samples.json`` and the ``*.bin`` files it lists. It
is never guessed: the caller passes it (``kvstore-tiers bench --samples DIR``)
or sets :data:`ENV`; :func:`resolve` says clearly what is missing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

#: Environment variable naming the samples directory when no option does.
ENV = "KVSTORE_KV_SAMPLES"
SIDECAR = "kv-samples.json"


class SamplesNotFound(FileNotFoundError):
    """No samples directory was given, or it holds no ``kv-samples.json``."""


def from_env() -> Path | None:
    """The directory :data:`ENV` names, or None when it is unset or empty."""
    value = os.environ.get(ENV, "").strip()
    return Path(value) if value else None


def resolve(directory: Path | None = None) -> Path:
    """``directory``, else :data:`ENV`; raises :class:`SamplesNotFound` naming both
    when neither is given or the directory has no sidecar."""
    chosen = directory if directory is not None else from_env()
    if chosen is None:
        raise SamplesNotFound(f"no KV samples directory: pass one or set {ENV}")
    if not (chosen / SIDECAR).is_file():
        raise SamplesNotFound(f"{chosen} holds no {SIDECAR} (the KV samples directory)")
    return chosen


def load(directory: Path) -> list[tuple[dict[str, Any], np.ndarray]]:
    """[(sidecar file entry, blocks as a (num_blocks, block_bytes) uint8 array)]."""
    meta = json.loads((directory / SIDECAR).read_text())
    out = []
    for entry in meta["files"]:
        raw = np.fromfile(directory / entry["file"], dtype=np.uint8)
        out.append((entry, raw.reshape(entry["num_blocks"], entry["block_bytes"])))
    return out
