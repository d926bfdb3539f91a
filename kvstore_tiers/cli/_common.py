"""Options and helpers shared by the commands.

A store is named either by ``--config`` (the same JSON a user gives vLLM: a
tier dict, a list, a kv_connector_extra_config or a whole kv-transfer-config,
inline or as a file) or by one shortcut (``--fs DIR``, ``--redis URL``,
``--s3 BUCKET`` with ``--endpoint-url``, ``--prefix``, ``--region``,
``--profile``, ``--addressing-style``).

A missing optional dependency is reported in one line naming the pip extra
that brings it (:func:`require_extra`, :func:`missing_extra_message`), and a
store that cannot be reached in one line naming the store
(:func:`store_errors`), never with a traceback.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click

from kvstore_tiers.errors import BackendError, ConfigError

F = TypeVar("F", bound=Callable[..., Any])

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20,
               "mb": 10**6, "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30,
               "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}
_AGE_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """``"10G"`` -> bytes. Binary for K/M/G/T and KiB.., decimal for KB/MB/GB/TB."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise click.BadParameter(f"{text!r} is not a size (e.g. 500M, 20G, 1.5TiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_age(text: str) -> float:
    """``"7d"`` -> seconds (s, m/min, h, d, w; a bare number is seconds)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _AGE_UNITS:
        raise click.BadParameter(f"{text!r} is not a duration (e.g. 90s, 30m, 12h, 7d)")
    return float(m.group(1)) * _AGE_UNITS[m.group(2).lower()]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


#: Top-level module -> the pip extra of kvstore-tiers that installs it.
EXTRA_OF_MODULE = {
    "vllm": "vllm", "torch": "vllm", "transformers": "vllm",
    "boto3": "s3", "botocore": "s3", "aiobotocore": "s3",
    "redis": "redis", "cryptography": "encryption",
    "matplotlib": "demo", "gguf": "demo", "accelerate": "demo",
}


def missing_extra_message(module: str) -> str | None:
    """One line naming the extra that installs ``module`` (None: not an optional one)."""
    top = module.split(".", 1)[0]
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    return (f"this command needs the Python package {top!r}, which is not installed: "
            f"pip install 'kvstore-tiers[{extra}]'")


def require_extra(*modules: str) -> None:
    """Exit with :func:`missing_extra_message` unless every module can be imported.

    Looks the modules up without importing them, so a command can say what is
    missing before it starts work that would fail later (or in a child process).
    """
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # blocked, or a None entry in sys.modules
            found = False
        if not found:
            raise click.ClickException(missing_extra_message(module) or
                                       f"this command needs {module!r}, which is not installed")


#: Modules whose exceptions mean "the store cannot be used right now" (not a bug of ours).
_STORE_ERROR_MODULES = ("botocore", "aiobotocore", "boto3", "redis", "urllib3", "aiohttp")


def _secrets_of(tier: dict[str, Any]) -> list[str]:
    out = [str(v) for k, v in tier.items()
           if isinstance(v, str) and v and any(s in k for s in ("password", "secret", "token",
                                                                "access_key"))]
    url = tier.get("url")
    if isinstance(url, str):
        from urllib.parse import urlsplit

        with contextlib.suppress(ValueError):
            if urlsplit(url).password:
                out.append(str(urlsplit(url).password))
    return out


@contextlib.contextmanager
def store_errors(tier: dict[str, Any]) -> Iterator[None]:
    """Turn a store that fails mid-command into one line naming the store.

    Our backend errors, OS errors and the client libraries' errors (a dead
    endpoint, missing credentials) become a :class:`click.ClickException`
    (exit 1) naming the tier, with every secret of the tier dict removed.
    Anything else is a bug and keeps its traceback.
    """
    try:
        yield
    except (click.ClickException, ConfigError):
        raise
    except Exception as exc:
        module = type(exc).__module__.split(".", 1)[0]
        if not isinstance(exc, (BackendError, OSError, TimeoutError)) \
                and module not in _STORE_ERROR_MODULES:
            raise
        text = f"{tier_title(tier)}: {type(exc).__name__}: {exc}"
        for secret in _secrets_of(tier):
            text = text.replace(secret, "***")
        raise click.ClickException(text) from None


@contextlib.contextmanager
def progress_on_stderr(description: str) -> Iterator[Callable[..., None]]:
    """A transient progress line on stderr (stdout stays clean for --json).

    Yields ``update(completed, total=None, description=None)``: with no total
    it counts (a listing), with one it fills a bar (deletes). Only where stderr
    is a terminal: elsewhere (a pipe, a log file) there is nothing to redraw,
    and rich would leave an empty line behind.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not console.is_terminal:
        yield lambda completed, total=None, description=None: None
        return
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed} objects"), TimeElapsedColumn(),
                  console=console, transient=True) as prog:
        task = prog.add_task(description, total=None)

        def update(completed: int, total: int | None = None,
                   description: str | None = None) -> None:
            prog.update(task, completed=completed, total=total,
                        **({"description": description} if description else {}))

        yield update


