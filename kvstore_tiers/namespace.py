"""The storage namespace: which model/dtype/layout a block belongs to.

We start from vLLM's own :class:`FileMapper` run config (model name, tokens
per hash, blocks per chunk, parallel layout, KV cache dtype, KV cache groups,
canonical format), so our namespace changes whenever vLLM's stock tiers would
consider blocks incompatible, and add what that config leaves out but the KV
bytes depend on (docs/model-identity.md has the table):

* ``model_identity``: the model's revision, config and weight fingerprint, or
  an explicit ``model_version`` (:mod:`kvstore_tiers.fingerprint`);
* the parallel layout for the direct KV layout, which vLLM would collapse
  although its rank-major chunk bytes differ between TP sizes
  (:func:`parallel_agnostic_layout`);
* ``kv_cache_layout``: the resolved KV cache layout, which FileMapper only
  records for the canonical format although the direct layout's bytes depend
  on it as much;
* ``engine``: the model dtype (vLLM's ``dtype`` field is the KV cache dtype,
  so the model's own is lost once ``--kv-cache-dtype`` is set), the
  quantisation method (on-the-fly quantisation changes no file), and the
  Mamba state dtypes when set.

Its digest goes into every frame header; its name prefixes every object.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvstore_tiers.fingerprint import (
    FingerprintError,
    FingerprintMode,
    ModelIdentity,
    model_identity,
)
from kvstore_tiers.frame import NAMESPACE_DIGEST_BYTES
from kvstore_tiers.naming import object_name

logger = logging.getLogger(__name__)

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
    identity: ModelIdentity | None = field(default=None, compare=False)

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
    def from_offloading_spec(
        cls, spec: Any, salt: str | None = None, *,
        model_fingerprint: FingerprintMode = "off", model_version: str | None = None,
        engine_config: Any | None = None,
    ) -> Namespace:
        """Build from a vLLM OffloadingSpec: vLLM's FileMapper run config plus
        the fields it leaves out (module doc).

        ``engine_config`` is the engine's VllmConfig; by default the one of
        the engine building the tier (:func:`current_engine_config`); the
        engine fields are left out when there is none (a manager built outside
        an engine) and make the namespace private to this process when an
        engine builds the tier but its config cannot be read. Raises
        :class:`~kvstore_tiers.fingerprint.FingerprintError` when the model's
        files cannot be fingerprinted."""
        from vllm.v1.kv_offload.file_mapper import FileMapper

        mapper = FileMapper.from_offloading_spec(
            root_dir="",
            offloading_spec=spec,
            blocks_per_file=spec.blocks_per_chunk,
            parallel_agnostic=parallel_agnostic_layout(spec.config),
        )
        cfg = mapper.get_run_config()
        unreadable: dict[str, str] = {}
        vllm_config = engine_config
        if vllm_config is None:
            try:
                vllm_config = current_engine_config()
            except EngineConfigUnreadable as exc:
                unreadable = unreadable_engine_fields(exc)
        layout = getattr(spec.config, "kv_cache_layout", None)
        if layout is None and vllm_config is not None:
            layout = getattr(vllm_config.cache_config, "kv_cache_layout", None)
        if layout is not None:
            cfg["kv_cache_layout"] = str(layout)
        engine = unreadable or engine_fields(vllm_config)
        if engine:
            cfg["engine"] = engine
        model_cfg = getattr(vllm_config, "model_config", None)
        try:
            identity = model_identity(
                spec.config.model.name, model_fingerprint, version=model_version,
                revision=getattr(model_cfg, "revision", None),
                download_dir=getattr(getattr(vllm_config, "load_config", None),
                                     "download_dir", None),
            )
        except FingerprintError as exc:
            if vllm_config is not None:
                raise  # an engine whose model files we cannot see: fail at start-up
            # A manager built outside an engine (tests, benchmarks, the CLI's
            # check) on a model name with no files: the name alone, said aloud.
            logger.warning("kvstore namespace: %s; the model is identified by its name only",
                           exc)
            identity = ModelIdentity(mode="unresolved")
        if identity.fields():
            cfg["model_identity"] = identity.fields()
        ns = cls.from_run_config(cfg, salt=salt)
        return cls(ns.run_config, ns.name, ns.digest, ns.dtype_bytes, identity)

    def describe(self) -> str:
        """The namespace and what identifies it, for the start-up log line."""
        cfg = self.run_config
        parts = [f"model {cfg.get('model_name')}", f"kv dtype {cfg.get('dtype')}"]
        if "kv_cache_layout" in cfg:
            parts.append(f"layout {cfg['kv_cache_layout']}")
        parts += [f"{k} {v}" for k, v in sorted(cfg.get("engine", {}).items())]
        parts.append(f"identity {self.identity.describe() if self.identity else 'off'}")
        return f"{self.name} ({', '.join(parts)})"

    def object_name(self, key: bytes) -> str:
        """Backend-neutral object name of an OffloadKey (see :mod:`kvstore_tiers.naming`)."""
        return object_name(self.name, key)


def parallel_agnostic_layout(config: Any) -> bool:
    """Whether a chunk's bytes may be shared across parallel layouts.

    vLLM calls the direct layout parallelism-agnostic when each TP rank holds
    a distinct share of the KV heads, but the chunk the secondary tiers see is
    the shared offload region's row, which is rank-major: ``[rank 0: every
    layer's page][rank 1: every layer's page]``. With more than one layer
    that is not the TP=1 row's byte order, and a TP=1 engine served a TP=2
    engine's chunk generates other tokens (tests/e2e/test_tensor_parallel.py
    showed it before this check). So only the layouts whose bytes are the
    same by construction collapse the parallel fields: the canonical format
    (topology-free pages, certified per layer by vLLM, which FileMapper
    still gates on ``is_parallelism_agnostic``) and the replicated MLA layout
    (one copy of identical bytes). The direct layout keeps tp/pp/pcp/dcp."""
    return bool(getattr(config, "canonical_layout", False)
                or getattr(config, "replicated_layout", False))


class EngineConfigUnreadable(LookupError):
    """vLLM's engine is building this tier, but its VllmConfig was not found."""


