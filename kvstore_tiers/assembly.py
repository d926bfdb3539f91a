"""How a tier is put together: its collaborators, each built by one small function.

:class:`~kvstore_tiers.tier.KVStoreTier`'s constructor reads as a list of
these calls; each builds one collaborator from the validated config (and
vLLM's offloading spec) and nothing else, so each can be read, and changed,
alone. Runs once, at engine start-up: a bad config fails here, naming its key.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstore_tiers.admission import (
    PROBE_INTERVAL_S,
    AdaptivePolicy,
    AdmissionLayer,
    CapacitySignal,
    FrequencySketch,
    Policy,
    ReusePolicy,
)
from kvstore_tiers.compat import secondary_tier_configs
from kvstore_tiers.config import TierConfig, validate_config, warn_inline_secrets
from kvstore_tiers.errors import ConfigError
from kvstore_tiers.fingerprint import FingerprintError
from kvstore_tiers.frame import FrameCodec
from kvstore_tiers.layer import TierLayer
from kvstore_tiers.namespace import Namespace
from kvstore_tiers.pool import IOPool
from kvstore_tiers.ratelimit import RateLimitedLogger
from kvstore_tiers.readthrough import Intake, ReadThrough, check_one_caching_tier

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingEvent, OffloadingSpec

    from kvstore_tiers.backends.base import Backend, IOTuning
    from kvstore_tiers.codecs import CodecId
    from kvstore_tiers.crypto import PayloadCipher
    from kvstore_tiers.metrics import TierCounters
    from kvstore_tiers.presence import PresenceIndex

logger = logging.getLogger("kvstore_tiers.tier")


def tier_config(model: type[TierConfig], offloading_spec: OffloadingSpec, tier_type: str,
                values: dict[str, Any]) -> TierConfig:
    """The tier's validated config, before anything is opened: its own keys,
    and what it must agree on with the other tiers of the same
    ``secondary_tiers`` (one tier sets ``read_through``); a ConfigError naming
    the key otherwise. Warns once of secrets written inline."""
    config = validate_config(model, tier_type, values)
    warn_inline_secrets(config, tier_type)
    if config.read_through:
        check_one_caching_tier(secondary_tier_configs(offloading_spec), tier_type)
    return config


def default_detector(remote: bool, tier_type: str, config: TierConfig) -> Any | None:
    """The backpressure detector of a remote tier configured without one (else None)."""
    if not remote:
        return None
    from kvstore_tiers.compat import make_default_remote_detector

    return make_default_remote_detector(tier_type, config.failure_threshold)


def open_cipher(config: TierConfig) -> PayloadCipher | None:
    """The payload cipher, if an encryption key is configured."""
    from kvstore_tiers.crypto import PayloadCipher, load_key

    key = load_key(config.encryption_key_env, config.encryption_key_file)
    return PayloadCipher(key) if key is not None else None  # only the cipher keeps the key


def make_namespace(offloading_spec: OffloadingSpec, config: TierConfig,
                   cipher: PayloadCipher | None, tier_type: str) -> Namespace:
    """The tier's namespace: vLLM's run config, the model's identity, and with
    a cipher, one per key.

    Different keys -> different namespaces: tenants never address (or delete
    as corrupt) each other's objects; a rotation starts fresh. Model files
    that cannot be fingerprinted fail start-up naming the key.
    """
    salt = config.namespace_salt
    if cipher is not None:
        salt = f"{salt or ''}|key:{cipher.key_id}"
    try:
        return Namespace.from_offloading_spec(
            offloading_spec, salt, model_fingerprint=config.model_fingerprint,
            model_version=config.model_version)
    except FingerprintError as exc:
        raise ConfigError(f"secondary tier '{tier_type}': key 'model_fingerprint': {exc}; "
                          "set model_version, or model_fingerprint: off") from None


def event_list(offloading_spec: OffloadingSpec, config: TierConfig, tier_type: str
               ) -> list[OffloadingEvent] | None:
    """The tier's kv event buffer, or None when it emits none."""
    if not config.enable_kv_events:
        return None
    if offloading_spec.kv_events_config.enable_kv_cache_events:
        return []
    logger.warning(
        "enable_kv_events is set on tier '%s' but KV cache events are disabled "
        "globally; the tier will not emit events.", tier_type,
    )
    return None


