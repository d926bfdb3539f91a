"""The objects a tier stored, read and overwritten where they live (fs, redis, s3).

An end-to-end test that runs one body on every backend names a store
location (``where``: a directory under the fs base, a Redis key prefix, an
S3 key prefix), gets the tier config that writes there, and then lists,
copies and damages the real stored objects, never the tier's view of them.
"""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from kvstore_tiers.naming import key_from_object_name
from tests.servers import FAKE_KEY_ID, FAKE_SECRET, RedisServer

SUFFIX = ".kvf"


class StoredObjects(ABC):
    """One backend's stored objects, addressed by location and object name
    (``<namespace>/<shard>/<hash>_g<group>.kvf`` and the namespace's other
    files, relative to the location)."""

    backend: str

    @abstractmethod
    def tier(self, where: str) -> dict[str, Any]:
        """The secondary-tier config of this backend that stores at ``where``."""

    @abstractmethod
    def names(self, where: str, suffix: str = SUFFIX) -> list[str]:
        """Sorted names of the objects at ``where`` that end with ``suffix``."""

    @abstractmethod
    def read(self, where: str, name: str) -> bytes: ...

    @abstractmethod
    def write(self, where: str, name: str, data: bytes) -> None:
        """Replace (or create) the object, as another writer would."""

    @abstractmethod
    def clear(self) -> None:
        """Delete every object of the store, at every location."""

    def copy(self, src: str, dst: str) -> str:
        """Every object at ``src`` (frames and the namespace's files) to ``dst``."""
        for name in self.names(src, suffix=""):
            self.write(dst, name, self.read(src, name))
        return dst

    def groups(self, where: str) -> dict[int, int]:
        """Stored KV objects per KV cache group."""
        out: dict[int, int] = {}
        for name in self.names(where):
            key = key_from_object_name(name)
            assert key is not None, name
            group = int.from_bytes(key[-4:], "big")
            out[group] = out.get(group, 0) + 1
        return out

    def flip(self, where: str, names: list[str]) -> None:
        """Flip a byte in the middle of each named object: a payload whose
        checksum no longer matches (the frame's header stays valid)."""
        for name in names:
            data = bytearray(self.read(where, name))
            data[len(data) // 2] ^= 0xFF
            self.write(where, name, bytes(data))

    def corrupt_all(self, where: str) -> int:
        """Damage every stored KV object: a flipped byte mid-object or a
        truncation to a third, alternately. Returns how many."""
        names = self.names(where)
        self.flip(where, names[1::2])
        for name in names[0::2]:
            data = self.read(where, name)
            self.write(where, name, data[: len(data) // 3])
        return len(names)


class FsObjects(StoredObjects):
    backend = "fs"

    def __init__(self, base: Path) -> None:
        self.base = base

    def tier(self, where: str) -> dict[str, Any]:
        return {"type": "fs", "root_dir": str(self.base / where)}

    def names(self, where: str, suffix: str = SUFFIX) -> list[str]:
        root = self.base / where
        return sorted(str(p.relative_to(root)) for p in root.rglob(f"*{suffix}") if p.is_file())

    def read(self, where: str, name: str) -> bytes:
        return (self.base / where / name).read_bytes()

    def write(self, where: str, name: str, data: bytes) -> None:
        path = self.base / where / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def copy(self, src: str, dst: str) -> str:
        shutil.copytree(self.base / src, self.base / dst)  # the shard directories too
        return dst

    def clear(self) -> None:
        shutil.rmtree(self.base)
        self.base.mkdir()


class RedisObjects(StoredObjects):
    """Values of a real redis-server; ``where`` is the tier's ``key_prefix``."""

    backend = "redis"

    def __init__(self, server: RedisServer) -> None:
        self.server = server

    def tier(self, where: str) -> dict[str, Any]:
        return {"type": "redis", "url": self.server.url, "key_prefix": f"{where}:"}

    def names(self, where: str, suffix: str = SUFFIX) -> list[str]:
        prefix = f"{where}:".encode()
        with self.server.client() as c:
            keys = c.scan_iter(match=prefix + b"*", count=1000)
            return sorted(k[len(prefix):].decode() for k in keys if k.endswith(suffix.encode()))

    def read(self, where: str, name: str) -> bytes:
        with self.server.client() as c:
            value = c.get(f"{where}:{name}")
        assert value is not None, name
        return bytes(value)

    def write(self, where: str, name: str, data: bytes) -> None:
        with self.server.client() as c:
            c.set(f"{where}:{name}", data)

    def clear(self) -> None:
        """FLUSHALL."""
        with self.server.client() as c:
            c.flushall()


class S3Objects(StoredObjects):
    """Objects of a real (moto) S3 bucket; ``where`` is the tier's ``prefix``."""

    backend = "s3"

    def __init__(self, endpoint: str, bucket: str, client: Any) -> None:
        self.endpoint, self.bucket, self.client = endpoint, bucket, client

    def tier(self, where: str) -> dict[str, Any]:
        return {"type": "s3", "bucket": self.bucket, "prefix": f"{where}/",
                "endpoint_url": self.endpoint,
                "aws_access_key_id": FAKE_KEY_ID, "aws_secret_access_key": FAKE_SECRET}

    def names(self, where: str, suffix: str = SUFFIX) -> list[str]:
        prefix = f"{where}/"
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"][len(prefix):] for page in pages
                      for o in page.get("Contents", []) if o["Key"].endswith(suffix))

    def read(self, where: str, name: str) -> bytes:
        obj = self.client.get_object(Bucket=self.bucket, Key=f"{where}/{name}")
        return bytes(obj["Body"].read())

    def write(self, where: str, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"{where}/{name}", Body=data)

    def clear(self) -> None:
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys})
