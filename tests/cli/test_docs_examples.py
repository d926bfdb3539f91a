"""Every example in README.md and docs/**/*.md is run as a user would run it, or marked.

1. Every JSON example goes through ``kvstore-tiers check``. An example is a
   ```json block (a fragment such as ``"secondary_tiers": [...]`` is read
   inside braces) or the quoted JSON after ``--kv-transfer-config``,
   ``--config`` or ``--tiers-json`` in a shell block. Each tier of it is
   checked as a user would, against a real store: fs examples under a
   temporary root, redis examples against a redis-server and s3 examples
   against a moto server started here, with only the endpoint (and the fs
   root, and an fs free-space floor larger than this disk can hold)
   substituted. Every other key, ``backpressure`` included, reaches vLLM's
   real factory, so an example that the installed vLLM refuses fails here (the
   suite runs on both vLLM versions). An example followed in its block by
   ``FAIL`` is a documented failure: it must fail, naming the key its output
   names.

2. Every shell command (tests/doc_commands.py says what one is: a line of a
   bash/sh/shell block, a ``$ `` line of a console block) is run here, block by
   block in a fresh directory, or is marked by a comment line of its own in its
   block, which applies to the commands after it up to the next mark::

     # needs: gpu       a CUDA machine (or a model of GBs)
     # needs: docker    Docker (compose)
     # needs: network   a download from outside the machine
     # long-running     minutes of engines or benchmarks; COVERED_BY below names
                        the test that runs it (one that no test covers fails)

   Run here: ``kvstore-tiers ...`` (in-process), ``python -c ...`` and
   ``python -m kvstore_tiers...`` (a child), ``export NAME=VALUE``, ``echo $?``.
   Each must exit 0, or with the status an ``echo $?`` after it shows, or 1
   where its shown output starts with "Error:" or "FAIL". One whose shown
   output is "Error: this command needs the Python package 'P' ...
   kvstore-tiers[E]" runs with extra E's packages hidden and must print
   exactly that line. Substituted: paths under /mnt/ go under the block's
   directory; redis URLs name a redis-server, and http://minio:9000 (or
   localhost:9000, or an ``--s3`` without ``--endpoint-url``) a moto server
   with the bucket kv-cache, both started here. The files a user has:
   /mnt/kv is an fs store of 8 blocks, one corrupt; tiers.json names it;
   s3.json names an s3 tier on kv-cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvstore_tiers.admin import parse_tiers
from kvstore_tiers.registry import backend_names
from tests.doc_commands import DOCS, REPO, Command, all_commands

from .conftest import flip_byte, invoke, kvf_files, populate, run_without

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


def _endpoint(tier: dict[str, Any], request: pytest.FixtureRequest, root: Path,
              monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The tier with its endpoint (or root) replaced by a real one started for the test.

    A redis example naming ``password_env`` gets a server with a password and that
    variable holding it, as the user it is written for has (the tier refuses to start
    when the variable it names is not set)."""
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
        if "password_env" in tier:
            password = "docs-example-password"
            server = request.getfixturevalue("redis_server_factory")(["--requirepass",
                                                                      password])
            monkeypatch.setenv(tier["password_env"], password)
        else:
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
        real = _endpoint(tier, request, tmp_path / f"tier{i}", monkeypatch)
        out = invoke("check", "--config", json.dumps(real), "--json")
        (rep,) = json.loads(out.stdout)
        if fail is None:
            assert out.exit_code == 0 and rep["ok"], f"{where}: {rep['error']}"
        else:
            key = re.search(r"key '(\w+)'", fail)
            assert out.exit_code == 1 and key and key.group(1) in rep["error"], where


# -- every shell command of the docs: run here, or marked (module docstring, 2.) ---------

