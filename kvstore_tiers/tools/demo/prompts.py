"""Deterministic demo prompts: one long shared prefix plus distinct suffixes.

Prompts are built as token ids (not text) so every prompt shares exactly
``prefix_tokens`` leading tokens, whatever the tokenizer does at the
boundary; the same plan gives the same ids in every process.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

_NAMES = ("alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "theta", "lambda", "zeta")
_PLACES = ("rack", "row", "hall", "zone", "shelf")


@dataclass(frozen=True)
class PromptPlan:
    """What to build: ``num_prompts`` prompts of ``prefix_tokens`` shared tokens
    followed by about ``suffix_tokens`` tokens unique to each prompt."""

    prefix_tokens: int = 2000
    suffix_tokens: int = 200
    num_prompts: int = 4
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _facts(rng: random.Random, start: int) -> str:
    """An endless-ish deterministic 'document' of numbered facts."""
    lines = []
    for i in range(start, start + 50):
        name = f"{rng.choice(_NAMES)}-{rng.randint(1, 999)}"
        lines.append(
            f"Fact {i}: storage node {name} sits in {rng.choice(_PLACES)} {rng.randint(1, 40)} "
            f"and holds {rng.randint(100, 9999)} cached blocks for tenant {rng.randint(1, 64)}."
        )
    return "\n".join(lines) + "\n"


def build_prompts(tokenizer: Any, plan: PromptPlan) -> list[list[int]]:
    """Token ids of ``plan.num_prompts`` prompts (``tokenizer``: an HF tokenizer).

    Contract: every prompt starts with the same ``plan.prefix_tokens`` ids; the
    suffixes differ from their first token on (each names its own question
    number) and are cut to at most ``plan.suffix_tokens`` ids."""
    rng = random.Random(plan.seed)
    prefix: list[int] = []
    text = "Inventory of the KV cache storage cluster.\n"
    n = 0
    while len(prefix) < plan.prefix_tokens:
        text += _facts(rng, n)
        n += 50
        prefix = tokenizer.encode(text, add_special_tokens=False)
    prefix = prefix[: plan.prefix_tokens]
    prompts = []
    for j in range(plan.num_prompts):
        qrng = random.Random(plan.seed * 1000 + j + 1)
        suffix_text = f"\n\nQuestion {j + 1}. Notes for this question:\n"
        suffix_text += _facts(qrng, 1000 * (j + 1))
        suffix = tokenizer.encode(suffix_text, add_special_tokens=False)[: plan.suffix_tokens]
        tail = tokenizer.encode(
            f"\nQuestion {j + 1}: which rack holds the first node above? Answer:",
            add_special_tokens=False,
        )
        ids = prefix + suffix[: max(0, plan.suffix_tokens - len(tail))] + tail
        prompts.append(ids)
    return prompts
