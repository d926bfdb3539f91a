"""``bench --trace --cost``: the s3 tier's requests priced, and the request counts the
replay reports checked against a real server's own request log (moto's recorder)."""

from __future__ import annotations

import importlib.util
import json
import uuid
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvstore_tiers.tools.bench import cost
from kvstore_tiers.tools.bench.trace_file import TraceRequest
from tests.servers import FAKE_KEY_ID, FAKE_SECRET, moto_server_bin, run_moto

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")


def _req(*ids: int) -> TraceRequest:
    return TraceRequest(0, 512 * len(ids), 0, ids)


# -- the arithmetic --------------------------------------------------------------------------
def test_operations_fold_into_kinds_priced_by_aws_class() -> None:
    kinds = cost.by_kind({"PutObject": 1000, "HeadObject": 2000, "GetObject": 500,
                          "ListObjectsV2": 10, "DeleteObjects": 3, "GetBucketLocation": 1})
    assert kinds == {"PUT": 1000, "GET": 500, "HEAD": 2000, "LIST": 10, "DELETE": 3, "other": 1}
    usd = cost.request_dollars(kinds, cost.S3Prices())
    assert usd["PUT"] == pytest.approx(0.005)
    assert usd["HEAD"] == pytest.approx(0.0008)  # HEAD is a GET-class request
    assert usd["GET"] == pytest.approx(0.0002)
    assert usd["LIST"] == pytest.approx(0.00005)  # LIST is a PUT-class request
    assert usd["DELETE"] == 0.0  # free on AWS
    assert usd["total"] == pytest.approx(0.005 + 0.0008 + 0.0002 + 0.00005 + 0.0000004)
    mine = cost.request_dollars(kinds, cost.S3Prices(put_per_1k=1.0, delete_per_1k=1.0))
    assert mine["PUT"] == pytest.approx(1.0) and mine["DELETE"] == pytest.approx(0.003)


def test_block_cost_is_per_block_stored_served_and_per_million_tokens() -> None:
    c = cost.block_cost({"PutObject": 200, "HeadObject": 300, "GetObject": 100},
                        objects_written=200, blocks_served=100, prompt_tokens=1_000_000,
                        tokens_served=51_200, stored_bytes=2 * 10**9, prices=cost.S3Prices(),
                        scaled_bytes_per_object={"big": 10**9})
    assert c["per_block_stored"]["PUT"] == 1.0 and c["per_block_stored"]["HEAD"] == 1.5
    assert c["per_block_served"]["GET"] == 1.0 and c["per_block_served"]["HEAD"] == 3.0
    total = 200 * 0.005e-3 + 400 * 0.0004e-3
    assert c["dollars"]["total"] == pytest.approx(total)
    assert c["dollars_per_million_prompt_tokens"] == pytest.approx(total)
    assert c["dollars_per_million_tokens_served"] == pytest.approx(total / 0.0512)
    assert c["storage_dollars_per_month"] == pytest.approx({"measured": 2 * 0.023,
                                                            "big": 200 * 0.023})
    # Chunks of 16 tokens instead of the trace's 512: 32x the requests per token.
    assert cost.per_million_tokens(1.0, 10**6, tokens_per_object=16) == pytest.approx(32.0)
    assert cost.per_million_tokens(1.0, 0) is None
    assert cost.block_cost({}, 0, 0, 0, 0, 0, cost.S3Prices())["per_block_stored"]["PUT"] is None
    line = cost.headline(c, "s3, always")
    assert line.startswith("s3, always: serving a million prompt tokens with the s3 tier "
                           f"costs ${total:.4f} in requests at these prices")


# -- the counts, against the server's log ----------------------------------------------------
def _server_kinds(log: Path, bucket: str) -> Counter[str]:
    """The block requests moto recorded for ``bucket``, by operation (keys ``*.kvf``)."""
    ops: Counter[str] = Counter()
    # moto's threads append their entries to one file: two may share a line.
    text, at, decoder = log.read_text(), 0, json.JSONDecoder()
    while (at := len(text) - len(text[at:].lstrip())) < len(text):
        entry, at = decoder.raw_decode(text, at)
        url = urlsplit(entry["url"])
        if url.path.startswith(f"/{bucket}/") and url.path.endswith(".kvf"):
            ops[{"PUT": "PutObject", "GET": "GetObject", "HEAD": "HeadObject",
                 "DELETE": "DeleteObject"}[entry["method"]]] += 1
        elif url.path.rstrip("/") == f"/{bucket}" and entry["method"] == "POST":
            ops["DeleteObjects"] += 1
    return ops


#: Engine A stores everything; a fresh engine B (an empty presence index, as another
#: host) replays the trace again: HEADs for what it looks up, GETs for what it loads.
#: A primary of 10 blocks: the 10-block requests push the earlier blocks out of it.
TRACE = [_req(1, 2, 3, 4, 5, 6), _req(*range(11, 21)), _req(1, 2, 3, 4, 5, 6, 7),
         _req(*range(21, 31)), _req(1, 2, 3, 8)]


