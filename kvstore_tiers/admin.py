"""Administration of a store, written once for every backend.

What the ``kvstore-tiers`` commands ``stats``, ``verify`` and ``gc`` do, on
any :class:`~kvstore_tiers.backends.base.Backend` through its administrative
methods only (``iter_objects``, ``get``, ``delete``): so a backend added as a
plugin gets them for free.

An admin store is opened *without* a namespace: it sees every namespace under
the tier's root (fs ``root_dir``, s3 ``prefix``, redis ``key_prefix``), and
object names are the backend-neutral ``<namespace>/<aaa>/<hash>_g<group>.kvf``
of :meth:`Namespace.object_name`.

Safety: every operation here may run while engines use the store. Deleting an
object is always safe (the next lookup is a miss and vLLM recomputes), and
nothing here writes block data.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvstore_tiers.backends.base import Backend, ObjectInfo
from kvstore_tiers.config import validate_config
from kvstore_tiers.errors import ConfigError, ObjectCorrupt, ObjectMissing
from kvstore_tiers.frame import CODEC_ENCRYPTED, FrameCodec, parse_header
from kvstore_tiers.namespace import key_from_object_name

#: Keys of a tier dict that vLLM consumes and a backend config does not accept.
VLLM_TIER_KEYS = ("type", "module_path", "backpressure")
#: Upper bounds (seconds) of the age histogram buckets; the last one is open.
AGE_BUCKETS: tuple[tuple[str, float], ...] = (
    ("<1m", 60), ("<10m", 600), ("<1h", 3600), ("<6h", 6 * 3600), ("<1d", 86400),
    ("<7d", 7 * 86400), ("<30d", 30 * 86400), (">=30d", float("inf")),
)


# ------------------------------------------------------------------ config text
def parse_tiers(text_or_path: str) -> list[dict[str, Any]]:
    """The tier dicts in a user's config, as JSON text or the path of a JSON file.

    Accepts what a user gives vLLM: a list of tier dicts, one tier dict, a
    ``kv_connector_extra_config`` with ``secondary_tiers`` inside, or a whole
    ``--kv-transfer-config`` (``kv_connector_extra_config.secondary_tiers``).
    Raises ConfigError saying what is wrong with the text.
    """
    path = Path(text_or_path)
    try:
        text = path.read_text() if len(text_or_path) < 4096 and path.is_file() else text_or_path
    except OSError as exc:
        raise ConfigError(f"cannot read {text_or_path!r}: {exc}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"not a JSON file or JSON string: {exc}") from None
    if isinstance(data, dict):
        if isinstance(data.get("kv_connector_extra_config"), dict):
            data = data["kv_connector_extra_config"]
        data = data.get("secondary_tiers", [data])
    if not isinstance(data, list) or not data:
        raise ConfigError("expected a tier dict, a list of them, or a config with "
                          "'secondary_tiers'")
    for i, tier in enumerate(data):
        if not isinstance(tier, dict):
            raise ConfigError(f"secondary_tiers[{i}] is not a JSON object")
        if "type" not in tier:
            raise ConfigError(f"secondary_tiers[{i}]: key 'type' is missing")
    return data


def backend_type(tier: Mapping[str, Any]) -> str:
    """The kvstore backend name of a tier dict (``fs``, ``s3``, ``redis``, a plugin's)."""
    return str(tier["type"])


def validate_tier(tier: Mapping[str, Any]) -> tuple[type[Backend], Any]:
    """(backend class, validated config) of a tier dict; ConfigError names bad keys."""
    from kvstore_tiers.registry import load_backend

    name = backend_type(tier)
    cls = load_backend(name)
    values = {k: v for k, v in tier.items() if k not in VLLM_TIER_KEYS}
    return cls, validate_config(cls.config_model, name, values)


# ------------------------------------------------------------------ admin store
@contextlib.contextmanager
def open_store(tier: Mapping[str, Any]) -> Iterator[Backend]:
    """A backend over every namespace of the tier, for administration; closed on exit.

    fs is not ``open()``-ed: its open creates the namespace directory and
    writes ``config.json``, which an admin command must not do (and the root
    must already exist: ConfigError otherwise). Remote backends are opened so
    that a wrong endpoint or credentials fail here with their usual message.
    """
    cls, config = validate_tier(tier)
    # Namespace name "" puts the fs backend's base at root_dir; remote backends
    # only read ``.name``/``.run_config`` with getattr, so None-like values are fine.
    ns: Any = SimpleNamespace(name="", run_config=None, digest=b"\0" * 16, dtype_bytes=None)
    if cls.name == "fs":
        backend = cls(config, ns)
        if not Path(backend.root).is_dir():
            raise ConfigError(f"fs tier: key 'root_dir': {str(backend.root)!r} is not a directory")
        try:
            yield backend
        finally:
            backend.close()
        return
    if cls.name == "s3":
        ns = None  # no namespace: the probe writes no config.json
    backend = cls(config, ns)
    backend.open()
    try:
        yield backend
    finally:
        backend.close()


def namespace_of(name: str) -> str:
    """The namespace part of an object name."""
    return name.split("/", 1)[0]


def read_run_config(backend: Backend, namespace: str) -> dict[str, Any] | None:
    """The vLLM run config a namespace was created with (its ``config.json``), if stored.

    fs writes ``<root>/<ns>/config.json`` and s3 ``<prefix><ns>/config.json``;
    both are reachable with ``backend.get("<ns>/config.json")``. Redis stores
    none (None).
    """
    try:
        data = backend.get(f"{namespace}/config.json")
        out = json.loads(bytes(data))
    except (ObjectMissing, ValueError, OSError):
        return None
    except Exception:  # a backend error on an optional file: report it as unknown
        return None
    return out if isinstance(out, dict) else None


def describe_run_config(cfg: Mapping[str, Any] | None) -> dict[str, str]:
    """model / dtype / layout of a run config, as short strings ("?" when unknown)."""
    if not cfg:
        return {"model": "?", "dtype": "?", "layout": "?"}
    layout_keys = ("tp_size", "pp_size", "pcp_size", "dcp_size", "tokens_per_hash",
                   "blocks_per_chunk", "blocks_per_file")
    parts = [f"{k}={cfg[k]}" for k in layout_keys if k in cfg]
    return {"model": str(cfg.get("model_name", "?")), "dtype": str(cfg.get("dtype", "?")),
            "layout": " ".join(parts) or "?"}


# ------------------------------------------------------------------------ stats
@dataclass
class NamespaceStats:
    objects: int = 0
    bytes: int = 0
    oldest: float | None = None
    newest: float | None = None
    run_config: dict[str, Any] | None = None


@dataclass
class StoreStats:
    """What ``kvstore-tiers stats`` reports: totals, per namespace, ages."""

    objects: int = 0
    bytes: int = 0
    namespaces: dict[str, NamespaceStats] = field(default_factory=dict)
    #: AGE_BUCKETS label -> (objects, bytes)
    ages: dict[str, list[int]] = field(
        default_factory=lambda: {label: [0, 0] for label, _ in AGE_BUCKETS})

    def as_dict(self) -> dict[str, Any]:
        return {
            "objects": self.objects, "bytes": self.bytes,
            "namespaces": {k: {"objects": v.objects, "bytes": v.bytes, "oldest": v.oldest,
                               "newest": v.newest, **describe_run_config(v.run_config)}
                           for k, v in self.namespaces.items()},
            "age_histogram": {k: {"objects": o, "bytes": b} for k, (o, b) in self.ages.items()},
        }


def age_bucket(age_s: float) -> str:
    for label, bound in AGE_BUCKETS:
        if age_s < bound:
            return label
    return AGE_BUCKETS[-1][0]


def collect_stats(backend: Backend, namespace: str | None = None,
                  now: float | None = None) -> StoreStats:
    """Count objects and bytes per namespace and by age (object mtime: fs mtime =
    last use when capped, s3 LastModified = write, redis frame created_ms)."""
    now = time.time() if now is None else now
    st = StoreStats()
    for obj in backend.iter_objects(f"{namespace}/" if namespace else ""):
        ns = st.namespaces.setdefault(namespace_of(obj.name), NamespaceStats())
        ns.objects += 1
        ns.bytes += obj.size
        ns.oldest = obj.mtime if ns.oldest is None else min(ns.oldest, obj.mtime)
        ns.newest = obj.mtime if ns.newest is None else max(ns.newest, obj.mtime)
        st.objects += 1
        st.bytes += obj.size
        bucket = st.ages[age_bucket(max(0.0, now - obj.mtime))]
        bucket[0] += 1
        bucket[1] += obj.size
    for name, ns in st.namespaces.items():
        ns.run_config = read_run_config(backend, name)
    return st


# ----------------------------------------------------------------------- verify
@dataclass
class VerifyReport:
    checked: int = 0
    ok: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    missing: int = 0  # vanished between listing and reading (evicted, expired)
    #: (object name, reason)
    corrupt: list[tuple[str, str]] = field(default_factory=list)
    deleted: int = 0
    codecs: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"checked": self.checked, "ok": self.ok, "missing": self.missing,
                "corrupt": [{"name": n, "reason": r} for n, r in self.corrupt],
                "deleted": self.deleted, "raw_bytes": self.raw_bytes,
                "stored_bytes": self.stored_bytes, "codecs": dict(self.codecs)}


