"""Keys of the redis tier, and URLs shown without their password."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import (
    Field,
    SecretStr,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from kvstore_tiers.config import TierConfig, file_path, url_port
from kvstore_tiers.redact import redact_nodes, redact_url

DEFAULT_PASSWORD_ENV = "KVSTORE_REDIS_PASSWORD"
DEFAULT_USERNAME_ENV = "KVSTORE_REDIS_USERNAME"
DEFAULT_URL = "redis://127.0.0.1:6379/0"


class RedisConfig(TierConfig):
    """Keys of the redis tier (``{"type": "redis", ...}`` in ``secondary_tiers``)."""

    # repr=False: a URL may embed a password (redis://:pw@host, ?password=);
    # describe() and model_dump() show it redacted, the backend connects with the real one.
    url: str | None = Field(
        None, repr=False, description="Server URL: redis://host:port/db, rediss:// (TLS) or "
        "unix:///path/redis.sock. Default redis://127.0.0.1:6379/0 unless 'nodes' is set.",
    )
    cluster: bool = Field(False, description="Talk to a Redis Cluster (redis-py RedisCluster).")
    nodes: list[str] | None = Field(
        None, min_length=1, max_length=1000,
        description="Cluster startup nodes as 'host:port' (implies cluster: true).",
    )
    tls: bool = Field(False, description="Use TLS with 'nodes' (with 'url', use rediss://).")
    username: str | None = Field(None, description="ACL user name.")
    password: SecretStr | None = Field(
        None, description="ACL/requirepass password. Prefer password_env: vLLM's server logs the "
        "config (the tier warns at start-up).",
    )
    username_env: str = Field(
        DEFAULT_USERNAME_ENV, description="Environment variable read when 'username' is unset.",
    )
    password_env: str = Field(
        DEFAULT_PASSWORD_ENV, description="Environment variable read when 'password' is unset.",
    )
    tls_ca_file: str | None = Field(None, description="CA bundle that signed the server cert.")
    tls_cert_file: str | None = Field(None, description="Client certificate (mutual TLS).")
    tls_key_file: str | None = Field(None, description="Path of the client private key (mutual "
                                              "TLS); never the key itself.")
    tls_check_hostname: bool = Field(True, description="Verify the server name in its cert.")
    key_prefix: str = Field("kvstore:", description="Prefix of every key this tier writes.")
    ttl_s: int | None = Field(
        None, ge=1, le=10 * 365 * 86400,
        description="Expire blocks this many seconds after their last hit "
        "(SET EX; a load refreshes it). None: keep until evicted by maxmemory.",
    )
    max_connections: int | None = Field(
        None, ge=1, le=10_000, description="Connection pool size (per node in cluster mode). "
        "Default: n_read_threads + n_write_threads + 4. The eviction listener "
        "(eviction_events) holds one of them.",
    )
    socket_timeout_s: float = Field(
        5.0, gt=0, le=600, description="Timeout of one socket read/write.")
    connect_timeout_s: float = Field(
        2.0, gt=0, le=600, description="Timeout of one TCP/TLS connect.")
    retries: int = Field(
        2, ge=0, le=10, description="Retries (exponential backoff, 50 ms doubling, capped "
        "at 1 s) of a command after a connection error or timeout.",
    )
    pipeline_batch: int = Field(
        8, ge=1, le=256, description="Blocks per pipeline (per I/O task).",
    )
    get_depth: int | None = Field(
        None, ge=1, le=256, description="GETs of a load's pipeline one connection keeps "
        "unanswered (fast_io). None: by distance, measured per pipeline: while the "
        "server's first reply byte comes within 4 ms, 4 MiB of values (2 GETs at least: "
        "a near server then builds fewer replies in fresh memory); when it comes later, "
        "the connection's share of 1.5x the bandwidth-delay product (the least first-byte "
        "time x the most bytes/s a recent load moved over all connections, 10 Gbit/s "
        "until one has), never less than the near window nor more than the pipeline "
        "(each GET held back short of it costs a round trip).",
    )
    eviction_events: Literal["auto", "on", "off"] = Field(
        "auto", description="Follow the server's evicted/expired keyevents, so this "
        "process's index stops answering HIT for blocks Redis removed: auto (when the "
        "server publishes them), on (enable them with CONFIG SET; fail if refused), off. "
        "The del keyevent (other processes' deletions) is followed too where the server "
        "has the g flag.",
    )
    fast_io: bool = Field(
        True, description="Zero-copy SET/GET on a single server (see docs/redis.md); "
        "false: plain redis-py pipelines.",
    )

    @field_validator("nodes")
    @classmethod
    def _host_ports(cls, nodes: list[str] | None) -> list[str] | None:
        for node in nodes or ():
            host, sep, port = node.rpartition(":")
            if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"each node is 'host:port' with a port of 1-65535, not {node!r}")
        return nodes

    _tls_paths = field_validator("tls_ca_file", "tls_cert_file", "tls_key_file")(file_path)

    @field_validator("url")
    @classmethod
    def _url_named(cls, url: str | None) -> str | None:
        if url is None:
            return url
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError("scheme must be redis://, rediss:// or unix://, "
                             f"not {parts.scheme or '(none)'}")
        if parts.scheme == "unix" and not parts.path:
            raise ValueError("unix:// needs a socket path")
        if parts.scheme != "unix":
            if not parts.hostname:
                raise ValueError("needs a host")
            url_port(parts)
        return url

    @field_validator("tls_ca_file", "tls_cert_file", "tls_key_file")
    @classmethod
    def _tls_file(cls, path: str | None, info: ValidationInfo) -> str | None:
        if path is None:
            return path
        if not path.strip():
            # "" would silently mean "no file": no CA check, no client certificate.
            raise ValueError("must name a file (leave the key out for none)")
        url = info.data.get("url")  # validated before the TLS files
        if url is not None and urlsplit(url).scheme != "rediss":
            raise ValueError("a TLS file needs a rediss:// url (TLS); the url is "
                             f"{urlsplit(url).scheme}://")
        return path

    @model_validator(mode="after")
    def _check(self) -> RedisConfig:
        if self.url is not None and self.nodes:
            raise ValueError("set either 'url' or 'nodes', not both")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if (self.cluster or self.nodes) and ("{" in self.key_prefix or "}" in self.key_prefix):
            # A hash tag would pin every key to one slot (one node).
            raise ValueError("key_prefix must not contain '{' or '}' in cluster mode")
        return self

    @field_serializer("url")
    def _dump_url(self, url: str | None) -> str | None:
        return None if url is None else redact_url(url)

    @field_serializer("nodes")
    def _dump_nodes(self, nodes: list[str] | None) -> list[str] | None:
        return None if nodes is None else redact_nodes(nodes)

    def secret_remedy(self, key: str) -> str:
        if key in ("url", "nodes", "password"):
            return (f"the environment variable {self.password_env} (password_env) for the "
                    "password, a URL without it; `kvstore-tiers config` writes that form")
        return super().secret_remedy(key)

    @property
    def is_cluster(self) -> bool:
        return self.cluster or bool(self.nodes)

    @property
    def effective_url(self) -> str:
        """``url``, or the default local server."""
        return self.url or DEFAULT_URL

