"""The fs tier's config keys."""

from __future__ import annotations

from pydantic import Field

from kvstore_tiers.config import TierConfig


class FsConfig(TierConfig):
    """Keys of the fs tier. Also accepts every key of vLLM's stock fs tier."""

    root_dir: str = Field(description="Directory holding the blocks (created if missing).")
    max_bytes: int | None = Field(
        None, gt=0, description="Cap on bytes on disk under root_dir for this namespace; "
        "LRU eviction between high and low watermarks keeps usage below it.",
    )
    min_free_bytes: int | None = Field(
        None, ge=0, description="Free-space floor of the filesystem; eviction keeps it free.",
    )
    high_watermark: float = Field(0.95, gt=0, le=1, description="Evict above this fraction.")
    low_watermark: float = Field(0.85, gt=0, le=1, description="Evict down to this fraction.")
    o_direct: bool = Field(True, description="Use O_DIRECT where the filesystem supports it.")
