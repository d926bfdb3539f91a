"""Tools around the tiers, apart from the tier library itself.

* :mod:`~kvstore_tiers.tools.bench`: ``kvstore-tiers bench``.
* :mod:`~kvstore_tiers.tools.demo`: ``kvstore-tiers demo``.
* :mod:`~kvstore_tiers.tools.samples`: the real KV samples (a directory given
  by option or ``KVSTORE_KV_SAMPLES``, never guessed).

The tier library (tier, backends, frame, admin, ...) imports nothing from
here; the bench drives tiers through :mod:`kvstore_tiers.admin.harness`,
vLLM's real tiering spec and manager, as ``kvstore-tiers check`` does.
"""
