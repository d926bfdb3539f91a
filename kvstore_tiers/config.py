"""Tier configuration: the keys every tier accepts, validated with pydantic.

pydantic (already a vLLM dependency) gives typed, documented models and
errors that say which key is wrong; :func:`validate_config` turns them into
one :class:`~kvstore_tiers.errors.ConfigError` whose message names the tier
type and every offending key, raised at engine startup.

Each backend declares a subclass of :class:`TierConfig` with its own keys.
Secrets are :class:`pydantic.SecretStr`, so they never appear in a repr or a
validation message. vLLM itself logs the whole ``--kv-transfer-config`` at
start-up, so a secret inside a config reaches the server log all the same:
:func:`warn_inline_secrets` says so once per tier, naming the key and where
the secret belongs instead.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, TypeVar
from urllib.parse import SplitResult

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from kvstore_tiers.errors import ConfigError
from kvstore_tiers.redact import redact_url

logger = logging.getLogger(__name__)

Compression = Literal["none", "zstd", "kvsplit", "auto"]

#: What a write costs the adaptive admission policy, in block hits
#: (``admission_write_cost``'s default; docs/internals/admission-design.md says how it was chosen).
WRITE_COST = 0.08


class TierConfig(BaseModel):
    """Keys accepted by every kvstore_tiers tier (in ``secondary_tiers[i]``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    compression: Compression = Field(
        "auto",
        description="Payload codec. auto: none for local backends, kvsplit for remote "
        "ones when the KV dtype is 2 bytes wide (zstd otherwise).",
    )
    n_read_threads: int = Field(
        8, ge=1, le=256, description="Load I/O threads (they take only loads, so a load "
        "never waits behind stores).")
    n_write_threads: int = Field(
        4, ge=1, le=256, description="Store I/O threads (stores first, loads when no store "
        "is queued); stores go at most this wide.")
    max_queued_chunks: int = Field(
        65536, ge=1, le=1 << 24,
        description="Bound on chunks queued in the I/O pool; a job that does not fit fails.",
    )
    max_store_bytes_in_flight: int | None = Field(
        None, ge=0, le=1 << 50,
        description="Backpressure: bytes of stores submitted to this tier and not yet "
        "finished (each pins its rows of the CPU primary tier). A store job that would go "
        "past it is dropped (counted in stores_dropped_backpressure, reported to vLLM as "
        "finished, never as failed) instead of queueing; a tier with nothing in flight always "
        "takes one job. Default: half the primary tier. 0: no bound.",
    )
    store_poll_ms: float = Field(
        2.0, gt=0, le=1000,
        description="While stores flow, an idle store thread looks at the queue this often "
        "instead of being woken (waking a thread is the costliest step of submit_store); "
        "a store waits at most this long to start.",
    )
    store_linger_s: float = Field(
        5.0, ge=0, le=3600,
        description="How long after the last store that polling goes on (it costs about "
        "1,000 / store_poll_ms wake-ups a second, none once it stops). 0: never poll; "
        "every store wakes a thread.",
    )
    presence_capacity: int = Field(
        1_000_000, ge=0, le=1 << 30,
        description="Keys remembered as stored or being stored by this process: lookups "
        "of stored ones HIT without I/O, stores of either are skipped. 0 turns both off. "
        "With admission, blocks offered and not written take a place until their turn: "
        "the index then remembers about the share written of this.",
    )
    admission: Literal["always", "reuse", "adaptive"] = Field(
        "always", description="Which offered blocks the tier writes (docs/admission.md). "
        "always: every block. reuse: a block once it has been offered "
        "admission_min_sightings times (loads count too). adaptive: every block while the "
        "tier has room; once it is full, a threshold of 1 or 2 sightings, whichever "
        "a sampled replay of the tier's own traffic finds better.",
    )
    admission_min_sightings: int = Field(
        2, ge=2, le=15, description="reuse: sightings (store offers and loads) of a block "
        "before it is written.",
    )
    admission_sketch_width: int = Field(
        1 << 18, ge=1 << 10, le=1 << 26, description="Size of the admission frequency "
        "sketch: 4 x this many one-byte counters (a power of two; 1 MiB at the default). "
        "Counters are halved every admission_sketch_width sightings. Make it at least the "
        "number of distinct blocks offered between two halvings; used by reuse and adaptive.",
    )
    admission_write_cost: float = Field(
        WRITE_COST, ge=0, le=1, description="adaptive: what a block write costs, in block "
        "hits. Once the tier is full, it writes every block only while that earns more than "
        "this many hits per write it adds over writing from the second sighting (0.08: 8 "
        "hits per 100 more writes). Raise it where writes are dear (s3 PUTs, with "
        "admission_capacity_bytes; a Redis whose memory is shared), lower it where they are "
        "cheap; for a gate at every size, use admission: reuse.",
    )
    admission_capacity_bytes: int | None = Field(
        None, ge=1 << 20, le=1 << 60, description="adaptive: the tier's capacity in bytes, "
        "where the backend cannot tell (s3; redis without maxmemory; fs without max_bytes), "
        "or in place of the backend's. Bytes used: the backend's count where it has a limit "
        "(fs max_bytes, redis maxmemory), else the bytes this process wrote, which only grow "
        "(objects expired by ttl_s or a lifecycle rule still count). Unset and unknown: "
        "unbounded, adaptive writes everything.",
    )
    enable_kv_events: bool = Field(
        False, description="Emit BlockStored events for stored blocks, and BlockRemoved "
        "events for blocks the tier heard leave (evicted by its capacity control or its "
        "server, expired, or deleted elsewhere: docs/redis.md, docs/fs.md) (needs KV "
        "events enabled globally)."
    )
    locality: Literal["LOCAL", "REMOTE"] | None = Field(
        None, description="Locality reported to vLLM; default LOCAL for fs, REMOTE otherwise."
    )
    read_through: bool = Field(
        False, description="This tier caches the kvstore tiers listed after it in "
        "secondary_tiers: a block vLLM promotes from one of them is also written here, in "
        "the background, as this tier writes any block (its admission, capacity, checksum). "
        "A node-local fs tier in front of a shared S3 bucket or Redis (docs/fleet.md).",
    )
    read_through_max_bytes: int = Field(
        1 << 30, ge=1 << 20, le=1 << 40, description="read_through: bytes of loaded blocks "
        "waiting to be written here; past it a loaded block is not cached (counted in "
        "read_through_dropped). Nothing is held for them but a note of their primary rows.",
    )
    load_timeout_s: float | None = Field(
        None, gt=0, le=3600,
        description="Deadline of one load job; past it the job fails (recompute)."
    )
    failure_threshold: int = Field(
        5, ge=1, le=1_000_000,
        description="Consecutive backend failures that open the circuit breaker."
    )
    breaker_cooldown_s: float = Field(
        5.0, gt=0, le=3600, description="Seconds the circuit stays open before a half-open probe."
    )
    namespace_salt: str | None = Field(
        None, description="Extra string mixed into the namespace (tenant isolation)."
    )
    model_fingerprint: Literal["sampled", "full", "off"] = Field(
        "sampled", description="How the model's files enter the namespace, so that KV of "
        "replaced weights at the same path is never served. sampled: config.json, the hub "
        "revision, each weight file's size, safetensors header and 16 blocks of 64 KiB; "
        "full: every weight byte (BLAKE3), cached per file version; off: the model name only "
        "(docs/model-identity.md).",
    )
    model_version: str | None = Field(
        None, min_length=1, description="Your own version string for the model; replaces the "
        "fingerprint (model_fingerprint is then not used). Change it whenever the weights do.",
    )
    encryption_key_env: str | None = Field(
        None, description="Name of an environment variable holding an AES key (16/24/32 "
        "bytes, hex or base64): payloads are encrypted with AES-GCM. Never the key itself.",
    )
    encryption_key_file: str | None = Field(
        None, description="Path of a file holding the AES key (hex, base64 or raw bytes); "
        "alternative to encryption_key_env.",
    )

    @field_validator("admission_sketch_width")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError("must be a power of two")
        return value

    @field_validator("encryption_key_env", "encryption_key_file")
    @classmethod
    def _named(cls, value: str | None) -> str | None:
        # An empty name would silently mean "no encryption".
        if value is not None and not value.strip():
            raise ValueError("must not be empty (leave the key out to store unencrypted)")
        return value

    def secret_remedy(self, key: str) -> str:
        """Where the secret held by ``key`` belongs instead of the config.

        Backends with secrets name their own way (an environment variable, a
        credential chain, a file); said by :func:`warn_inline_secrets`.
        """
        return "an environment variable or a file that the backend reads (docs/security.md)"


C = TypeVar("C", bound=TierConfig)


def url_port(parts: SplitResult) -> int | None:
    """The port of a split URL (None if it has none); ValueError unless 1-65535."""
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 0 < port < 65536:
        raise ValueError("port must be 1-65535")
    return port


def file_path(value: str | None) -> str | None:
    """Validator of a key that names a file: its path, never its contents.

    PEM or other multi-line text is refused, so a private key pasted in place
    of its path fails start-up (the message names the key, not the value)
    rather than sitting in the config that vLLM logs.
    """
    if value is not None and ("-----BEGIN" in value or "\n" in value):
        raise ValueError("must be the path of a file, not its contents")
    return value


def _holds_credentials(value: Any) -> bool:
    values = value if isinstance(value, list) else [value]
    return any(isinstance(v, str) and redact_url(v) != v for v in values)


def inline_secret_keys(config: TierConfig) -> list[str]:
    """The keys of ``config`` whose value holds a secret, in field order.

    A set :class:`~pydantic.SecretStr` (``password``, ``aws_secret_access_key``,
    a plugin's secrets), or a URL or node list with credentials in it (what
    :func:`~kvstore_tiers.redact.redact_url` would hide). Never the values.
    """
    keys = []
    for name in type(config).model_fields:
        value = getattr(config, name)
        if isinstance(value, SecretStr):
            if value.get_secret_value():
                keys.append(name)
        elif _holds_credentials(value):
            keys.append(name)
    return keys


def inline_secret_advice(config: TierConfig) -> str | None:
    """What holds a secret in ``config`` and where it belongs instead; None if nothing.

    Names every key of :func:`inline_secret_keys` with its way out
    (:meth:`TierConfig.secret_remedy`), never a value.
    """
    keys = inline_secret_keys(config)
    if not keys:
        return None
    by_remedy: dict[str, list[str]] = {}
    for key in keys:
        by_remedy.setdefault(config.secret_remedy(key), []).append(f"'{key}'")
    if len(by_remedy) == 1:
        remedies = next(iter(by_remedy))
    else:
        remedies = "; ".join(f"{', '.join(named)}: {way}" for way, named in by_remedy.items())
    subject = f"key '{keys[0]}' holds" if len(keys) == 1 else "keys " + ", ".join(
        f"'{k}'" for k in keys) + " hold"
    return f"{subject} a secret; instead use {remedies}"


def warn_inline_secrets(config: TierConfig, tier_type: str) -> None:
    """One warning, at a tier's start-up, if ``config`` holds secrets.

    vLLM's server prints its whole ``--kv-transfer-config`` in its
    ``non-default args`` line, so such a secret is in the server log. The
    warning is :func:`inline_secret_advice`: keys and ways out, never a value.
    """
    advice = inline_secret_advice(config)
    if advice is not None:
        logger.warning(
            "secondary tier '%s': %s. vLLM's server logs the whole --kv-transfer-config at "
            "start-up (its 'non-default args' line), so its log holds the secret too.",
            tier_type, advice)


def validate_config(model: type[C], tier_type: str, values: dict[str, Any]) -> C:
    """Validate ``values`` against ``model``; raise ConfigError naming every bad key."""
    try:
        return model(**values)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "<config>"
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                allowed = ", ".join(sorted(model.model_fields))
                msg = f"unknown key (accepted keys: {allowed})"
            problems.append(f"key '{loc}': {msg}")
        raise ConfigError(
            f"invalid config for secondary tier '{tier_type}': " + "; ".join(problems)
        ) from None
