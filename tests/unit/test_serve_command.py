"""The serve line printed by ``kvstore-tiers config`` runs: its module exists and
vLLM's own server parser accepts its arguments (the real server runs it in
tests/e2e/test_openai_server.py)."""

from __future__ import annotations

import importlib.util
import shlex

import pytest
from click.testing import CliRunner

from kvstore_tiers.cli import main as cli_main
from kvstore_tiers.cli.config import SERVE_MODULE

vllm = pytest.importorskip("vllm")


def _server_parser():
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:  # vLLM 0.33
        from vllm.entrypoints.common.cli_args import make_arg_parser
    except ImportError:  # vLLM 0.32
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    return make_arg_parser(FlexibleArgumentParser())


def _serve_argv(output: str) -> list[str]:
    """The printed command after the JSON, joined over its line continuation."""
    tail = output.split("\npython -m ", 1)[1]
    return shlex.split("python -m " + tail.replace("\\\n", " "))


def test_config_prints_a_serve_line_that_vllm_accepts(tmp_path) -> None:
    res = CliRunner().invoke(cli_main, [
        "config", "--tier", "fs", "--root-dir", str(tmp_path / "kv"), "--tier", "redis",
        "--url", "redis://10.0.0.5:6379/0", "--model", "org/Some Model", "--cpu-gb", "2"])
    assert res.exit_code == 0, res.output
    argv = _serve_argv(res.output)
    assert argv[:3] == ["python", "-m", SERVE_MODULE]
    assert importlib.util.find_spec(SERVE_MODULE) is not None
    from vllm.platforms import current_platform

    if current_platform.is_unspecified():  # vLLM's code without a build (the 0.33 pass)
        pytest.skip("vLLM's server parser needs a platform")
    args = _server_parser().parse_args(argv[3:])
    assert args.model == "org/Some Model"
    kv = args.kv_transfer_config  # vLLM's KVTransferConfig, parsed from the JSON
    extra = kv.kv_connector_extra_config
    assert kv.kv_connector == "OffloadingConnector"
    assert extra["cpu_bytes_to_use"] == 2 << 30
    assert [t["type"] for t in extra["secondary_tiers"]] == ["fs", "redis"]

