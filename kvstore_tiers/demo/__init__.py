"""The two-phase KV tier demo and its helpers (also used by the end-to-end tests).

* :mod:`~kvstore_tiers.demo.models`: offline model dirs (real SmolLM2, tiny random Llama).
* :mod:`~kvstore_tiers.demo.prompts`: deterministic shared-prefix prompts.
* :mod:`~kvstore_tiers.demo.phase`: one engine run in its own process.
* :mod:`~kvstore_tiers.demo.runner`: starts phases, runs the demo.
* :mod:`~kvstore_tiers.demo.report`: the rich table.
"""
