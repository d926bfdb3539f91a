"""Storage backends. Each module holds one :class:`~kvstore_tiers.backends.base.Backend`."""
