"""Network distance for the tests and the bench: a delaying TCP proxy
(:mod:`.delay`) and bandwidth-capped links between network namespaces
(:mod:`.link`). Not part of the tier: nothing under ``kvstore_tiers`` outside
``tools`` imports it."""
