"""The s3 tier: KV blocks as objects on AWS S3 or any S3-compatible server.

Modules: :mod:`.config` (the tier's keys, secret scrubbing), :mod:`.client`
(client arguments, the event loop of the data path), :mod:`.probe` (the
start-up probe), :mod:`.lifecycle` (listing, bucket lifecycle expiry),
:mod:`.record` (the namespace's ``config.json``, kept younger than any
lifecycle rule) and
:mod:`.backend` (:class:`S3Backend`, the data path).
"""

from kvstore_tiers.backends.s3.backend import S3Backend
from kvstore_tiers.backends.s3.config import S3Config
from kvstore_tiers.backends.s3.lifecycle import install_lifecycle

__all__ = ["S3Backend", "S3Config", "install_lifecycle"]
