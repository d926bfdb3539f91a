"""Optional client-side authenticated encryption of stored payloads (AES-256-GCM).

Enabled per tier with ``encryption_key_env`` (name of an environment
variable) or ``encryption_key_file`` (path of a file); the key itself never
appears in the configuration. The key is 16, 24 or 32 bytes given as hex or
base64 text (or, in a file, as raw bytes).

What is encrypted: the payload after compression. The frame header stays in
clear (magic, lengths, key, namespace) and carries flag ``FLAG_ENCRYPTED``;
the payload becomes ``nonce (12) || ciphertext || tag (16)``. The AAD binds
the ciphertext to the namespace digest, the block key, the codec and the raw
length, so a frame copied under another key, namespace or tier does not
authenticate. A wrong key, a tampered byte or a moved frame all raise
:class:`~kvstore_tiers.errors.ObjectCorrupt` -- a miss, never garbage.

Nonces are random (96 bits): stay well below 2**32 frames per key (NIST
SP 800-38D); rotate keys before that. A key id (HMAC of a constant under the
key) is mixed into the namespace by the tier, so tenants with different keys
never even address the same objects, and a key rotation starts a new, empty
namespace (old objects age out via TTL / lifecycle / gc).

Needs the ``cryptography`` package (imported lazily, only when a key is set).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import struct

from kvstore_tiers.errors import ConfigError, ObjectCorrupt

NONCE_BYTES = 12
TAG_BYTES = 16
OVERHEAD = NONCE_BYTES + TAG_BYTES
_AAD_TAIL = struct.Struct("<BQ")


def _decode_key(data: bytes, source: str, allow_raw: bool = False) -> bytes:
    """Hex, then base64 text; else raw bytes (files only). Must give 16/24/32 bytes."""
    text = data.strip()
    for decode in (binascii.unhexlify, base64.b64decode, base64.urlsafe_b64decode):
        try:
            key = decode(text)
        except (binascii.Error, ValueError):
            continue
        if len(key) in (16, 24, 32):
            return key
    if allow_raw and len(data) in (16, 24, 32):
        return data
    # Never echo the value: it is a secret.
    raise ConfigError(f"encryption key from {source} is not 16/24/32 bytes of hex or base64")


def _looks_like_key(value: str) -> bool:
    """True if ``value`` decodes as key material (hex or base64 of 16/24/32 bytes)."""
    try:
        _decode_key(value.encode(), "")
    except (ConfigError, UnicodeEncodeError):
        return False
    return True


def load_key(env_name: str | None, file_path: str | None) -> bytes | None:
    """The encryption key named by the config, or None if encryption is off."""
    if env_name and file_path:
        raise ConfigError("set only one of encryption_key_env and encryption_key_file")
    if env_name:
        value = os.environ.get(env_name)
        if not value:
            raise ConfigError(f"encryption_key_env: environment variable {env_name} is not set")
        return _decode_key(value.encode(), f"environment variable {env_name}")
    if file_path:
        try:
            with open(file_path, "rb") as f:
                data = f.read()
        except OSError as exc:
            # A key written where its file's path belongs must not reach the log.
            shown = "the file it names" if _looks_like_key(file_path) else file_path
            raise ConfigError(f"encryption_key_file: cannot read {shown}: {exc.strerror} "
                              "(it takes the path of a file holding the key)") from None
        return _decode_key(data, f"file {file_path}", allow_raw=True)
    return None


class PayloadCipher:
    """AES-GCM sealing of frame payloads. Thread-safe (AESGCM objects are stateless)."""

    def __init__(self, key: bytes) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ConfigError("payload encryption needs the 'cryptography' package") from exc
        self._aead = AESGCM(key)
        #: Public fingerprint of the key (not the key): goes into the namespace.
        self.key_id = hmac.new(key, b"kvstore-tiers key id v1", hashlib.sha256).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"PayloadCipher(key_id={self.key_id})"

    @staticmethod
    def aad(namespace: bytes, key: bytes, codec: int, raw_len: int) -> bytes:
        return namespace + key + _AAD_TAIL.pack(codec, raw_len)

    def seal(self, aad: bytes, plaintext: bytes | memoryview) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, bytes(plaintext), aad)

    def open(self, aad: bytes, payload: bytes | memoryview) -> bytes:
        from cryptography.exceptions import InvalidTag

        if len(payload) < OVERHEAD:
            raise ObjectCorrupt("encrypted payload too short")
        view = memoryview(payload)
        try:
            return self._aead.decrypt(bytes(view[:NONCE_BYTES]), bytes(view[NONCE_BYTES:]), aad)
        except InvalidTag:
            raise ObjectCorrupt("encrypted payload does not authenticate (wrong key, or the "
                                "object was tampered with or moved)") from None
