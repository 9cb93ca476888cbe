"""Issue 38 end to end, real processes (registry, router, two replicas started as `lorafarm up`
starts them): a Trainer run on the dev model with `LorafarmCallback` uploads a new version and
starts a rollout on a live alias; the router serves it to ~10% of the end users (sticky per `user`),
then the registry promotes it and it serves everyone; a version made to fail (the replicas' test-only
fault LORAFARM_TEST_FAILING_ADAPTER) is rolled back by the registry within its step, with the audit
row and the log line; no request of a split alias is ever answered by a version outside the split.

The 10% share is judged over distinct users, each of whom the router assigns independently with
probability 0.10 (weighted rendezvous hashing of the user name): the share of U users is within
0.10 +- 3.29 x sqrt(0.10 x 0.90 / U), the 99.9% binomial interval (U >= 150: at most +-0.081).
The figures are printed (pytest -s shows them) for the closing note of the issue."""

from __future__ import annotations

import asyncio
import math
import os
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from lorafarm.client import LorafarmClient
from lorafarm.integrations.transformers import LorafarmCallback, RolloutPolicy
from lorafarm.openai_schemas import TEST_FAILING_ADAPTER_ENV
from tests.client.trainer_run import train
from tests.e2e.conftest import running, seeded_farm

pytestmark = pytest.mark.slow
Z_999 = 3.29  # two-sided 99.9% normal quantile
STEP_S = 6.0  # the healthy rollout's 10% step
FAILING_STEP_S = 60.0  # the failing rollout's step: the rollback must come long before its end
BOUNDS = {"min_requests": 20, "min_ttft_samples": 20, "max_error_rate_increase": 0.05,
          "max_ttft_p95_ratio": 4.0, "ttft_slack_s": 0.5}  # TTFT judged loosely: a 2-core box under load
# the healthy step passes only after 30 requests on the new version (~300 in all at 10%): about 225
# distinct users in the share whatever the box's speed (a slow box just makes the step longer)
HEALTHY_BOUNDS = {**BOUNDS, "min_requests": 30}


def _adapter_id(folder: Path, base: Path, tenant: str) -> str:
    import json

    from archives.ids import adapter_id_for
    from archives.peft_dir import read_peft_dir

    info = read_peft_dir(folder, json.loads((base / "config.json").read_text()))
    return adapter_id_for(tenant, info.content_checksum)


@contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@pytest.fixture(scope="module")
def rollout_farm(tmp_path_factory, dev_model):
    """Two replicas that fail every request for canary c0002's id (uploaded later by the test), a
    registry evaluating rollouts every 0.2 s, a router pushing its per-version windows every 0.5 s."""
    from tests.conftest import CANARY_DIR, make_canaries

    make_canaries(dev_model, 3)
    failing = _adapter_id(CANARY_DIR / "c0002", dev_model, "demo")
    farm = seeded_farm(tmp_path_factory.mktemp("rollout-farm"), dev_model, CANARY_DIR, 2, 2)
    farm.registry_args = ["--rollout-tick", "0.2"]
    farm.router_args = ["--stats-window", "0.5"]
    with _env(TEST_FAILING_ADAPTER_ENV, failing), running(farm) as info:
        info["failing_id"] = failing
        info["failing_dir"] = CANARY_DIR / "c0002"
        yield info


class Traffic:
    """Streamed chat requests through the router, one `user` each, `concurrency` at a time; every
    answer kept as (sent, done, user, status, x-adapter-id)."""

    def __init__(self, farm: dict, alias: str, concurrency: int = 16):
        self.url, self.alias, self.concurrency = farm["router_url"], alias, concurrency
        self.key = farm["tenants"][0]["api_key"]
        self.answers: list[tuple[float, float, str, int, str]] = []

    async def one(self, http: httpx.AsyncClient, user: str) -> None:
        body = {"model": self.alias, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "stream": True, "user": user}
        sent = time.time()
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            await r.aread()
            self.answers.append((sent, time.time(), user, r.status_code, r.headers.get("x-adapter-id", "")))

    async def run(self, users, until) -> None:
        """Send for every user of the iterable until `until()` (checked between requests) is true."""
        it = iter(users)
        async with httpx.AsyncClient(base_url=self.url, timeout=60,
                                     headers={"Authorization": f"Bearer {self.key}"}) as http:
            async def worker():
                for user in it:
                    if await until():
                        return
                    await self.one(http, user)

            await asyncio.gather(*[worker() for _ in range(self.concurrency)])


