"""The tier dicts in a user's config text, and their validation.

A user names a store with the same JSON they give vLLM. That text holds
secrets (passwords, keys), so no message here ever repeats it: errors say
what is wrong and where (a JSON position, a tier index, a key name).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore_tiers.backends.base import Backend
from kvstore_tiers.config import validate_config
from kvstore_tiers.errors import ConfigError

#: Keys of a tier dict that vLLM consumes and a backend config does not accept.
VLLM_TIER_KEYS = ("type", "module_path", "backpressure")
#: Characters that never appear in a path a user names by hand; text holding
#: one is not repeated in a message (it may be configuration, secrets included).
_NOT_A_PATH = set("{}[]\"'=\n\r\t ")


def _read_config_file(text: str) -> str:
    path = Path(text).expanduser()
    try:
        return path.read_text()
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        shown = f" {text!r}" if len(text) < 256 and not _NOT_A_PATH & set(text) else ""
        raise ConfigError(f"not JSON (it starts with neither '{{' nor '[') and not a "
                          f"readable file{shown}: {reason}") from None


def parse_tiers(text_or_path: str) -> list[dict[str, Any]]:
    """The tier dicts in a user's config, as JSON text or the path of a JSON file.

    Text that starts with ``{`` or ``[`` is JSON (any length); anything else
    is a file name. Accepts what a user gives vLLM: a list of tier dicts, one
    tier dict, a ``kv_connector_extra_config`` with ``secondary_tiers``
    inside, or a whole ``--kv-transfer-config``. Raises ConfigError saying
    what is wrong, never quoting the configuration.
    """
    stripped = text_or_path.lstrip()
    text = text_or_path if stripped[:1] in ("{", "[") else _read_config_file(text_or_path)
    try:
        data = json.loads(text)
    except ValueError as exc:
        where = f"line {exc.lineno} column {exc.colno}" if isinstance(
            exc, json.JSONDecodeError) else "somewhere"
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "invalid"
        raise ConfigError(f"not valid JSON: {msg} at {where}") from None
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


@dataclass(frozen=True)
class MovedPassword:
    """A redis password taken out of a tier dict: the tier now reads it from ``env``."""

    tier_index: int
    env: str
    #: The key it was in (``url`` or ``password``).
    key: str


def move_passwords_to_env(tiers: list[dict[str, Any]]
                          ) -> tuple[list[dict[str, Any]], list[MovedPassword]]:
    """``tiers`` with every redis password moved into the environment form.

    A password in a tier's URL (userinfo or ``?password=``) or its ``password``
    key is removed, and the tier gets ``password_env`` naming the variable it
    reads instead: its own ``password_env``, else ``KVSTORE_REDIS_PASSWORD``;
    a second tier with another password under a taken name gets the name
    with ``_<tier index>`` appended. Returns the new tier dicts (the input is
    not changed) and what moved, never a password. Tiers must be valid.
    """
    from kvstore_tiers.backends.redis.config import DEFAULT_PASSWORD_ENV, RedisConfig
    from kvstore_tiers.redact import split_password

    out: list[dict[str, Any]] = []
    moved: list[MovedPassword] = []
    values: dict[str, str] = {}  # variable -> the password it must hold
    for i, tier in enumerate(tiers):
        tier = dict(tier)
        out.append(tier)
        if not issubclass(validate_tier(tier)[0].config_model, RedisConfig):
            continue
        url, in_url = split_password(tier["url"]) if tier.get("url") else (None, None)
        password = tier.pop("password", None) or in_url
        if password is None:
            continue
        if url is not None:
            tier["url"] = url
        env = tier.get("password_env") or DEFAULT_PASSWORD_ENV
        if values.get(env, password) != password:
            env = f"{env}_{i}"
        tier["password_env"] = env
        values[env] = password
        moved.append(MovedPassword(i, env, "password" if "password" in tiers[i] else "url"))
    return out, moved