def store_options(fn: F) -> F:
    """Add --config / --fs / --redis / --s3 (+ the s3 shortcut's options) to a command."""
    opts = [
        click.option("--config", "config_text", metavar="JSON|FILE",
                     help="secondary_tiers as given to vLLM: a tier dict, a list, or a "
                     "kv-transfer-config / kv_connector_extra_config containing it."),
        click.option("--fs", "fs_root", metavar="DIR", help="Shortcut: an fs tier at DIR."),
        click.option("--redis", "redis_url", metavar="URL",
                     help="Shortcut: a redis tier at URL (redis://host:port/db)."),
        click.option("--s3", "s3_bucket", metavar="BUCKET", help="Shortcut: an s3 tier bucket."),
        click.option("--endpoint-url", help="With --s3: S3-compatible endpoint (MinIO...)."),
        click.option("--prefix", default=None, help="With --s3: key prefix of the tier."),
        click.option("--region", default=None, help="With --s3: the bucket's region."),
        click.option("--profile", default=None,
                     help="With --s3: AWS shared-config profile for the credentials."),
        click.option("--addressing-style", type=click.Choice(["auto", "virtual", "path"]),
                     default=None, help="With --s3: bucket addressing (MinIO and most "
                     "on-premises servers want path)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def tiers_from_options(config_text: str | None = None, fs_root: str | None = None,
                       redis_url: str | None = None, s3_bucket: str | None = None,
                       endpoint_url: str | None = None, prefix: str | None = None,
                       region: str | None = None, profile: str | None = None,
                       addressing_style: str | None = None) -> list[dict[str, Any]]:
    """The tier dicts named by :func:`store_options` (exactly one way must be used)."""
    from kvstore_tiers.admin import parse_tiers

    given = [x for x in (config_text, fs_root, redis_url, s3_bucket) if x]
    if len(given) != 1:
        raise click.UsageError("name the store with exactly one of --config, --fs, --redis, --s3")
    s3_only = {"--endpoint-url": endpoint_url, "--prefix": prefix, "--region": region,
               "--profile": profile, "--addressing-style": addressing_style}
    stray = [name for name, value in s3_only.items() if value is not None]
    if stray and not s3_bucket:
        raise click.UsageError(f"{', '.join(stray)} only go with --s3")
    if config_text:
        try:
            return parse_tiers(config_text)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--config") from None
    if fs_root:
        return [{"type": "fs", "root_dir": fs_root}]
    if redis_url:
        return [{"type": "redis", "url": redis_url}]
    tier: dict[str, Any] = {"type": "s3", "bucket": s3_bucket}
    if endpoint_url:
        tier["endpoint_url"] = endpoint_url
    for key, value in (("prefix", prefix), ("region", region), ("profile", profile),
                       ("addressing_style", addressing_style)):
        if value:
            tier[key] = value
    return [tier]


def tier_title(tier: dict[str, Any]) -> str:
    """Short, secret-free name of a tier dict for headings."""
    where = tier.get("root_dir") or tier.get("bucket") or tier.get("url") or tier.get("nodes")
    if tier.get("type") == "redis" and isinstance(where, str):
        from kvstore_tiers.redact import redact_url

        where = redact_url(where)
    return f"{tier.get('type')} {where}" if where else str(tier.get("type"))
