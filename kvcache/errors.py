"""Exception types raised by the KV cache bookkeeping, sizing and resolution.

Each names what went wrong and, where a user can act, which setting to change.
"""

from __future__ import annotations


class KVCacheError(Exception):
    """Base class of every error raised by `kvcache`."""


class IntegrityError(KVCacheError):
    """The block pool, a manager or the Mamba pool broke an invariant.

    Raised by `check_integrity()`; the message lists every violation found, so a
    failing property test shows the whole picture rather than the first symptom.
    """

    def __init__(self, where: str, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(f"{where} integrity check failed: " + "; ".join(problems))


class RequestStateError(KVCacheError):
    """A manager call does not fit the request's current state, e.g. a second
    `allocate_for_transfer` for a request that already holds blocks."""


class CacheSizingError(KVCacheError, ValueError):
    """The KV cache cannot hold one max-length sequence within the budget."""


class ResolutionError(KVCacheError, ValueError):
    """An `auto`-resolvable setting holds a value no rule accepts."""


class LayoutConflictError(ResolutionError):
    """Context and generation instances were forced onto different cache layouts
    while the transceiver (NIXL) needs one layout for the whole cluster."""
