"""API key -> tenant, checked against the registry and cached with a TTL.

Keys are cached by their SHA-256, never in clear. A key the registry rejects is cached as
invalid for a shorter TTL (so a brute-force loop does not hammer the registry). Concurrent
requests with the same uncached key share one registry call.

Revocation (registry reachable): a revoke or rotate bumps the routing-table version; the table lists
the keys revoked in the last hour, this router forgets them (`revoke_key_ids`) before it reports the
version as applied, and the registry's revoke/rotate call returns only once every router has
reported it (as for alias deploys): the next request with the old key is checked again and refused.
A registry answer for a key the latest table lists as revoked (a verification that raced the
revocation) is never cached as valid.

Registry outage, one rule: a key this router has verified (and not seen revoked) keeps serving,
from the cache, while the router has heard from the registry within the last `stale_grace` seconds
(default 300; every successful registry answer counts: the routing long poll hears from it at least
every 20 s, so any outage shorter than 280 s goes unnoticed by verified keys). While the registry is
known to be down (a registry call failed, nothing answered since) a cached key is served without a
registry call on the request path (no request waits on a dead registry); the routing poll, every
second while the registry is down, notices its return, and keys are checked again. A key this router has not
verified gets 503 `auth_unavailable` from the start of the outage (never a 401 it did not earn), and
every key does once the router has heard nothing for `stale_grace` seconds. A key revoked while a
router cannot hear of it therefore works on that router at most `stale_grace` seconds after it last
heard from the registry."""

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
    weight: float | None = None  # fair-scheduling weight (sent to replicas as x-lorafarm-tenant-weight); None: 1

    @classmethod
    def from_verify(cls, body: dict) -> Tenant:
        def rate(v):
            return float(v) if v not in (None, "") else None

        return cls(
            tenant_id=str(body["tenant_id"]),
            key_id=body.get("key_id"),
            requests_per_s=rate(body.get("requests_per_s")),
            tokens_per_s=rate(body.get("tokens_per_s")),
            weight=rate(body.get("weight")),
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
        stale_grace: float = 300.0,
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
        self._heard_at = float("-inf")  # the registry's last answer (any call: verify, routing poll)
        self._down = False  # the last registry call failed and nothing answered since
        self._revoked: frozenset[str] = frozenset()  # key ids the latest routing table lists as revoked

    @staticmethod
    def _digest(api_key: str) -> str:
        return hashlib.sha256(api_key.encode()).hexdigest()

    # -- what the router hears from the registry ------------------------------------------------

    def registry_answered(self) -> None:
        """The registry answered a call (a routing poll, 200 or 304, or a key check)."""
        self._heard_at = self.clock()
        self._down = False

    def registry_failed(self) -> None:
        """A registry call failed (unreachable, timed out, 5xx)."""
        self._down = True

    @property
    def registry_down(self) -> bool:
        return self._down

    def serving_stale_until(self) -> float:
        """Clock time until which verified keys keep serving while the registry stays unreachable."""
        return self._heard_at + self.stale_grace

    def _within_grace(self, now: float) -> bool:
        return now - self._heard_at <= self.stale_grace

    # -- lookups ------------------------------------------------------------------------------------

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
        if entry is not None and entry.tenant is not None and self._down:
            # the registry is known to be down: a verified key is served from the cache within the
            # grace, without a request waiting on a registry call that is bound to fail
            if self._within_grace(now):
                return entry.tenant
            raise AuthUnavailable(f"cannot verify the API key: the registry has been unreachable for "
                                  f"{now - self._heard_at:.0f} s (more than {self.stale_grace:.0f} s)")
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
                self.registry_failed()
                return self._unreachable(e, old)
        self.registry_answered()
        now = self.clock()
        tenant = Tenant.from_verify(body) if body else None
        if tenant is not None and tenant.key_id is not None and tenant.key_id in self._revoked:
            tenant = None  # an answer that raced the key's revocation: the table says revoked
        self._entries.pop(digest, None)  # re-insert: the oldest verified go first when the cache is full
        if len(self._entries) >= self.max_entries:
            self._evict(now)
        self._entries[digest] = _Entry(tenant, now + (self.ttl if tenant else self.negative_ttl), now)
        return tenant

    def _unreachable(self, e: Exception, old: _Entry | None) -> Tenant:
        now = self.clock()
        if old is not None and old.tenant is not None and self._within_grace(now):
            log.warning("registry unreachable for auth (%s); using the cached tenant %s", e, old.tenant.tenant_id)
            return old.tenant
        log.warning("cannot verify an API key: %s", e)
        raise AuthUnavailable(f"cannot verify the API key: registry unreachable ({type(e).__name__})") from e

    def revoke_key_ids(self, key_ids) -> int:
        """The latest routing table's revoked keys: forget every cached tenant verified with one of
        them (their next request is checked again), and never cache one as valid again. Returns how
        many entries were dropped."""
        ids = frozenset(key_ids)
        self._revoked = ids
        if not ids:
            return 0
        gone = [d for d, e in self._entries.items() if e.tenant is not None and e.tenant.key_id in ids]
        for d in gone:
            del self._entries[d]
        return len(gone)

    def _evict(self, now: float) -> None:
        for d in [d for d, e in self._entries.items() if e.expires <= now and e.tenant is None]:
            del self._entries[d]
        while len(self._entries) >= self.max_entries:
            self._entries.pop(next(iter(self._entries)))

    def invalidate(self, api_key: str) -> None:
        self._entries.pop(self._digest(api_key), None)
