"""``kvstore-tiers bench`` (:mod:`kvstore_tiers.cli.bench`): each tier against its baseline.

* :mod:`.runner`: the plan and the driver (one result dict).
* :mod:`.fs_bench`, :mod:`.redis_bench`, :mod:`.s3_bench`: the measurements.
* :mod:`.cpu`: process CPU seconds per GB, and the memcpy and CRC-32C reference.
* :mod:`.load_breakdown`: the load trace summarised per phase (``--load-trace``).
* :mod:`.pairing`: ratios of alternating rounds, balanced for position.
* :mod:`.tables`, :mod:`.plots`: the result printed and plotted.
"""
