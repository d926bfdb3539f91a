"""Tiny random models built at test time for the model-identity tests.

* :func:`tiny_gemma3_model_dir`: Gemma-3-style, sliding-window and
  full-attention layers alternating: vLLM runs it with two KV cache groups.
* :func:`tiny_llama_kv2_model_dir`: the tiny Llama with two KV heads, so that
  TP=2 splits the heads (one per rank) instead of replicating one.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

SLIDING_WINDOW = 256


def _save(model: Any, tok: Any, dest: Path) -> Path:
    """Written beside ``dest`` and renamed into place: never half a model."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest  # tokens: two 128-token chunks, far shorter than the prompts


def tiny_gemma3_model_dir(dest: Path, tokenizer_from: Path, *, dtype: str = "float32",
                          seed: int = 0) -> Path:
    """4 layers (sliding, full, sliding, full), head_dim 64, random weights, the
    tokenizer of ``tokenizer_from``. Init scale 0.2 and an untied output
    embedding: tied, or at 0.5 (the tiny Llama's scale), this random model's
    greedy output ignores the prompt (one token repeated, or attention collapsed
    onto one position), and an output that ignores the KV proves nothing. At
    0.2 a change of one token 600 positions back changes the output."""
    import torch
    from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig

    dest = Path(dest)
    if (dest / "config.json").is_file():
        return dest
    tok = AutoTokenizer.from_pretrained(str(tokenizer_from))
    config = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64,
        query_pre_attn_scalar=64, sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        max_position_embeddings=8192, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0,
        torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).to(getattr(torch, dtype))
    return _save(model, tok, dest)


def tiny_llama_kv2_model_dir(dest: Path, tokenizer_from: Path, *, seed: int = 0) -> Path:
    """2 layers, 2 query and 2 KV heads of 64, float32, random weights (large init)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    dest = Path(dest)
    if (dest / "config.json").is_file():
        return dest
    tok = AutoTokenizer.from_pretrained(str(tokenizer_from))
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=8192, initializer_range=0.5, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    return _save(model, tok, dest)