def verify_frame(name: str, frame: bytes | bytearray | memoryview,
                 codec_name: Callable[[int], str] | None = None) -> tuple[int, int]:
    """Check one stored object fully; returns (codec id, raw_len) or raises ObjectCorrupt.

    Checks: the name is an object name; the header parses (magic, version,
    lengths); the header's key is the one the name encodes; the header's
    namespace digest is the one the namespace name encodes (its 12 hex
    digits are the digest's first 6 bytes); the object length is the
    frame's; the payload decodes to ``raw_len`` bytes whose CRC-32C matches.
    """
    key = key_from_object_name(name)
    if key is None:
        raise ObjectCorrupt("object name is not a block name")
    header = parse_header(frame)
    if header.key != key:
        raise ObjectCorrupt("frame belongs to another key than its name says")
    ns_hex = namespace_of(name).rsplit("_", 1)[-1]
    if len(ns_hex) == 12 and header.namespace.hex()[:12] != ns_hex:
        raise ObjectCorrupt("frame belongs to another namespace than its name says")
    if len(frame) != header.total_len:
        raise ObjectCorrupt(f"object is {len(frame)} bytes, frame says {header.total_len}")
    if header.encrypted:
        # Without the tenant's key the payload cannot be decrypted: the
        # header, name, namespace and length checks above are what an
        # operator's verify can do (the tier itself authenticates every load).
        return header.codec, header.raw_len
    dest = memoryview(bytearray(header.raw_len))
    codec = FrameCodec(header.namespace, header.codec)  # type: ignore[arg-type]
    try:
        codec.decode_payload_into(header, memoryview(frame)[header.header_len:], dest)
    except ObjectCorrupt:
        raise
    except Exception as exc:  # a codec library error on garbage is corruption too
        raise ObjectCorrupt(f"payload does not decode: {exc}") from None
    return header.codec, header.raw_len


