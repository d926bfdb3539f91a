"""The fs tier's config keys."""

from __future__ import annotations

from pydantic import Field, field_validator

from kvstore_tiers.config import TierConfig


class FsConfig(TierConfig):
    """Keys of the fs tier. Also accepts every key of vLLM's stock fs tier."""

    root_dir: str = Field(description="Directory holding the blocks (created if missing).")
    max_bytes: int | None = Field(
        None, gt=0, le=1 << 60, description="Cap on the bytes on disk of this namespace's "
        "directory (objects, temp files, shard directories; docs/fs.md): room is reserved "
        "before each write, and LRU eviction between the watermarks keeps usage below it.",
    )
    min_free_bytes: int | None = Field(
        None, ge=0, le=1 << 60, description="Free-space floor of the filesystem, held as "
        "writes happen (room is reserved before each write; LRU eviction frees it). One "
        "the filesystem can never have free fails at start-up.",
    )
    high_watermark: float = Field(0.95, gt=0, le=1, description="Evict above this fraction.")
    low_watermark: float = Field(0.85, gt=0, le=1, description="Evict down to this fraction "
                                 "(one above high_watermark is taken as it).")
    o_direct: bool = Field(True, description=(
        "Use O_DIRECT where the filesystem supports it (never on tmpfs or ramfs, whose reads are "
        "copies from memory either way)."))

    @property
    def watermarks(self) -> tuple[float, float]:
        """The evictor's (high, low) shares: a low watermark above the high one is the high one."""
        return self.high_watermark, min(self.low_watermark, self.high_watermark)

    @field_validator("root_dir")
    @classmethod
    def _root_named(cls, value: str) -> str:
        # "" would resolve to the working directory.
        if not value.strip():
            raise ValueError("must name a directory (an empty path means the working directory)")
        return value