def plan_batches(tuning: IOTuning, row_bytes: int) -> tuple[int, int]:
    """``(store_batch, load_batch)``: chunks per I/O task.

    Stores go ``store_batch`` chunks per task, loads ``load_batch`` (fs: a
    whole job, read in parallel inside the task; a pipeline's worth for
    redis/s3), and no load task carries more than ``max_load_batch_bytes``
    of rows.
    """
    load_batch = tuning.load_batch
    if tuning.max_load_batch_bytes:
        load_batch = max(1, min(load_batch, tuning.max_load_batch_bytes // max(1, row_bytes)))
    return tuning.store_batch, load_batch


def start_pool(config: TierConfig, tier_type: str, namespace: Namespace, codec_id: CodecId,
               header_align: int, cipher: PayloadCipher | None) -> IOPool:
    """The tier's I/O threads, each with its own frame codec."""
    digest = namespace.digest
    return IOPool(
        config.n_read_threads, config.n_write_threads, config.max_queued_chunks,
        ctx_factory=lambda: FrameCodec(digest, codec_id, header_align, cipher),
        name=f"kvstore_{tier_type}",
        store_poll_s=config.store_poll_ms / 1000, store_linger_s=config.store_linger_s,
    )


def admission_policy(config: TierConfig, backend: Backend, counters: TierCounters,
                     row_bytes: int) -> Policy | None:
    """The tier's store admission policy; None for ``admission: always`` (no call at all).

    ``adaptive`` starts its probe thread here (stopped by the policy's ``close``)."""
    if config.admission == "always":
        return None
    sketch = FrequencySketch(config.admission_sketch_width)
    if config.admission == "reuse":
        return ReusePolicy(sketch, config.admission_min_sightings)
    bounded = type(backend).supports_capacity
    signal = CapacitySignal(backend.capacity_usage if bounded else None,
                            config.admission_capacity_bytes, counters, row_bytes,
                            evictions=_evicted_for_capacity(backend),
                            object_bytes=backend.object_bytes if bounded else None)
    signal.refresh()
    policy = AdaptivePolicy(sketch, signal, write_cost=config.admission_write_cost)
    policy.start(PROBE_INTERVAL_S)
    return policy


def _evicted_for_capacity(backend: Backend) -> Callable[[], int] | None:
    """The reader of the backend's count of objects it evicted for capacity
    (None where its store never evicts)."""
    log = backend.evictions
    return None if log is None else lambda: log.for_capacity


def store_backlog_bound(configured: int | None, primary_bytes: int) -> float:
    """The effective ``max_store_bytes_in_flight``: half the primary by default, 0 unbounded."""
    if configured is None:
        return primary_bytes / 2
    return configured or float("inf")


def layers(config: TierConfig, tier_type: str, backend: Backend, counters: TierCounters,
           presence: PresenceIndex, pool: IOPool, store_batch: int, row_bytes: int
           ) -> list[TierLayer]:
    """What the tier composes around its transfers (:mod:`kvstore_tiers.layer`), in
    the order it composes them; empty when the config adds nothing.

    * store admission (:class:`~kvstore_tiers.admission.AdmissionLayer`), unless
      ``admission: always``;
    * read-through (:class:`~kvstore_tiers.readthrough.ReadThrough`), with
      ``read_through``; last, so that its fills run with the context every
      other layer composed (they pass the tier's store filter).
    """
    out: list[TierLayer] = []
    policy = admission_policy(config, backend, counters, row_bytes)
    if policy is not None:
        out.append(AdmissionLayer(policy, counters, RateLimitedLogger(logger, interval_s=30.0),
                                  tier_type))
    if config.read_through:
        intake = Intake(tier_type, row_bytes, config.read_through_max_bytes, store_batch, counters)
        out.append(ReadThrough(intake, presence, pool))
    return out
