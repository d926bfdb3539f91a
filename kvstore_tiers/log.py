"""Make our log lines appear where vLLM's do.

vLLM configures handlers on its own ``vllm`` logger only, so records of the
``kvstore_tiers`` logger would reach nobody below WARNING. When vLLM's
logger has handlers and ours has none, ours borrows them.
"""

from __future__ import annotations

import logging


def attach_to_vllm_logging() -> None:
    ours = logging.getLogger("kvstore_tiers")
    if ours.handlers:
        return
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        ours.addHandler(handler)
    ours.setLevel(vllm_logger.level or logging.INFO)
    ours.propagate = False
