"""The two-phase KV tier demo and its helpers (also used by the end-to-end tests).

* :mod:`~kvstore_tiers.tools.demo.models`: offline model dirs (real SmolLM2, tiny random Llama).
* :mod:`~kvstore_tiers.tools.demo.prompts`: deterministic shared-prefix prompts.
* :mod:`~kvstore_tiers.tools.demo.phase`: one engine run in its own process.
* :mod:`~kvstore_tiers.tools.demo.runner`: starts phases, runs the demo.
* :mod:`~kvstore_tiers.tools.demo.report`: the rich table.
"""
