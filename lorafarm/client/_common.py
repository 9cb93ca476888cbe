"""What the async and the sync client share besides the calls: composing an alias's versions."""

from __future__ import annotations

from lorafarm.client.types import Adapter, Alias, AliasVersion

TERMINAL_ROLLOUT_STATES = ("promoted", "rolled_back", "aborted")


def alias_versions(alias: Alias, adapters: list[Adapter]) -> list[AliasVersion]:
    """The tenant's adapters with their role in `alias`, newest version first: `stable` (the alias's
    adapter_id), `canary` (in its split, not stable), `previous` (a rollback's target), `other`."""
    split = alias.get("split") or []
    weights = {t["adapter_id"]: float(t["weight"]) for t in split} or {alias["adapter_id"]: 100.0}
    out: list[AliasVersion] = []
    for a in adapters:
        aid = a["adapter_id"]
        if aid == alias["adapter_id"]:
            role = "stable"
        elif aid in weights:
            role = "canary"
        elif aid == alias.get("previous_adapter_id"):
            role = "previous"
        else:
            role = "other"
        out.append({"adapter": a, "role": role, "weight": weights.get(aid, 0.0)})
    out.sort(key=lambda v: (-int(v["adapter"]["version"]), v["adapter"]["adapter_id"]))
    return out
