"""What a block costs on S3: the requests a trace replay sent, turned into money.

``kvstore-tiers bench --trace ... --tier s3 --cost`` (and ``--nodes N --tier s3
--cost``). The counts are the requests the s3 tier really sent to the server
during the replay: the backend counts every HTTP attempt of its data path
(retries included) by operation on its botocore client
(:attr:`S3Backend.requests <kvstore_tiers.backends.s3.backend.S3Backend.requests>`);
a test checks them against moto's own request log. Existence checks are
counted as the tier issues them: one HEAD per looked-up block that neither the
presence index (blocks this process stored) nor the negative cache (blocks
found absent less than ``negative_cache_s`` ago) answers. The start-up probe's
few requests per engine start (a test object written, read, deleted; the
namespace's ``config.json``) are not a per-block cost and are left out.

Prices are inputs (:class:`S3Prices`); the defaults are AWS's list prices for
S3 Standard in US East (N. Virginia) as published on
https://aws.amazon.com/s3/pricing/: PUT, COPY, POST and LIST $0.005 per 1,000
requests; GET, HEAD and all other requests $0.0004 per 1,000; DELETE free;
storage $0.023 per GB-month (the first 50 TB). Data transfer between EC2 and
S3 in one region is free and not counted.

A trace block is 512 tokens and one object here; an engine whose offload
chunk holds fewer tokens sends proportionally more requests per token
(:func:`per_million_tokens` scales by ``tokens_per_object``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

#: The operation kinds of the cost table, by botocore operation name.
KINDS = ("PUT", "GET", "HEAD", "LIST", "DELETE", "other")
_KIND = {"PutObject": "PUT", "CopyObject": "PUT", "GetObject": "GET", "HeadObject": "HEAD",
         "HeadBucket": "HEAD", "ListObjects": "LIST", "ListObjectsV2": "LIST",
         "DeleteObject": "DELETE", "DeleteObjects": "DELETE"}
#: AWS's price class of each kind: PUT/COPY/POST/LIST, GET and all others, DELETE.
_PRICE_CLASS = {"PUT": "put", "LIST": "put", "GET": "get", "HEAD": "get", "other": "get",
                "DELETE": "delete"}
GB = 10**9


@dataclass(frozen=True)
class S3Prices:
    """USD per 1,000 requests of each AWS price class, and per GB-month stored."""

    put_per_1k: float = 0.005
    get_per_1k: float = 0.0004
    delete_per_1k: float = 0.0
    gb_month: float = 0.023
    source: str = ("AWS S3 Standard, US East (N. Virginia), list prices as published on "
                   "https://aws.amazon.com/s3/pricing/ (inputs you can change)")

    def per_request(self, kind: str) -> float:
        """USD per request of ``kind`` (:data:`KINDS`)."""
        return {"put": self.put_per_1k, "get": self.get_per_1k,
                "delete": self.delete_per_1k}[_PRICE_CLASS[kind]] / 1000


def by_kind(requests: Mapping[str, int]) -> dict[str, int]:
    """botocore operation counts folded into :data:`KINDS` (every kind present)."""
    out = dict.fromkeys(KINDS, 0)
    for op, n in requests.items():
        out[_KIND.get(op, "other")] += int(n)
    return out


def request_dollars(kinds: Mapping[str, int], prices: S3Prices) -> dict[str, float]:
    """USD per kind of the counts ``kinds`` (:func:`by_kind`), and their ``total``."""
    out = {k: kinds.get(k, 0) * prices.per_request(k) for k in KINDS}
    out["total"] = sum(out.values())
    return out


def per_million_tokens(dollars: float, tokens: int, tokens_per_object: int = 512,
                       replay_tokens_per_object: int = 512) -> float | None:
    """USD per million of ``tokens`` for ``dollars`` spent on them, with objects of
    ``tokens_per_object`` instead of the replay's (requests scale inversely)."""
    if tokens <= 0:
        return None
    return dollars / tokens * 1e6 * replay_tokens_per_object / tokens_per_object


def _ratio(n: int, d: int) -> float | None:
    return n / d if d else None


def block_cost(requests: Mapping[str, int], objects_written: int, blocks_served: int,
               prompt_tokens: int, tokens_served: int, stored_bytes: int,
               prices: S3Prices, scaled_bytes_per_object: Mapping[str, int] | None = None
               ) -> dict[str, Any]:
    """The cost figures of one replay on S3.

    ``requests``: botocore operation counts; ``objects_written``: blocks the tier
    wrote (each once: S3 then holds them); ``blocks_served``/``tokens_served``:
    what the replay loaded from S3; ``prompt_tokens``: every prompt token of the
    replayed requests; ``stored_bytes``: the bytes written to S3 (what it holds);
    ``scaled_bytes_per_object``: a model's bytes per 512-token block, for its
    storage cost.
    """
    kinds = by_kind(requests)
    dollars = request_dollars(kinds, prices)
    months = {"measured": stored_bytes / GB * prices.gb_month}
    for name, per_obj in (scaled_bytes_per_object or {}).items():
        months[name] = objects_written * per_obj / GB * prices.gb_month
    return {
        "prices": asdict(prices),
        "requests": kinds,
        "per_block_stored": {k: _ratio(n, objects_written) for k, n in kinds.items()},
        "per_block_served": {k: _ratio(n, blocks_served) for k, n in kinds.items()},
        "dollars": dollars,
        "dollars_per_million_prompt_tokens": per_million_tokens(dollars["total"],
                                                                prompt_tokens),
        "dollars_per_million_tokens_served": per_million_tokens(dollars["total"],
                                                                tokens_served),
        "storage_dollars_per_month": months,
    }


def headline(cost: dict[str, Any], what: str) -> str:
    """The one-line answer: a million prompt tokens' requests on S3, in USD."""
    x = cost["dollars_per_million_prompt_tokens"]
    served = cost["dollars_per_million_tokens_served"]
    tail = (f" (${served:.4f} per million tokens served from S3)" if served is not None
            else "")
    return (f"{what}: serving a million prompt tokens with the s3 tier costs "
            f"${x:.4f} in requests at these prices{tail}" if x is not None
            else f"{what}: no prompt tokens replayed")
