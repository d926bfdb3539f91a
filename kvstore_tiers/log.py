"""Make our log lines appear where vLLM's do.

vLLM configures handlers on its own ``vllm`` logger only, so records of the
``kvstore_tiers`` logger would reach nobody below WARNING. When vLLM's
logger has handlers and ours has none, ours borrows them. When vLLM has not
configured logging yet (its plugins load before that in some processes), ours
gets a stderr handler in vLLM's format, so lines such as the "'fs' now means"
notice are not lost. ``VLLM_CONFIGURE_LOGGING=0`` means the application
configures logging itself: then we add nothing.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"


class _CurrentStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record is emitted (as
    ``logging.lastResort`` does), so a replaced stderr (a CLI test runner, a
    daemonised process) never leaves us writing to a closed stream."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def attach_to_vllm_logging() -> None:
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    ours = logging.getLogger("kvstore_tiers")
    if ours.handlers:
        return
    vllm_logger = logging.getLogger("vllm")
    if vllm_logger.handlers:
        for handler in vllm_logger.handlers:
            ours.addHandler(handler)
        ours.setLevel(vllm_logger.level or logging.INFO)
        ours.propagate = vllm_logger.propagate  # as vLLM's own records do
    else:
        # Records still propagate: an application's root handlers see them too.
        handler = _CurrentStderrHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)
