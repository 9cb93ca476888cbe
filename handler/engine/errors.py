"""The errors the engine raises on purpose: one base (`EngineError`), one class per reason a caller
can act on (a full rank pool, an adapter still in use or not mounted, weights or a request that can
never be served)."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class NoFreeSlotError(EngineError):
    """The rank pool an adapter needs has no free slot (unmount an idle adapter first)."""


class AdapterInUseError(EngineError):
    """The adapter still has waiting or running requests."""


class UnknownAdapterError(EngineError, LookupError):
    """The adapter is not mounted on this engine."""


class InvalidAdapterError(EngineError, ValueError):
    """Adapter weights that do not fit the base model, the declared rank, or any rank pool."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine can never serve as given (bad ids, params, duplicate request id)."""


class RequestTooLongError(InvalidRequestError):
    """prompt + max_tokens exceeds the engine's max_context."""
