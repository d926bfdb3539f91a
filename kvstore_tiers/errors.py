"""Error classes shared by the core and every backend.

A backend raises exactly one of three kinds of error, and the core decides
what each one means for vLLM:

* :class:`ObjectMissing` -- the object is not there (never stored, evicted,
  expired). A load of it is a per-key miss; nothing is logged as an error.
* :class:`ObjectCorrupt` -- the object is there but unusable (bad frame,
  checksum mismatch, wrong length, another namespace's object). A miss, the
  object is removed, and the corruption counter goes up.
* :class:`TransientError` -- the backend could not answer now (timeout,
  connection reset, 5xx, OOM reply, ENOSPC, EIO). A failed job; the object,
  if any, is left alone and the tier's health tracks it.

Anything else a backend raises is treated as transient.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


class KVStoreError(Exception):
    """Base class of every error raised by kvstore_tiers."""


class ConfigError(KVStoreError, ValueError):
    """A tier configuration is invalid. The message names the offending key."""


class BackendError(KVStoreError):
    """Base class of the errors a backend raises from its data methods."""


class ObjectMissing(BackendError):
    """The object does not exist on the backend."""


class ObjectCorrupt(BackendError):
    """The object exists but is not a valid frame for the expected key."""


class TransientError(BackendError):
    """The backend failed for a reason that may pass (I/O, network, capacity)."""


class Cancelled(TransientError):
    """A transfer slot cancelled before it started (drain, ``reset_cache``, shutdown).

    Reported failed to vLLM like any failed slot, but it says nothing of the
    backend's health: it never feeds the circuit breaker.
    """


def classify(exc: BaseException) -> BackendError:
    """Map an arbitrary exception onto the backend error kinds.

    ObjectMissing/ObjectCorrupt/TransientError pass through; anything else
    (a bug, an unexpected client error) counts as transient, so it fails the
    job without declaring the object corrupt.
    """
    if isinstance(exc, BackendError):
        return exc
    err = TransientError(f"{type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


def detached(outcome: T) -> T:
    """``outcome`` as is, or, if it is an error, without its traceback (nor its
    causes'), for keeping as a job's outcome.

    Why: the traceback of an error raised on an I/O thread holds that
    thread's frames, whose locals are views of vLLM's primary KV memory; a
    kept traceback is an export that stops vLLM from unmapping it at
    shutdown ("cannot close exported pointers exist"), and a batch call's
    frame that also lists the error makes a cycle only the cyclic GC frees.
    The message and type, all we report, stay.
    """
    seen: set[int] = set()
    e = outcome if isinstance(outcome, BaseException) else None
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return outcome