#: Modules with a frame on the stack only while vLLM's engine builds the
#: connector (the scheduler, the connector factory and the connector). A
#: manager built by hand (the harness, the CLI) calls vllm.v1.kv_offload only.
_ENGINE_MODULES = ("vllm.v1.core.", "vllm.v1.engine.", "vllm.distributed.kv_transfer.")
_MAX_FRAMES = 40


def current_engine_config() -> Any | None:
    """The VllmConfig of the engine that is building this tier, or None when
    no engine is (a manager built by hand).

    vLLM hands a tier only the normalised OffloadingConfig, which drops the
    model dtype (once the KV cache dtype is set), the quantisation method,
    the revision and the download directory; neither the OffloadingSpec nor
    the tier factory carries the VllmConfig (vLLM 0.32 and 0.33 alike). The
    supported source, vLLM's current config, is used when set, but the
    scheduler builds its connector outside ``set_current_vllm_config``. The
    fallback, on both versions: the connector's constructor holds the
    engine's config as its ``vllm_config`` argument a few frames up
    (``OffloadingConnector.__init__``, ``OffloadingConnectorScheduler.__init__``),
    and the nearest frame whose ``vllm_config`` is a VllmConfig is read
    (once, at start-up).
    tests/unit/test_engine_config_read.py builds the connector through vLLM's
    own factory on each version.

    Raises :class:`EngineConfigUnreadable` when an engine frame is on the
    stack but no frame holds its config (a vLLM that builds connectors in
    another way): the caller then makes the namespace private, never shared.
    """
    try:
        from vllm.config import VllmConfig, get_current_vllm_config_or_none
    except ImportError:
        return None
    current = get_current_vllm_config_or_none()
    if current is not None:
        return current
    in_engine = False
    frame = sys._getframe(1)
    depth = 0
    # The config is looked for in the nearest frames only; the engine's
    # modules anywhere on the stack, so that a deeper build fails closed.
    while frame is not None:
        if depth < _MAX_FRAMES:
            candidate = frame.f_locals.get("vllm_config")
            if isinstance(candidate, VllmConfig):
                return candidate
        in_engine = in_engine or str(frame.f_globals.get("__name__", "")).startswith(
            _ENGINE_MODULES)
        frame = frame.f_back
        depth += 1
    if in_engine:
        raise EngineConfigUnreadable("vLLM's engine is building this tier, but its "
                                     "configuration was not found on the call stack")
    return None


def unreadable_engine_fields(exc: EngineConfigUnreadable) -> dict[str, str]:
    """Engine fields that no other process can match: a namespace private to
    this process (every lookup of a block stored by another engine misses)."""
    logger.warning("kvstore namespace: %s; the model dtype, quantisation and revision "
                   "cannot enter the namespace, so this tier's namespace is private to "
                   "this process (no KV is shared with other engines)", exc)
    return {"unreadable": uuid.uuid4().hex}


def engine_fields(vllm_config: Any | None) -> dict[str, str]:
    """The fields of the engine's config that change KV bytes and that vLLM's
    run config leaves out (empty without an engine config)."""
    if vllm_config is None:
        return {}
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    out = {"model_dtype": str(model.dtype).removeprefix("torch.")}
    if model.quantization:
        out["quantization"] = str(model.quantization)
    for key in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
        value = getattr(cache, key, "auto")
        if value and value != "auto":
            out[key] = str(value)
    return out