#: Long-running commands and the test that runs them (first match of a pattern).
COVERED_BY: list[tuple[str, str]] = [
    (r"^bash scripts/test\.sh|^\S*pytest ", ".ci/run"),
    # installs plugins/kvstore-memory with pip, from its directory, into a directory
    (r"kvstore-memory", "tests/plugins/test_memory_plugin.py"),
    (r"^pip install", "tests/e2e/test_readme_cpu_install.py"),
    # README's CPU serve line, run by the same test after the install
    (r"^export VLLM_CPU_KVCACHE_SPACE=|vllm\.entrypoints\.openai\.api_server",
     "tests/e2e/test_readme_cpu_install.py"),
    (r"^bash scripts/demo\.sh|kvstore-tiers demo", "tests/e2e/test_two_process_tier.py"),
    (r"kvstore-tiers bench --trace .*--nodes", "tests/tools/test_fleet_bench.py"),
    (r"kvstore-tiers bench --trace|trace_design|mooncake-conversation\.jsonl|"
     r"^export KVSTORE_KV_SAMPLES=", "tests/tools/test_trace_bench.py"),
    (r"kvstore-tiers bench --distance", "tests/tools/test_distance_bench.py"),
    (r"kvstore-tiers bench --engine", "tests/e2e/test_engine_bench_e2e.py"),
    (r"kvstore-tiers bench --backpressure", "tests/tools/test_backpressure_bench.py"),
    (r"kvstore-tiers bench --scheduler-only|bench-ab\.sh .*--scheduler-only",
     "tests/tools/test_scheduler_only_bench.py"),
    (r"kvstore-tiers bench .*--redis-url", "tests/tools/test_redis_bench_external.py"),
    (r"kvstore-tiers bench .*--s3-bucket", "tests/tools/test_s3_bench_external.py"),
    (r"kvstore-tiers bench", "tests/tools/test_fs_bench_reload.py"),
    (r"tools\.bench\.admission_cost", "tests/tools/test_admission_cost.py"),
    (r"tools\.bench\.read_through_cost", "tests/tools/test_read_through_cost.py"),
    (r"^bash scripts/bench-ab\.sh", "tests/tools/test_bench_compare.py"),
]
_MISSING_EXTRA = re.compile(r"^Error: this command needs the Python package '\w+', which is "
                            r"not installed: pip install 'kvstore-tiers\[(\w+)\]'$")


def _blocks() -> list[Any]:
    """pytest params: the commands of each shell block, in order."""
    by_block: dict[tuple[str, int], list[Command]] = {}
    for cmd in all_commands():
        by_block.setdefault((cmd.doc, cmd.block), []).append(cmd)
    return [pytest.param(cmds, id=f"{doc}:{line}") for (doc, line), cmds in by_block.items()]


def covering_test(cmd: Command) -> str | None:
    return next((test for pattern, test in COVERED_BY if re.search(pattern, cmd.text)), None)


def _words(text: str) -> list[str]:
    """The command's words after its ``NAME=VALUE`` prefixes."""
    argv = shlex.split(text, comments=True)
    while argv and re.fullmatch(r"[A-Z_]+=.*", argv[0]):
        argv.pop(0)
    return argv


def runs_here(cmd: Command) -> bool:
    """Whether this test can run ``cmd`` (see the comment above)."""
    argv = _words(cmd.text)
    if cmd.text == "echo $?" or argv[:1] == ["export"]:
        return True
    if argv[0].rsplit("/", 1)[-1] == "kvstore-tiers":
        return True
    return argv[0] == "python" and (argv[1] == "-c" or (argv[1:2] == ["-m"]
                                    and argv[2].split(".")[0] == "kvstore_tiers"))


