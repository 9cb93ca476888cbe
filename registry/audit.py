"""The audit trail: every change to a tenant, API key, adapter, alias, foreign worker or latency-critical
model writes one `audit_log` row inside the same transaction as the change (so a rolled-back change
leaves no row), and one JSON line on the `lorafarm.audit` logger once it committed.

Who: the admin token is shared, so callers name themselves in the `x-lorafarm-actor` header (the
CLI sends $LORAFARM_ACTOR, else user@host); the client address is kept beside it.
"""

from __future__ import annotations

import json
import logging

from registry.tables import AuditEntry, utcnow

ACTOR_HEADER = "x-lorafarm-actor"
log = logging.getLogger("lorafarm.audit")


def who(request) -> tuple[str, str | None]:
    """(actor, client address) of a request."""
    actor = (request.headers.get(ACTOR_HEADER) or "").strip()[:255] or "admin"
    client = request.client.host if request.client else None
    return actor, client


def record(session, request, action: str, target_kind: str, target: str, **detail) -> AuditEntry:
    """Add the audit row of a change to the open write transaction `session`; log it once it commits."""
    actor, client = who(request)
    return record_as(session, actor, client, action, target_kind, target, **detail)


def record_as(session, actor: str, client: str | None, action: str, target_kind: str, target: str,
              **detail) -> AuditEntry:
    """`record` for a change the registry makes itself (a rollout step, promotion or rollback):
    `actor` names it (e.g. `rollout 12 (started by alice@host)`)."""
    actor = actor[:255]
    row = AuditEntry(at=utcnow(), actor=actor, client=client, action=action, target_kind=target_kind,
                     target=target, detail={k: v for k, v in detail.items() if v is not None})
    session.add(row)
    line = json.dumps({"event": "audit", "at": row.at.isoformat(), "actor": actor, "client": client, "action": action,
                       "target_kind": target_kind, "target": target, **row.detail}, default=str, sort_keys=True)
    session.info.setdefault("audit_lines", []).append(line)
    return row


def flush_log(session) -> None:
    """Called by the database after a commit: emit the audit lines of that transaction."""
    for line in session.info.pop("audit_lines", []):
        log.info(line)
