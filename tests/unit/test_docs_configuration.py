"""docs/configuration.md cannot drift from the config models.

Two independent checks:

* the committed file is exactly what ``scripts/gen_config_docs.py`` renders
  (so editing a model without regenerating fails here, with the command to run);
* the doc, parsed as markdown tables, agrees with the models key by key:
  every field of every built-in backend's ``config_model`` appears in that
  tier's table (or, unchanged, in the common table) with the right default,
  and every key the doc lists exists in the model. This part does not trust
  the generator.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvstore_tiers.config import TierConfig
from kvstore_tiers.registry import load_backend

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "configuration.md"
SCRIPT = REPO / "scripts" / "gen_config_docs.py"
BACKENDS = ("fs", "s3", "redis")
ROW = re.compile(r"^\| `(?P<key>[a-z0-9_]+)` \| (?P<type>.*?) \| (?P<default>.*?) \| .*\|$")


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_gen_config_docs", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _sections(text: str) -> dict[str, dict[str, str]]:
    """``{section heading: {key: default cell}}`` for every key table of the doc."""
    out: dict[str, dict[str, str]] = {}
    current = ""
    for line in text.splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
            out[current] = {}
            continue
        m = ROW.match(line)
        if m and current:
            assert m["key"] not in out[current], f"{m['key']} listed twice in {current!r}"
            out[current][m["key"]] = m["default"].strip()
    return out


def _expected_default(field) -> str:
    if field.is_required():
        return "*required*"
    return f"`{json.dumps(field.get_default(call_default_factory=True))}`"


@pytest.fixture(scope="module")
def sections() -> dict[str, dict[str, str]]:
    return _sections(DOC.read_text())


def test_committed_doc_matches_the_generator() -> None:
    assert DOC.read_text() == _generator().render(), (
        "docs/configuration.md is out of date: run `python scripts/gen_config_docs.py`"
    )


def test_common_table_matches_tierconfig(sections: dict[str, dict[str, str]]) -> None:
    common = sections["Common keys (every tier)"]
    assert set(common) == set(TierConfig.model_fields)
    for key, field in TierConfig.model_fields.items():
        assert common[key] == _expected_default(field), key


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_model_key_is_documented_with_its_default(
    backend: str, sections: dict[str, dict[str, str]]
) -> None:
    model = load_backend(backend).config_model
    table = sections[f"`{backend}` tier"]
    common = sections["Common keys (every tier)"]
    for key, field in model.model_fields.items():
        expected = _expected_default(field)
        if key in table:
            assert table[key] == expected, f"{backend}.{key}: doc {table[key]} != {expected}"
        else:
            # Not in the tier's own table: must be a common key it did not redefine.
            assert key in common, f"{backend}.{key} is not documented"
            assert common[key] == expected, (
                f"{backend}.{key} has default {expected}, but only the common table "
                f"documents it (with {common[key]})"
            )


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_documented_key_exists(backend: str, sections: dict[str, dict[str, str]]) -> None:
    model = load_backend(backend).config_model
    unknown = set(sections[f"`{backend}` tier"]) - set(model.model_fields)
    assert not unknown, f"docs list {sorted(unknown)} for {backend}, the model has no such key"


def test_examples_are_valid_configs() -> None:
    """Every JSON example in the doc validates against its tier's model."""
    from kvstore_tiers.config import validate_config

    blocks = re.findall(r"```json\n(.*?)\n```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 1 + len(BACKENDS)
    for block in blocks:
        cfg = json.loads(block)
        tier_type = cfg.pop("type")
        for vllm_key in ("module_path", "backpressure"):
            cfg.pop(vllm_key, None)
        validate_config(load_backend(tier_type).config_model, tier_type, cfg)