class _Shell:
    """A block's commands, run in ``work`` against real servers started on demand."""

    def __init__(self, work: Path, request: pytest.FixtureRequest,
                 monkeypatch: pytest.MonkeyPatch) -> None:
        self.work, self.request, self.monkeypatch = work, request, monkeypatch
        self.status: int | None = None  # of the last command run
        monkeypatch.chdir(work)
        store = work / "mnt" / "kv"
        populate(request.getfixturevalue("harness_factory"), {"type": "fs",
                                                              "root_dir": str(store)})
        flip_byte(kvf_files(store)[0])
        (work / "tiers.json").write_text(json.dumps({"type": "fs", "root_dir": str(store)}))
        (work / "s3.json").write_text(json.dumps({"type": "s3", "bucket": "kv-cache",
                                                  "endpoint_url": self._moto()}))

    def _moto(self) -> str:
        endpoint: str = self.request.getfixturevalue("moto_endpoint")
        with contextlib.suppress(Exception):  # made for an earlier block
            self.request.getfixturevalue("s3").create_bucket(Bucket="kv-cache")
        return endpoint

    def localize(self, text: str) -> list[str]:
        """The command's words, with the substitutions of the comment above."""
        text = re.sub(r"(?<![\w./-])/mnt/", f"{self.work}/mnt/", text)
        if "redis://" in text:
            port = self.request.getfixturevalue("redis_server").port
            text = re.sub(r"redis://[^/\s'\"]+", f"redis://127.0.0.1:{port}", text)
        text = re.sub(r"http://(minio|localhost):9000", self._moto(), text)
        argv = shlex.split(text, comments=True)
        if "--s3" in argv and "--endpoint-url" not in argv:
            argv += ["--endpoint-url", self._moto()]
        return argv

    def run(self, cmd: Command, status: int) -> None:
        """Run ``cmd``; it must end with exit status ``status``."""
        if cmd.text == "echo $?":
            assert self.status == int(cmd.output[0]), f"{cmd.where}: exit {self.status}"
            return
        argv = self.localize(cmd.text)
        while argv and re.fullmatch(r"[A-Z_]+=.*", argv[0]):
            self.monkeypatch.setenv(*argv.pop(0).split("=", 1))
        if argv[:1] == ["export"]:
            self.monkeypatch.setenv(*argv[1].split("=", 1))
            return
        if argv[0] == "python":
            proc = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True,
                                  timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
            self.status, output = proc.returncode, proc.stdout + proc.stderr
        else:
            self.status, output = self._kvstore_tiers(cmd, argv[1:])
        assert self.status == status, f"{cmd.where}: exit {self.status}:\n{output[-3000:]}"

    def _kvstore_tiers(self, cmd: Command, args: list[str]) -> tuple[int, str]:
        """(exit status, output) of ``kvstore-tiers args``; with the doc's missing-package
        line as its output, in a child without that extra, printing exactly that line."""
        from kvstore_tiers.cli._common import EXTRA_OF_MODULE

        m = _MISSING_EXTRA.match(cmd.output[0]) if cmd.output else None
        if m is None:
            out = invoke(*args)
            return out.exit_code, out.output
        hidden = ",".join(mod for mod, extra in EXTRA_OF_MODULE.items() if extra == m.group(1))
        proc = run_without(hidden, *args, cwd=self.work)
        assert proc.stderr.strip().splitlines()[-1:] == [cmd.output[0]], \
            f"{cmd.where}: the command prints\n{proc.stderr}"
        return proc.returncode, proc.stderr


@pytest.mark.parametrize("block", _blocks())
def test_every_command_runs_or_is_marked(block: list[Command], tmp_path: Path,
                                         request: pytest.FixtureRequest,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    runnable = [c for c in block if c.mark is None]
    for cmd in block:
        if cmd.mark == "long-running":
            test = covering_test(cmd)
            assert test and list(REPO.glob(test)), \
                f"{cmd.where}: long-running, but COVERED_BY names no test that runs it"
    for cmd in runnable:
        assert runs_here(cmd), (f"{cmd.where}: {cmd.text!r} is neither run here nor marked: "
                                "mark it (# needs: gpu|docker|network, # long-running)")
    if not runnable:
        return
    shell = _Shell(tmp_path, request, monkeypatch)
    for i, cmd in enumerate(runnable):
        after = runnable[i + 1] if i + 1 < len(runnable) else None
        if after and after.text == "echo $?":
            shown = int(after.output[0])
        else:  # a shown error is exit status 1
            shown = int(bool(cmd.output) and cmd.output[0].startswith(("Error:", "FAIL ")))
        shell.run(cmd, shown)


def test_the_docs_have_commands_of_each_kind() -> None:
    """The parser finds what the docs hold (a regression guard for tests/doc_commands.py)."""
    cmds = all_commands()
    assert sum(c.mark is None for c in cmds) >= 15
    assert {c.mark for c in cmds} >= {None, "needs: gpu", "needs: docker", "long-running"}