def verify_store(backend: Backend, *, sample: int | None = None, delete: bool = False,
                 namespace: str | None = None, seed: int | None = None,
                 progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Read every object (or a random ``sample`` of them) and check it with
    :func:`verify_frame`; with ``delete`` remove the corrupt ones."""
    from kvstore_tiers.codecs import CodecId

    objs: list[ObjectInfo] = list(backend.iter_objects(f"{namespace}/" if namespace else ""))
    if sample is not None and sample < len(objs):
        objs = random.Random(seed).sample(objs, sample)
    rep = VerifyReport()
    for i, obj in enumerate(objs):
        rep.checked += 1
        try:
            frame = backend.get(obj.name)
        except ObjectMissing:
            rep.missing += 1
            continue
        try:
            codec, raw_len = verify_frame(obj.name, frame)
        except ObjectCorrupt as exc:
            rep.corrupt.append((obj.name, str(exc)))
            if delete:
                backend.delete(obj.name)
                rep.deleted += 1
        else:
            rep.ok += 1
            rep.raw_bytes += raw_len
            rep.stored_bytes += len(frame)
            label = "encrypted+" if codec & CODEC_ENCRYPTED else ""
            try:
                rep.codecs[label + CodecId(codec & ~CODEC_ENCRYPTED).name.lower()] += 1
            except ValueError:
                rep.codecs[str(codec)] += 1
        if progress is not None:
            progress(i + 1, len(objs))
    return rep


# --------------------------------------------------------------------------- gc
@dataclass(frozen=True)
class GcOutcome:
    """What :func:`gc` did (or would do with ``dry_run``)."""

    scanned_objects: int
    scanned_bytes: int
    deleted_objects: int
    deleted_bytes: int
    method: str  # "generic", "s3 DeleteObjects", "redis UNLINK pipeline"

    @property
    def remaining_bytes(self) -> int:
        return self.scanned_bytes - self.deleted_bytes


def plan_gc(objs: list[ObjectInfo], *, max_age_s: float | None, max_bytes: int | None,
            now: float) -> list[ObjectInfo]:
    """The objects to delete: older than ``max_age_s``, then the oldest of the
    rest until at most ``max_bytes`` remain (the same policy as the s3/redis
    fast paths)."""
    doomed: list[ObjectInfo] = []
    keep: list[ObjectInfo] = []
    for o in objs:
        (doomed if max_age_s is not None and now - o.mtime > max_age_s else keep).append(o)
    if max_bytes is not None:
        keep.sort(key=lambda o: o.mtime)
        remaining = sum(o.size for o in keep)
        for o in keep:
            if remaining <= max_bytes:
                break
            doomed.append(o)
            remaining -= o.size
    return doomed


def gc_generic(backend: Backend, *, max_age_s: float | None = None,
               max_bytes: int | None = None, namespace: str | None = None,
               dry_run: bool = False, now: float | None = None) -> GcOutcome:
    """:func:`plan_gc` over ``iter_objects``, then ``delete_many`` (any backend)."""
    now = time.time() if now is None else now
    objs = list(backend.iter_objects(f"{namespace}/" if namespace else ""))
    doomed = plan_gc(objs, max_age_s=max_age_s, max_bytes=max_bytes, now=now)
    if not dry_run:
        # fs shard directories stay: the fs backend creates them once and
        # relies on them so that stores never mkdir.
        backend.delete_many([o.name for o in doomed])
    return GcOutcome(len(objs), sum(o.size for o in objs), len(doomed),
                     sum(o.size for o in doomed), "generic")


def gc(tier: Mapping[str, Any], *, max_age_s: float | None = None,
       max_bytes: int | None = None, namespace: str | None = None,
       dry_run: bool = False) -> GcOutcome:
    """Garbage-collect the store a tier dict describes, by age and/or down to a size.

    Sizes are as each backend lists them (fs: file
    length; the capacity controller of a running engine re-counts from disk).
    """
    if max_age_s is None and max_bytes is None:
        raise ConfigError("gc needs --max-age and/or --max-bytes")
    with open_store(tier) as backend:
        outcome = gc_generic(backend, max_age_s=max_age_s, max_bytes=max_bytes,
                             namespace=namespace, dry_run=dry_run)
        sweep = getattr(backend, "sweep_temp_files", None)  # fs: killed writers' temp files
        if sweep is not None and not dry_run:
            sweep()
        return outcome


# ------------------------------------------------------------------------ check
@dataclass
class CheckReport:
    """Outcome of :func:`check_tier` for one tier."""

    tier_type: str
    ok: bool
    backend: str = ""
    namespace: str = ""
    codec: str = ""
    o_direct: bool | None = None
    store_ms: float = 0.0
    load_ms: float = 0.0
    block_bytes: int = 0
    stored_bytes: int = 0
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def check_tier(tier: Mapping[str, Any], *, block_bytes: int = 256 << 10,
               timeout_s: float = 30.0) -> CheckReport:
    """Validate, connect and round-trip one block through vLLM's real manager.

    The tier is built by vLLM's ``SecondaryTierFactory`` inside a real
    ``TieringOffloadingManager`` (:func:`kvstore_tiers.harness.build_harness`),
    so this checks exactly what ``vllm serve`` would build. One random block
    is stored, the primary forgets it, it is looked up and loaded back, and
    the bytes are compared. Never raises for a tier problem: the report
    carries the error message.
    """
    import numpy as np

    from kvstore_tiers.harness import build_harness, make_keys

    kind = backend_type(tier) if "type" in tier else "?"
    rep = CheckReport(tier_type=kind, ok=False, block_bytes=block_bytes)
    try:
        validate_tier(tier)
    except ConfigError as exc:
        rep.error = str(exc)
        return rep
    try:
        h = build_harness([dict(tier)], num_chunks=4, chunk_bytes=block_bytes)
    except Exception as exc:  # ConfigError from the tier, or vLLM refusing the config
        rep.error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, ConfigError) \
            else str(exc)
        return rep
    try:
        t = h.tiers[0]
        rep.backend = t.backend.describe()
        rep.namespace = t.namespace.name
        rep.codec = t.codec_id.name.lower()
        rep.o_direct = getattr(t.backend, "use_o_direct", None)
        key = make_keys(1, seed=int(time.time_ns() % (1 << 31)))
        rows = np.random.default_rng().integers(0, 256, (1, block_bytes), dtype=np.uint8)
        t0 = time.perf_counter()
        ctx = h.store(key, rows)
        h.settle(timeout_s)
        rep.store_ms = (time.perf_counter() - t0) * 1e3
        h.finish_request(ctx)
        c = t.counters
        if c.objects_stored + c.objects_skipped < 1:
            rep.error = f"store failed ({c.store_failures} failures, {c.stores_dropped} dropped)"
            return rep
        rep.stored_bytes = c.stored_bytes_written
        h.forget_primary()
        t._presence.discard(key[0])  # force a real existence check and a real load
        ctx2 = h.new_request()
        t0 = time.perf_counter()
        results, _steps = h.lookup_until_resolved(key, ctx2, max_steps=int(timeout_s * 100))
        from vllm.v1.kv_offload.base import LookupResult

        if results[0] is not LookupResult.HIT:
            rep.error = f"block stored but the lookup answered {results[0].name}"
            return rep
        back = h.load(key, ctx2)
        rep.load_ms = (time.perf_counter() - t0) * 1e3
        h.finish_request(ctx2)
        if not np.array_equal(back[0], rows[0]):
            rep.error = "block read back differs from the block written"
            return rep
        rep.ok = True
        # Leave no test block behind.
        with contextlib.suppress(Exception):
            t.backend.delete(t.namespace.object_name(key[0]))
        return rep
    except Exception as exc:
        rep.error = f"{type(exc).__name__}: {exc}"
        return rep
    finally:
        h.shutdown()
