"""The fs backend: one file per block under a local or shared directory.

Modules, one role each:

* :mod:`.backend` -- :class:`FileSystemBackend`, the :class:`Backend`: batches
  of files in, frames through :class:`~kvstore_tiers.frame.FrameCodec`;
* :mod:`.config` -- :class:`FsConfig`, the tier's keys;
* :mod:`.layout` -- where a namespace's files live (shard directories, the
  object walk);
* :mod:`.writers` -- writer ids held by ``flock``, the temp-file names that
  carry them, and the sweep of killed writers' temp files;
* :mod:`.fileio` -- the per-batch file calls (compiled ``_fsio.c`` and their
  pure-Python twins), the O_DIRECT probe and the page-aligned buffers it needs;
* :mod:`.capacity` -- the ``max_bytes`` / ``min_free_bytes`` controller:
  room reserved before each write in a ledger shared across processes.
"""

from kvstore_tiers.backends.fs.backend import FileSystemBackend
from kvstore_tiers.backends.fs.config import FsConfig
from kvstore_tiers.backends.fs.fileio import O_DIRECT, PAGE, probe_o_direct

__all__ = ["O_DIRECT", "PAGE", "FileSystemBackend", "FsConfig", "probe_o_direct"]
