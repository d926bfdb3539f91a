"""vLLM's OpenAI server with an fs tier, the way a user runs it, across a hard restart.

Server A starts from the serve line ``kvstore-tiers config`` prints, answers
greedy completions (cold: computed, stored to the tier), and is killed with
SIGKILL (process group: API server and engine core), which leaves vLLM's
primary region behind in /dev/shm. Server B starts on the same tier: once it
is up, A's stale region is gone (removed by a tier start: B's, or that of any
other engine on the machine meanwhile, so the test asserts the outcome, not
who removed it). B's /metrics has no ``vllm:kvstore_*`` sample until a first
request (vLLM publishes connector metrics from engine steps;
docs/metrics.md); after a one-token warm-up request every series is there,
at 0. B answers the same prompts from the tier with the same tokens, and
/metrics shows the tier hits. B is then stopped gracefully (SIGTERM with
``--shutdown-timeout``) and leaves no region of its own behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvstore_tiers.cli.config import kv_transfer_config, serve_command
from kvstore_tiers.metrics import COUNTERS, GAUGES, HISTOGRAMS, PREFIX
from kvstore_tiers.shm import PATTERN, SHM_DIR, inodes_in_use
from tests.servers import free_low_port

pytestmark = pytest.mark.engine

BLOCK = 128
PREFIX_TOKENS = 4 * BLOCK  # shared by both prompts
SUFFIX_TOKENS = 150  # distinct per prompt: one more full chunk and a partial one
MODEL_NAME = "tiny"


def _prompts(model: Path) -> list[list[int]]:
    """Two token-id prompts sharing PREFIX_TOKENS (ids past the 2 special tokens)."""
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(7)
    shared = [rng.randrange(2, vocab) for _ in range(PREFIX_TOKENS)]
    return [shared + [rng.randrange(2, vocab) for _ in range(SUFFIX_TOKENS)] for _ in range(2)]


def _regions() -> set[Path]:
    return set(SHM_DIR.glob(PATTERN))


def _regions_of(log_text: str) -> set[Path]:
    """The offload regions a server's own log says it created (other vLLM
    processes on the machine make regions of their own meanwhile)."""
    return {Path(m) for m in re.findall(r"Created mmap file (/dev/shm/vllm_offload_\S+\.mmap)",
                                        log_text)}


def _wait_unused(paths: set[Path], timeout_s: float = 60.0) -> None:
    """Until no live process maps or holds ``paths``: a SIGKILLed server's
    engine processes are gone only once the kernel has torn them down."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        used = inodes_in_use(Path("/proc"), SHM_DIR)
        live = [p for p in paths if p.exists() and (p.stat().st_dev, p.stat().st_ino) in used]
        if not live:
            return
        time.sleep(0.5)
    pytest.fail(f"processes of the killed server still map {sorted(paths)}")


def _shm_files() -> set[Path]:
    return set(SHM_DIR.iterdir()) if SHM_DIR.is_dir() else set()


def _remove_unused(paths: set[Path]) -> None:
    """A SIGKILLed vLLM also leaves its message queues (psm_*) and semaphores
    (sem.mp-*): not ours to sweep in general (generic Python names), but the
    test removes the ones its killed server made, once nobody uses them."""
    used = inodes_in_use(Path("/proc"), SHM_DIR)
    for p in paths:
        with contextlib.suppress(OSError):
            st = p.stat()
            if p.name.startswith(("psm_", "sem.mp-")) and (st.st_dev, st.st_ino) not in used:
                p.unlink()


