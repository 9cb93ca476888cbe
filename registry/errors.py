"""API errors as OpenAI-style error objects: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import logging

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

log = logging.getLogger("lorafarm.registry")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


class ApiError(HTTPException):
    """A clear 4xx: raised by handlers, rendered as an OpenAI error object."""

    def __init__(self, status_code: int, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(status_code=status_code, detail=message)
        self.message = message
        self.code = code
        self.param = param


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def _validation_message(exc: ValidationException) -> tuple[str, str | None]:
    extra = exc.extra
    if isinstance(extra, list) and extra:
        first = extra[0]
        if isinstance(first, dict):
            key = first.get("key")
            msg = first.get("message") or exc.detail
            return (f"{key}: {msg}" if key else str(msg)), (str(key) if key else None)
    return str(exc.detail), None


def http_exception_handler(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    if isinstance(exc, ApiError):
        body = error_body(status, exc.message, exc.code, exc.param)
    elif isinstance(exc, ValidationException):
        message, param = _validation_message(exc)
        body = error_body(status, f"invalid request: {message}", "validation_error", param)
    else:
        body = error_body(status, str(exc.detail), None)
    headers = dict(exc.headers or {})
    if status == 401:
        headers.setdefault("WWW-Authenticate", "Bearer")
    return Response(body, status_code=status, headers=headers, media_type="application/json")


def internal_error_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return Response(
        error_body(500, f"internal error: {exc.__class__.__name__}", "internal_error"),
        status_code=500,
        media_type="application/json",
    )


def undecodable_handler(request: Request, exc: UnicodeDecodeError) -> Response:
    # Litestar decodes multipart text fields (and a file part sent without a filename) as UTF-8.
    return Response(
        error_body(400, f"invalid request: a text field is not valid UTF-8 ({exc.reason})", "validation_error"),
        status_code=400,
        media_type="application/json",
    )


def unavailable_handler(request: Request, exc: Exception) -> Response:
    """The object store or the database failed: 503, so callers retry instead of giving up."""
    what = "object store" if exc.__class__.__module__.startswith("archives") else "database"
    log.error("%s unavailable on %s %s: %s", what, request.method, request.url.path, exc)
    return Response(
        error_body(503, f"the registry's {what} is unavailable: {exc.__class__.__name__}: {str(exc)[:300]}",
                   f"{what.replace(' ', '_')}_unavailable"),
        status_code=503,
        headers={"Retry-After": "1"},
        media_type="application/json",
    )


def conflict_handler(request: Request, exc: Exception) -> Response:
    log.warning("integrity error on %s %s: %s", request.method, request.url.path, exc)
    return Response(error_body(409, "conflicting concurrent change; retry", "conflict"), status_code=409,
                    media_type="application/json")


def _handlers() -> dict:
    from sqlalchemy.exc import DBAPIError, IntegrityError

    from archives.errors import StoreError

    return {
        HTTPException: http_exception_handler,
        UnicodeDecodeError: undecodable_handler,
        StoreError: unavailable_handler,
        IntegrityError: conflict_handler,
        DBAPIError: unavailable_handler,
        Exception: internal_error_handler,
    }


EXCEPTION_HANDLERS = _handlers()
