"""API key -> tenant, checked against the registry and cached with a TTL.

Keys are cached by their SHA-256, never in clear. A key the registry rejects is cached as
invalid for a shorter TTL (so a brute-force loop does not hammer the registry). Concurrent
requests with the same uncached key share one registry call. If the registry cannot be reached,
a cached tenant keeps working for at most `stale_grace` seconds (default 30) past its entry's TTL
(default 30): a key the registry revoked while this router could not hear of it works at most
ttl + stale_grace = 60 s after the router last verified it. Past that the request fails with
AuthUnavailable (503), never with a 401 the key did not deserve. (While the registry is reachable a
revocation reaches the router at its next routing poll: `revoke_key_ids`.)"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger("lorafarm.router.auth")


@dataclass(frozen=True)
class Tenant:
    tenant_id: str
    key_id: str | None = None
    requests_per_s: float | None = None
    tokens_per_s: float | None = None

    @classmethod
    def from_verify(cls, body: dict) -> Tenant:
        def rate(v):
            return float(v) if v not in (None, "") else None

        return cls(
            tenant_id=str(body["tenant_id"]),
            key_id=body.get("key_id"),
            requests_per_s=rate(body.get("requests_per_s")),
            tokens_per_s=rate(body.get("tokens_per_s")),
        )


MAX_KEY_CHARS = 512  # the registry's limit: a longer key cannot be valid, so it is refused here


class InvalidApiKey(Exception):
    """The registry says this key is unknown or revoked (401)."""


class AuthUnavailable(Exception):
    """The registry could not be asked and nothing usable is cached (503)."""


# verify(api_key) -> dict (the registry's answer) or None for an invalid key; raises on transport errors
Verifier = Callable[[str], Awaitable[dict | None]]


@dataclass
class _Entry:
    tenant: Tenant | None
    expires: float
    verified_at: float


class AuthCache:
    def __init__(
        self,
        verify: Verifier,
        ttl: float = 30.0,
        negative_ttl: float = 5.0,
        stale_grace: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = 100_000,
    ):
        self.verify = verify
        self.ttl = ttl
        self.negative_ttl = negative_ttl
        self.stale_grace = stale_grace
        self.clock = clock
        self.max_entries = max_entries
        self._entries: dict[str, _Entry] = {}
        self._pending: dict[str, asyncio.Future] = {}
        self.registry_calls = 0

    @staticmethod
    def _digest(api_key: str) -> str:
        return hashlib.sha256(api_key.encode()).hexdigest()

    async def tenant_for(self, api_key: str) -> Tenant:
        if not api_key or len(api_key) > MAX_KEY_CHARS or not api_key.isascii() or not api_key.isprintable():
            raise InvalidApiKey("missing or malformed API key")  # no registry call for what cannot be a key
        digest = self._digest(api_key)
        now = self.clock()
        entry = self._entries.get(digest)
        if entry is not None and entry.expires > now:
            if entry.tenant is None:
                raise InvalidApiKey("invalid API key")
            return entry.tenant
        pending = self._pending.get(digest)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._pending[digest] = pending
            try:
                result = await self._refresh(api_key, digest, entry)
            except asyncio.CancelledError:
                pending.cancel()
                raise
            except BaseException as e:
                pending.set_exception(e)
                pending.exception()  # mark retrieved: waiters may be none
                raise
            else:
                pending.set_result(result)
            finally:
                self._pending.pop(digest, None)
        else:
            result = await asyncio.shield(pending)
        if result is None:
            raise InvalidApiKey("invalid API key")
        return result

    async def _refresh(self, api_key: str, digest: str, old: _Entry | None) -> Tenant | None:
        self.registry_calls += 1
        try:
            body = await self.verify(api_key)
        except Exception as e:
            if 400 <= getattr(e, "status", 0) < 500 and getattr(e, "status", 0) not in (401, 403, 408, 429):
                body = None  # the registry refused the key itself (malformed): invalid, negatively cached
            else:
                return self._unreachable(e, old)
        now = self.clock()
        tenant = Tenant.from_verify(body) if body else None
        if len(self._entries) >= self.max_entries:
            self._evict(now)
        self._entries[digest] = _Entry(tenant, now + (self.ttl if tenant else self.negative_ttl), now)
        return tenant

    def _unreachable(self, e: Exception, old: _Entry | None) -> Tenant:
        now = self.clock()
        if old is not None and old.tenant is not None and now - old.expires <= self.stale_grace:
            log.warning("registry unreachable for auth (%s); using the cached tenant %s", e, old.tenant.tenant_id)
            return old.tenant
        log.warning("cannot verify an API key: %s", e)
        raise AuthUnavailable(f"cannot verify the API key: registry unreachable ({type(e).__name__})") from e

    def revoke_key_ids(self, key_ids) -> int:
        """Forget every cached tenant verified with one of `key_ids` (the registry revoked them):
        their next request is checked again. Returns how many entries were dropped."""
        ids = set(key_ids)
        if not ids:
            return 0
        gone = [d for d, e in self._entries.items() if e.tenant is not None and e.tenant.key_id in ids]
        for d in gone:
            del self._entries[d]
        return len(gone)

    def _evict(self, now: float) -> None:
        for d in [d for d, e in self._entries.items() if e.expires <= now]:
            del self._entries[d]
        while len(self._entries) >= self.max_entries:
            self._entries.pop(next(iter(self._entries)))

    def invalidate(self, api_key: str) -> None:
        self._entries.pop(self._digest(api_key), None)