def _at(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def _rollout_watch(reg: LorafarmClient, farm: dict, rollout_id: int, extra_s: float):
    """until(): true `extra_s` seconds after the router applied the end of the rollout (the rollout
    polled every 0.2 s; then the registry's routing-table version, and the router's /health until it
    serves that version: `state["applied_at"]`, wall clock)."""
    state = {"checked": 0.0, "ended": None, "rollout": None, "version": None, "applied_at": None}

    async def until() -> bool:
        now = time.monotonic()
        if state["applied_at"] is not None:
            return time.time() - state["applied_at"] >= extra_s
        if now - state["checked"] < 0.1:
            return False
        state["checked"] = now
        async with httpx.AsyncClient(timeout=10) as http:
            if state["ended"] is None:
                r = await asyncio.to_thread(reg.get_rollout, rollout_id)
                state["rollout"] = r
                if r["state"] != "running":
                    state["ended"] = now
                    state["version"] = (await http.get(farm["registry_url"] + "/health")).json()["version"]
            if state["version"] is not None:
                applied = (await http.get(farm["router_url"] + "/health")).json()["routing_table_version"]
                if applied is not None and applied >= state["version"]:
                    state["applied_at"] = time.time()
        return False

    return until, state


async def test_train_roll_out_then_roll_back_a_failing_version(rollout_farm, dev_model, tmp_path):
    farm = rollout_farm
    tenant = farm["tenants"][0]
    alias_a, alias_b = sorted(tenant["aliases"])  # demo/c0000:prod, demo/c0001:prod
    old_a, old_b = tenant["aliases"][alias_a], tenant["aliases"][alias_b]
    reg = LorafarmClient(farm["registry_url"], farm["admin_token"])
    figures: dict = {}

    # -- 1. a Trainer run with the callback: uploaded, rollout started at 10% ---------------------
    cb = LorafarmCallback("demo", alias=alias_a, registry_url=farm["registry_url"], admin_token=farm["admin_token"],
                          base_model_path=dev_model, tags={"dataset": "toy"},
                          rollout=RolloutPolicy(steps=(10, 100), interval=STEP_S, bounds=HEALTHY_BOUNDS))
    t0 = time.monotonic()
    train(dev_model, tmp_path / "run", [cb], steps=3, run_name="e2e-sft")
    figures["train_and_upload_s"] = round(time.monotonic() - t0, 1)
    new = cb.uploads[-1]["adapter_id"]
    assert reg.get_adapter(new)["tags"]["run_name"] == "e2e-sft"
    ro = cb.rollout
    assert ro["state"] == "running" and ro["percent"] == 10 and ro["old_adapter_id"] == old_a

    # -- 2. traffic through the step and past the promotion --------------------------------------
    # distinct users (u...) for the share, and 40 returning users (s...) for stickiness
    def users():
        i = 0
        while True:
            yield f"s{(i // 4) % 40}" if i % 4 == 3 else f"u{i}"
            i += 1

    until, watch = _rollout_watch(reg, farm, ro["rollout_id"], extra_s=2.0)
    traffic = Traffic(farm, alias_a)
    await asyncio.wait_for(traffic.run(users(), until), timeout=120)
    done = watch["rollout"]
    assert done["state"] == "promoted", done
    promoted_at = _at(done["finished_at"])
    answers = traffic.answers
    assert all(status == 200 for _, _, _, status, _ in answers)
    assert {aid for *_, aid in answers} <= {old_a, new}  # never a version outside the split
    during = [a for a in answers if a[1] < promoted_at]  # answered before the promotion: the 10% split
    after = [a for a in answers if a[0] > watch["applied_at"]]  # sent once the router applied it: 100%
    first_of = {}
    for sent, _, user, _, aid in sorted(during):
        if user.startswith("u"):
            first_of.setdefault(user, aid)
    n_users = len(first_of)
    share = sum(aid == new for aid in first_of.values()) / n_users
    bound = Z_999 * math.sqrt(0.1 * 0.9 / n_users)
    seen: dict[str, set] = {}
    for _, _, user, _, aid in during:
        if user.startswith("s"):
            seen.setdefault(user, set()).add(aid)
    sticky = sum(len(v) == 1 for v in seen.values()) / len(seen)
    on_new_before = {u for u, v in seen.items() if v == {new}}
    figures.update(step_requests=len(during), step_users=n_users, share_new=round(share, 4),
                   bound=f"0.10 +- {bound:.4f}", sticky_users=f"{sum(len(v) == 1 for v in seen.values())}/{len(seen)}",
                   after_promotion=len(after), promotion_applied_by_router_s=round(watch["applied_at"] - promoted_at, 2),
                   step_reason=done["reason"])
    assert n_users >= 150, figures
    assert abs(share - 0.10) <= bound, figures
    assert sticky == 1.0, seen
    assert after and all(aid == new for *_, aid in after), figures
    assert all(aid == new for _, _, user, _, aid in after if user in on_new_before)
    # the router's per-version metrics, labelled with alias and version
    metrics = httpx.get(farm["router_url"] + "/metrics").text
    assert f'lorafarm_router_version_requests_total{{alias="{alias_a}",outcome="ok",version="{new}"}}' in metrics
    summary = httpx.get(farm["router_url"] + "/internal/versions",
                        headers={"Authorization": f"Bearer {farm['admin_token']}"}).json()
    rows = {r["version"]: r for r in summary["versions"] if r["alias"] == alias_a}
    assert rows[new]["errors"] == 0 and rows[new]["ttft_count"] > 0 and rows[new]["finish_reasons"]
    a = reg.get_alias(alias_a)
    assert a["adapter_id"] == new and a["previous_adapter_id"] == old_a and a["split"] is None

    # -- 3. a version whose requests fail: rolled back within its step ---------------------------
    failing = reg.upload_adapter(farm["failing_dir"], "demo", base_model_hash=cb.base_model_hash())["adapter_id"]
    assert failing == farm["failing_id"]
    ro = reg.start_rollout(alias_b, failing, steps=(10, 100), interval=FAILING_STEP_S, bounds=BOUNDS)
    until, watch = _rollout_watch(reg, farm, ro["rollout_id"], extra_s=1.5)
    traffic = Traffic(farm, alias_b)
    await asyncio.wait_for(traffic.run((f"f{i}" for i in range(10**6)), until), timeout=90)
    done = watch["rollout"]
    assert done["state"] == "rolled_back" and done["breached"] == "error_rate", done
    rolled_back_at = _at(done["finished_at"])
    in_step_s = rolled_back_at - _at(done["step_started_at"])
    assert in_step_s < FAILING_STEP_S  # within the step, not at its end
    answers = traffic.answers
    assert {aid for *_, aid in answers} <= {old_b, failing}
    failed = sorted(a[1] for a in answers if a[4] == failing)
    assert failed and all(a[3] == 500 for a in answers if a[4] == failing)
    assert all(a[3] == 200 for a in answers if a[4] == old_b)
    breach_at = failed[BOUNDS["min_requests"] - 1]  # the answer that made the bound's evidence complete
    late = [a for a in answers if a[0] > watch["applied_at"]]
    assert late and all(a[4] == old_b for a in late)  # after the rollback: the old version only
    row = reg.audit(alias_b, action="rollout.rollback")[0]
    assert row["detail"]["breached"] == "error_rate" and row["detail"]["rolled_back_adapter_id"] == failing
    log = (farm["_farm"].logs_dir / "registry.log").read_text()
    assert f"rollout {ro['rollout_id']} of {alias_b} ROLLED BACK (bound breached: error_rate)" in log
    a = reg.get_alias(alias_b)
    assert a["adapter_id"] == old_b and a["split"] is None
    figures.update(failing_requests=len(failed), breach_to_rollback_s=round(rolled_back_at - breach_at, 2),
                   first_failure_to_rollback_s=round(rolled_back_at - failed[0], 2),
                   rollback_after_step_start_s=round(in_step_s, 2),
                   rollback_applied_by_router_s=round(watch["applied_at"] - rolled_back_at, 2),
                   failing_reason=done["reason"])
    reg.close()
    print("\nrollout figures:", figures)
