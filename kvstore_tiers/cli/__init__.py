"""The ``kvstore-tiers`` command line (click).

Each sub-command lives in its own module of this package and is added to the
group here, so a command's imports (vLLM, torch, boto3, ...) load only when
that command runs.
"""

from __future__ import annotations

import importlib

import click

# name -> "module:attribute" of a click command; imported lazily.
_COMMANDS: dict[str, str] = {
    "bench": "kvstore_tiers.cli.bench:bench",
    "check": "kvstore_tiers.cli.check:check",
    "config": "kvstore_tiers.cli.config:config_cmd",
    "demo": "kvstore_tiers.cli.demo:demo",
    "gc": "kvstore_tiers.cli.gc:gc",
    "lifecycle": "kvstore_tiers.cli.lifecycle:lifecycle",
    "stats": "kvstore_tiers.cli.stats:stats",
    "verify": "kvstore_tiers.cli.verify:verify",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = _COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        return getattr(importlib.import_module(module_name), attr)

    def invoke(self, ctx: click.Context) -> object:
        # A bad tier config, an unreachable store or a missing optional
        # package is the user's to fix: show the message (which names the
        # key, the endpoint or the pip extra), not a traceback.
        from kvstore_tiers.cli._common import missing_extra_message
        from kvstore_tiers.errors import ConfigError

        try:
            return super().invoke(ctx)
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from None
        except ModuleNotFoundError as exc:
            message = missing_extra_message(exc.name or "")
            if message is None:
                raise
            raise click.ClickException(message) from None


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvstore-tiers")
def main() -> None:
    """FileSystem, S3 and Redis secondary tiers for vLLM's KV offloading."""
