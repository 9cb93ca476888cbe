"""Errors of the lorafarm client: every failed registry call raises a `LorafarmError` carrying the
registry's own message (its OpenAI-style error object), the HTTP status and the error code.

    try:
        client.set_alias("acme/support:prod", "ad-0123...")
    except NotFoundError as e:      # 404
        ...
    except LorafarmError as e:      # any other failure: e.status, e.code, e.message
        ...

`status` 0 means no HTTP answer at all (the registry is unreachable, or a local check failed before
any call). `RegistryError` is the historical name of `LorafarmError` (services catch it).
"""

from __future__ import annotations


class LorafarmError(Exception):
    """A failed registry call: `status` is the HTTP status (0: no answer), `message` the registry's
    reason, `code` its machine-readable error code (e.g. `alias_not_found`), `param` the field."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(f"registry answered {status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


RegistryError = LorafarmError  # the name services have always caught


class InvalidRequestError(LorafarmError):
    """400 or 422: the request was malformed or refused by a check (wrong tenant, unknown base...)."""


class AuthenticationError(LorafarmError):
    """401: missing or wrong admin token."""


class NotFoundError(LorafarmError):
    """404: no such tenant, adapter, alias or rollout."""


class ConflictError(LorafarmError):
    """409: conflicts with the current state (a rollout already running on the alias, an adapter in use)."""


class UnavailableError(LorafarmError):
    """No answer (status 0), or 5xx: the registry, its database or its object store is down; retry."""


def error_for(status: int, message: str, code: str | None = None, param: str | None = None) -> LorafarmError:
    """The exception class for an HTTP status."""
    if status in (400, 413, 422):
        cls: type[LorafarmError] = InvalidRequestError
    elif status == 401:
        cls = AuthenticationError
    elif status == 404:
        cls = NotFoundError
    elif status == 409:
        cls = ConflictError
    elif status == 0 or status >= 500:
        cls = UnavailableError
    else:
        cls = LorafarmError
    return cls(status, message, code, param)