class Server:
    """One OpenAI server process group, started from the printed serve line."""

    def __init__(self, model: Path, tier_root: Path, log: Path) -> None:
        cfg = kv_transfer_config([{"type": "fs", "root_dir": str(tier_root)}], 64 << 20, BLOCK)
        argv = shlex.split(serve_command(str(model), cfg).replace("\\\n", " "))
        assert argv[0] == "python"
        self.port = free_low_port()  # no client connection takes it before the bind
        self.base = f"http://127.0.0.1:{self.port}"
        self.argv = [sys.executable, *argv[1:], "--host", "127.0.0.1", "--port", str(self.port),
                     "--served-model-name", MODEL_NAME, "--dtype", "float32",
                     "--max-model-len", "2048", "--max-num-seqs", "2", "--enforce-eager",
                     "--seed", "0", "--gpu-memory-utilization", "0.25",
                     "--shutdown-timeout", "20"]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VLLM_CPU_KVCACHE_SPACE="1")
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)

    def wait_ready(self, timeout_s: float = 420.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        pytest.fail(f"server not ready after {timeout_s:.0f}s:\n{self.tail()}")

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def tail(self) -> str:
        return self.text()[-6000:]

    def complete(self, prompt: list[int], max_tokens: int = 8) -> str:
        """Greedy completion, with the openai client if the venv has it, plain HTTP otherwise."""
        try:
            import openai
        except ImportError:
            body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                               "temperature": 0}).encode()
            req = urllib.request.Request(self.base + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as r:
                return json.loads(r.read())["choices"][0]["text"]
        client = openai.OpenAI(base_url=self.base + "/v1", api_key="unused", timeout=300)
        res = client.completions.create(model=MODEL_NAME, prompt=prompt,
                                        max_tokens=max_tokens, temperature=0)
        return res.choices[0].text

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            return r.read().decode()

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics summed over its labels: name -> value."""
        text = self.metrics_text()
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        return out

    def wait_stored(self, n: int, timeout_s: float = 60.0) -> dict[str, float]:
        """Until the tier has stored ``n`` objects and has nothing queued."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            stored = m.get(f"{PREFIX}objects_stored_total", 0.0)
            if stored >= n and m.get(f"{PREFIX}queued_chunks", 1.0) == 0:
                return m
            if time.monotonic() > deadline:
                pytest.fail(f"tier stored {stored} of {n} objects:\n{self.tail()}")
            time.sleep(0.5)

    def kill_hard(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)  # API server, engine core, workers
        self.proc.wait(timeout=60)

    def stop(self, timeout_s: float = 90.0) -> int:
        """SIGTERM to the server process only (as ``docker stop`` does), then
        SIGKILL to whatever of its process group is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait(timeout=60)


def test_openai_server_restart_served_from_tier(tiny_model: Path, tmp_path: Path) -> None:
    prompts = _prompts(tiny_model)
    shared = PREFIX_TOKENS // BLOCK
    chunks = shared + 2 * ((PREFIX_TOKENS + SUFFIX_TOKENS) // BLOCK - shared)  # distinct
    tier_root = tmp_path / "tier"
    shm_before = _shm_files()

    a = Server(tiny_model, tier_root, tmp_path / "server-a.log")
    try:
        a.wait_ready()
        cold = [a.complete(p) for p in prompts]
        metrics_a = a.wait_stored(chunks)
        left_by_a = _regions_of(a.text()) & _regions()
        a.kill_hard()
    finally:
        a.stop()
        _remove_unused(_shm_files() - shm_before)
    assert left_by_a, "server A made no region in /dev/shm"
    assert _regions() >= left_by_a  # SIGKILL: nobody removed it
    _wait_unused(left_by_a)  # stale from here on: B's tier start must remove it

    b = Server(tiny_model, tier_root, tmp_path / "server-b.log")
    try:
        b.wait_ready()
        # Removed by a tier start: B's, or another engine's on this machine meanwhile.
        assert not (_regions() & left_by_a), "A's stale region outlived B's start"
        idle = b.metrics_text()
        b.complete([2, 3, 4], max_tokens=1)  # the warm-up docs/metrics.md recommends
        zeros = b.metrics()
        warm = [b.complete(p) for p in prompts]
        metrics = b.metrics()
    finally:
        rc = b.stop()
    made_by_b = _regions_of(b.text())
    assert made_by_b, "server B made no region in /dev/shm"
    assert not (made_by_b & _regions()), "B's graceful stop left its region behind"
    # Before any request vLLM publishes no series of ours (docs/metrics.md).
    ours = [ln for ln in idle.splitlines() if PREFIX in ln]
    assert not [ln for ln in ours if not ln.startswith("#")], ours
    # One request later every series is there, at 0 where nothing happened.
    for name in COUNTERS:
        assert zeros[f"{PREFIX}{name}_total"] == 0, name
    for name in GAUGES:
        assert f"{PREFIX}{name}" in zeros, name
    assert zeros[f"{PREFIX}healthy"] == 1
    for name in HISTOGRAMS:
        assert zeros[f"{PREFIX}{name}_count"] == 0 and f"{PREFIX}{name}_bucket" in zeros, name
    assert warm == cold
    assert metrics["vllm:external_prefix_cache_hits_total"] > 0
    assert metrics[f"{PREFIX}objects_loaded_total"] == chunks
    assert metrics[f"{PREFIX}corrupt_objects_total"] == 0
    assert metrics[f"{PREFIX}healthy"] == 1
    for name in COUNTERS:
        assert f"{PREFIX}{name}_total" in metrics, name
    for name in GAUGES:
        assert f"{PREFIX}{name}" in metrics, name
    assert metrics_a[f"{PREFIX}objects_stored_total"] == chunks
    assert metrics_a[f"{PREFIX}store_seconds_count"] > 0  # A stored, B only loaded
    assert metrics[f"{PREFIX}load_seconds_count"] > 0
    assert {f"{PREFIX}{name}_count" for name in HISTOGRAMS} <= set(metrics)
    assert rc == 0, b.tail()
    assert "kvstore tier 'fs' shut down" in b.text()  # the graceful stop ran our shutdown