@needs_vllm
def test_the_counted_requests_are_the_ones_the_server_saw(tmp_path: Path) -> None:
    import boto3

    from kvstore_tiers.tools.bench import trace

    moto_server_bin()
    log = tmp_path / "moto-log.jsonl"
    env = {"MOTO_ENABLE_RECORDING": "true", "MOTO_RECORDER_FILEPATH": str(log)}
    keys = {"aws_access_key_id": FAKE_KEY_ID, "aws_secret_access_key": FAKE_SECRET}
    with run_moto(env) as url:
        bucket = f"cost-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=url, region_name="us-east-1", **keys).create_bucket(
            Bucket=bucket)
        cfg = {"type": "s3", "bucket": bucket, "endpoint_url": url, "region": "us-east-1",
               **keys, **trace.TIER_KEYS, "backpressure": dict(trace.REMOTE_BACKPRESSURE)}
        rows = trace.payload_rows(8192, None)
        counted: list[dict[str, Any]] = []
        for _ in ("A", "B"):
            log.write_text("")
            stats, c = trace.replay(TRACE, cfg, 8192, 10, rows,
                                    lambda tier: {"requests": dict(tier.backend.requests)})
            counted.append({"stats": stats, "counters": c,
                            "server": _server_kinds(log, bucket)})
    a, b = counted
    for run in counted:
        assert Counter(run["counters"]["requests"]) == run["server"]
    distinct = 28
    # A: every block PUT once; an existence check (a GET answered 404, as
    # lookup_prefetch_bytes has it) for each block it looked up before storing it.
    assert a["server"]["PutObject"] == a["counters"]["objects_stored"] == distinct
    assert a["server"]["GetObject"] >= distinct + a["counters"]["objects_loaded"]
    assert a["server"]["HeadObject"] == 0
    # B: nothing new to store; one GET per block it looks up (a block found is then in
    # its presence index: never asked again), whose body the block's first load takes,
    # and a GET per later load, as often as the small primary lost the block: one GET
    # per load (more than blocks), no HEAD.
    assert b["counters"]["objects_stored"] == 0
    assert b["server"]["HeadObject"] == 0
    assert b["server"]["GetObject"] == b["counters"]["objects_loaded"] > distinct
    assert b["stats"].tier_blocks_hit == b["counters"]["objects_loaded"]


# -- the command line ------------------------------------------------------------------------
@needs_vllm
def test_cli_cost_options_are_checked(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvstore_tiers.cli import main

    def usage(*args: str) -> str:
        r = CliRunner().invoke(main, ["bench", *args])
        assert r.exit_code == 2, r.output
        return r.output

    trace = ["--trace", __file__]
    assert "only apply to --trace" in usage("--cost")
    assert "add --tier s3" in usage(*trace, "--cost")
    assert "add --tier s3" in usage(*trace, "--cost", "--nodes", "2", "--tier", "redis")
    assert "only apply to --cost" in usage(*trace, "--tier", "s3", "--price-put", "1")
    # The options pass; the file is no trace.
    assert "not a trace request" in usage(*trace, "--tier", "s3", "--cost", "--price-get", "1")


def test_trace_rows_on_s3_are_priced() -> None:
    from kvstore_tiers.cli.bench_trace import add_trace_costs

    s3 = {"tier": "s3", "policy": "always", "requests_by_kind": {"PutObject": 10,
                                                                 "HeadObject": 10},
          "objects_written": 10, "stored_bytes_written": 10**6,
          "replay": {"tier_blocks_hit": 0, "tokens_requested": 5120, "tier_tokens_hit": 0}}
    result = {"rows": [{"tier": "fs", "policy": "always"}, s3]}
    ((label, c),) = add_trace_costs(result, cost.S3Prices())
    assert label == "s3, always" and s3["cost"] is c
    assert c["dollars"]["total"] == pytest.approx(10 * 0.005e-3 + 10 * 0.0004e-3)
    assert c["per_block_served"]["PUT"] is None  # nothing served


# -- the bench's moto server -----------------------------------------------------------------
#: A stand-in for moto_server that answers every GET and ignores SIGTERM, as a moto
#: still winding down its connections after a long replay does.
STUBBORN = '''
import http.server, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("-p") + 1])), H).serve_forever()
'''


def test_a_server_that_will_not_stop_is_killed_not_raised(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    import subprocess
    import sys

    from kvstore_tiers.tools.bench import s3_bench

    exe = tmp_path / "moto_server"
    exe.write_text(f"#!{sys.executable}\n{STUBBORN}")
    exe.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    started: list[subprocess.Popen[bytes]] = []
    real_popen = subprocess.Popen

    def popen(*args: Any, **kw: Any) -> subprocess.Popen[bytes]:
        started.append(real_popen(*args, **kw))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", popen)
    with s3_bench.moto_server(stop_grace_s=0.5) as url:
        assert url.startswith("http://127.0.0.1:")
    (proc,) = started
    assert proc.returncode is not None  # killed and reaped
