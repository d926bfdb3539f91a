"""Administration of a store, written once for every backend.

What the ``kvstore-tiers`` commands ``check``, ``stats``, ``verify`` and
``gc`` do, on any :class:`~kvstore_tiers.backends.base.Backend` through its
public methods only (``iter_objects``, ``get``, ``delete``, ``delete_many``),
so a backend added as a plugin gets every command for free and a backend's
batch delete (``supports_delete_many``) speeds up gc without a line here.

One module per job:

* :mod:`.config` -- the tier dicts in a user's config text, validated;
* :mod:`.store` -- an admin view of a store (every namespace under the
  tier's root) and what a namespace's ``config.json`` says;
* :mod:`.stats` -- objects, bytes, namespaces and ages;
* :mod:`.verify` -- every object decoded as a load decodes it;
* :mod:`.gc` -- one planner (by age, then oldest down to a size) and one
  result type;
* :mod:`.check` -- a block round-tripped through vLLM's real manager, in a
  namespace of its own that is removed afterwards.

Safety: every operation here may run while engines use the store. Deleting an
object is always safe (the next lookup is a miss and vLLM recomputes), and
nothing here writes block data into a namespace an engine uses.
"""

from __future__ import annotations

from kvstore_tiers.admin.check import CheckReport, check_tier
from kvstore_tiers.admin.config import VLLM_TIER_KEYS, backend_type, parse_tiers, validate_tier
from kvstore_tiers.admin.gc import GcResult, gc, gc_store, plan_gc
from kvstore_tiers.admin.stats import (
    AGE_BUCKETS,
    NamespaceStats,
    StoreStats,
    age_bucket,
    collect_stats,
)
from kvstore_tiers.admin.store import (
    ADMIN_NAMESPACE,
    describe_run_config,
    namespace_of,
    open_store,
    read_run_config,
)
from kvstore_tiers.admin.verify import VerifyReport, verify_object, verify_store

__all__ = [
    "ADMIN_NAMESPACE", "AGE_BUCKETS", "VLLM_TIER_KEYS", "CheckReport", "GcResult",
    "NamespaceStats", "StoreStats", "VerifyReport", "age_bucket", "backend_type", "check_tier",
    "collect_stats", "describe_run_config", "gc", "gc_store", "namespace_of", "open_store",
    "parse_tiers", "plan_gc", "read_run_config", "validate_tier", "verify_object",
    "verify_store",
]
