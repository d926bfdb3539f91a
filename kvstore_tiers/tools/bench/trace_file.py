"""Request traces with prefix-block ids (the Mooncake FAST'25 format) for ``bench --trace``.

One JSON object per line, one request each: ``timestamp`` (ms), ``input_length``
and ``output_length`` (tokens), ``hash_ids`` (one id per :data:`BLOCK_TOKENS`
tokens of the prompt; equal ids at equal positions are a shared prefix block).
The last block of a prompt may be partial: it holds ``input_length - 512 * (n - 1)``
tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

#: Tokens per trace block (the Mooncake traces' hash block size).
BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line is not a request of the expected shape (the message names the line)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: its arrival and its prompt's prefix-block ids."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, i: int) -> int:
        """Tokens of the prompt in block ``i`` (512, the last one possibly fewer)."""
        if i < len(self.hash_ids) - 1:
            return BLOCK_TOKENS
        return max(0, min(BLOCK_TOKENS, self.input_length - BLOCK_TOKENS * i))


def load(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests of the trace at ``path`` (all when None), in file order.

    Raises :class:`TraceError` naming the line for a line that is not a request.
    """
    out: list[TraceRequest] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                ids = tuple(int(h) for h in obj["hash_ids"])
                req = TraceRequest(int(obj.get("timestamp", 0)), int(obj["input_length"]),
                                   int(obj.get("output_length", 0)), ids)
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}:{lineno}: not a trace request ({exc})") from None
            if not ids or req.input_length > BLOCK_TOKENS * len(ids):
                raise TraceError(f"{path}:{lineno}: {len(ids)} block ids cannot hold "
                                 f"{req.input_length} input tokens")
            out.append(req)
    return out


def distinct_blocks(requests: list[TraceRequest]) -> int:
    """How many distinct block ids the requests name (the working set, in blocks)."""
    return len({h for r in requests for h in r.hash_ids})
