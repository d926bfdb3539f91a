"""Every JSON example in README.md and docs/*.md goes through ``kvstore-tiers check``.

An example is a ```json block (a fragment such as ``"secondary_tiers": [...]``
is read inside braces) or the quoted JSON after ``--kv-transfer-config``,
``--config`` or ``--tiers-json`` in a shell block. Each tier of it is checked
as a user would, against a real store: fs examples under a temporary root,
redis examples against a redis-server and s3 examples against a moto server
started here, with only the endpoint (and the fs root, and an fs free-space floor larger
than this disk can hold) substituted. Every
other key, ``backpressure`` included, reaches vLLM's real factory, so an
example that the installed vLLM refuses fails here (the suite runs on both
vLLM versions). An example followed in its block by ``FAIL`` is a documented
failure: it must fail, naming the key its output names.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvstore_tiers.admin import parse_tiers
from kvstore_tiers.registry import backend_names

from .conftest import invoke

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)
_QUOTED = re.compile(r"(?:--kv-transfer-config|--config|--tiers-json)\s+'([\[{].*?)'", re.S)


def _examples() -> list[Any]:
    """pytest params: (doc:line, JSON text, expected failure text or None)."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for block in _BLOCK.finditer(text):
            lang, body = block.group(1), block.group(2)
            line = text.count("\n", 0, block.start()) + 1
            found: list[tuple[str, str | None]] = []
            if lang == "json":
                found.append((body if body.lstrip()[:1] in "{[" else "{" + body + "}", None))
            else:
                for m in _QUOTED.finditer(body):
                    after = body[m.end():].split("\n$ ", 1)[0]
                    fail = re.search(r"^FAIL .*?: (.*)$", after, re.M)
                    found.append((m.group(1), fail.group(1) if fail else None))
            for example, fail in found:
                if "..." in example:
                    continue  # an abbreviation in prose, not a config
                label = f"{doc.relative_to(REPO)}:{line}"
                out.append(pytest.param(label, example, fail, id=label))
    return out


EXAMPLES = _examples()


def test_the_docs_have_examples_of_every_built_in_tier() -> None:
    kinds = {t["type"] for p in EXAMPLES for t in parse_tiers(p.values[1])}
    assert {"fs", "redis", "s3"} <= kinds
    assert len(EXAMPLES) >= 8


def _endpoint(tier: dict[str, Any], request: pytest.FixtureRequest,
              root: Path) -> dict[str, Any]:
    """The tier with its endpoint (or root) replaced by a real one started for the test."""
    tier = dict(tier)
    kind = tier["type"]
    if kind == "fs":
        tier["root_dir"] = str(root)
        if tier.get("min_free_bytes"):
            # The floor is a property of the user's disk, held before every write:
            # keep the key, at a size the test machine's disk can hold.
            root.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(root).free
            tier["min_free_bytes"] = min(tier["min_free_bytes"], free // 4)
    elif kind == "redis":
        server = request.getfixturevalue("redis_server")
        parts = urlsplit(tier.get("url", "redis://localhost:6379/0"))
        tier["url"] = parts._replace(netloc=f"127.0.0.1:{server.port}").geturl()
    elif kind == "s3":
        tier["endpoint_url"] = request.getfixturevalue("moto_endpoint")
        s3 = request.getfixturevalue("s3")
        with contextlib.suppress(Exception):  # made by an earlier example
            s3.create_bucket(Bucket=tier["bucket"])
    return tier


@pytest.mark.parametrize(("where", "example", "fail"), EXAMPLES)
def test_example_passes_check(where: str, example: str, fail: str | None, tmp_path: Path,
                              request: pytest.FixtureRequest,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSTORE_REDIS_PASSWORD", raising=False)
    tiers = parse_tiers(example)
    missing = {t["type"] for t in tiers} - set(backend_names())
    if missing:
        pytest.skip(f"{where}: backend {sorted(missing)} is a plugin not installed here")
    for i, tier in enumerate(tiers):
        real = _endpoint(tier, request, tmp_path / f"tier{i}")
        out = invoke("check", "--config", json.dumps(real), "--json")
        (rep,) = json.loads(out.stdout)
        if fail is None:
            assert out.exit_code == 0 and rep["ok"], f"{where}: {rep['error']}"
        else:
            key = re.search(r"key '(\w+)'", fail)
            assert out.exit_code == 1 and key and key.group(1) in rep["error"], where
