"""Client-side AES-GCM encryption of payloads: tenants sharing a store stay apart."""

from __future__ import annotations

import base64
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("cryptography")

from kvstore_tiers.admin.harness import build_harness, make_keys
from kvstore_tiers.codecs import CodecId
from kvstore_tiers.crypto import PayloadCipher
from kvstore_tiers.errors import ConfigError, ObjectCorrupt
from kvstore_tiers.frame import FrameCodec

from ..faults.common import HIT, MISS, Driver, rows_for

KEY_A = os.urandom(32)
KEY_B = os.urandom(32)
NS = b"n" * 16


@pytest.mark.parametrize("codec", [CodecId.NONE, CodecId.ZSTD, CodecId.KVSPLIT])
def test_frame_roundtrip_and_wrong_key_is_corrupt(codec: CodecId) -> None:
    raw = memoryview(np.arange(8192, dtype=np.uint16).tobytes())
    key = make_keys(1)[0]
    enc = FrameCodec(NS, codec, 8, PayloadCipher(KEY_A))
    header, payload = enc.encode(key, raw)
    frame = bytes(header) + bytes(payload)
    assert bytes(raw[:64]) not in frame  # no clear text
    out = bytearray(len(raw))
    enc.decode_into(key, frame, memoryview(out))
    assert out == raw
    for reader in (FrameCodec(NS, codec, 8, PayloadCipher(KEY_B)),  # wrong key
                   FrameCodec(NS, codec, 8)):  # no key
        with pytest.raises(ObjectCorrupt):
            reader.decode_into(key, frame, memoryview(bytearray(len(raw))))
    # Bound to the block key (AAD): the same frame under another key fails.
    other = make_keys(2)[1]
    forged = bytearray(frame)
    forged[64 : 64 + len(key)] = other
    with pytest.raises(ObjectCorrupt):
        enc.decode_into(other, bytes(forged), memoryview(bytearray(len(raw))))
    # An encrypted tier refuses clear-text frames (planted by someone with write access).
    h2, p2 = FrameCodec(NS, codec, 8).encode(key, raw)
    with pytest.raises(ObjectCorrupt):
        enc.decode_into(key, bytes(h2) + bytes(p2), memoryview(bytearray(len(raw))))


def test_key_sources_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstore_tiers.crypto import load_key

    monkeypatch.setenv("KVT_KEY", KEY_A.hex())
    assert load_key("KVT_KEY", None) == KEY_A
    f = tmp_path / "key"
    f.write_text(base64.b64encode(KEY_B).decode() + "\n")
    assert load_key(None, str(f)) == KEY_B
    f.write_bytes(KEY_A)
    assert load_key(None, str(f)) == KEY_A
    monkeypatch.setenv("KVT_BAD", "not-a-key-s3cr3t")
    with pytest.raises(ConfigError) as e:
        load_key("KVT_BAD", None)
    assert "s3cr3t" not in str(e.value)
    with pytest.raises(ConfigError):
        load_key("KVT_UNSET_VARIABLE", None)
    with pytest.raises(ConfigError):
        load_key("KVT_KEY", str(f))


@pytest.mark.parametrize("value", [KEY_B.hex(), base64.b64encode(KEY_B).decode()])
def test_a_key_written_where_its_file_belongs_is_not_echoed(value: str) -> None:
    from kvstore_tiers.crypto import load_key

    with pytest.raises(ConfigError) as e:
        load_key(None, value)
    assert value not in str(e.value) and "encryption_key_file" in str(e.value)


def test_a_missing_key_file_is_named(tmp_path: Path) -> None:
    from kvstore_tiers.crypto import load_key

    missing = tmp_path / "no-such.key"
    with pytest.raises(ConfigError, match=r"no-such\.key"):
        load_key(None, str(missing))


def _tiers(kind: str, where: Any, env: str) -> list[dict[str, Any]]:
    if kind == "fs":
        return [{"type": "fs", "root_dir": str(where), "encryption_key_env": env}]
    return [{"type": "redis", "url": where.url, "encryption_key_env": env,
             "compression": "zstd"}]


@pytest.mark.parametrize("kind", ["fs", "redis"])
def test_tenants_sharing_a_store(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 redis_server_factory: Any) -> None:
    where = tmp_path / "kv" if kind == "fs" else redis_server_factory()
    monkeypatch.setenv("TENANT_A_KEY", KEY_A.hex())
    monkeypatch.setenv("TENANT_B_KEY", KEY_B.hex())
    a = Driver(f"{kind}+aes", _tiers(kind, where, "TENANT_A_KEY"))
    b = Driver(f"{kind}+aes", _tiers(kind, where, "TENANT_B_KEY"))
    try:
        assert a.tier.encrypted and a.tier.namespace.name != b.tier.namespace.name
        keys = make_keys(6, seed=51)
        rows = rows_for(keys, a.row_bytes)
        a.store(keys, rows)
        a.forget_primary()
        assert a.fetch(keys) == [HIT] * 6  # byte-exact round trip through the cipher
        b.expected.update(a.expected)
        assert b.fetch(keys) == [MISS] * 6  # tenant B sees nothing of A
        # Even A's ciphertext copied under B's names is a miss, never garbage.
        for k in keys[:3]:
            frame = bytes(a.tier.backend.get(a.tier.namespace.object_name(k)))
            b.tier.backend.put(b.tier.namespace.object_name(k), [frame])
        b.score.fault("foreign_ciphertext", 3)
        assert b.fetch(keys[:3]) == [MISS] * 3
        assert b.tier.counters.corrupt_objects == 3
        a.forget_primary()
        assert a.fetch(keys) == [HIT] * 6  # A's own objects untouched
        assert a.score.wrong_bytes == 0
    finally:
        leaked = b.close() + a.close()  # the last close also counts leftover threads
    assert leaked == 0  # no pinned primary slots, jobs or tier threads left


def test_unencrypted_reader_cannot_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("KVT_KEY", KEY_A.hex())
    h = build_harness([{"type": "fs", "root_dir": str(tmp_path), "encryption_key_env": "KVT_KEY"}],
                      num_chunks=8, chunk_bytes=8192)
    try:
        keys = make_keys(2, seed=52)
        ctx = h.store(keys, rows_for(keys, 8192))
        h.settle()
        h.finish_request(ctx)
        blobs = [p.read_bytes() for p in tmp_path.rglob("*.kvf")]
        assert len(blobs) == 2 and all(b[7] == 1 for b in blobs)  # flags: encrypted
        caplog.set_level(logging.DEBUG)
        assert KEY_A.hex() not in caplog.text and repr(h.tiers[0]).find(KEY_A.hex()) < 0
    finally:
        h.shutdown()
