"""Tools around the tiers, apart from the tier library itself.

* :mod:`~kvstore_tiers.tools.harness`: vLLM's real tiering spec and manager
  on a CPU machine, driven like the scheduler (tests, bench, ``check``).
* :mod:`~kvstore_tiers.tools.bench`: ``kvstore-tiers bench``.
* :mod:`~kvstore_tiers.tools.demo`: ``kvstore-tiers demo``.
* :mod:`~kvstore_tiers.tools.samples`: the real KV samples (a directory given
  by option or ``KVSTORE_KV_SAMPLES``, never guessed).

The tier library (tier, backends, frame, ...) imports nothing from here;
``kvstore-tiers check`` (:func:`kvstore_tiers.admin.check_tier`) builds its
round trip with the harness.
"""
