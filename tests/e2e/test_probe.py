"""The production canary probe against a real farm (registry, router, two replicas): `lorafarm probe
setup` makes a probe tenant with its own canaries through the registry, `lorafarm probe run` finds
every marker right; then a test-only fault, the probe tenant's alias swapped to another canary in
the registry, raises lorafarm_probe_wrong_marker_total for that alias (and the run fails)."""

from __future__ import annotations

import asyncio
import json

from lorafarm.cli import main
from tests.conftest import CANARY_DIR
from tests.e2e.conftest import farm_json
from tests.lorafarm.test_probe import sample


def test_probe_setup_run_and_a_swapped_alias_raises_the_metric(farm, tmp_path, capsys):
    info = farm_json(farm)
    (tmp_path / "farm.json").write_text(json.dumps(info))
    cfg_file = tmp_path / "probe.json"
    assert main(["probe", "setup", "--farm", str(tmp_path / "farm.json"), "--canaries", str(CANARY_DIR),
                 "--count", "2", "--tenant", "probe", "--out", str(cfg_file)]) == 0
    cfg = json.loads(cfg_file.read_text())
    assert cfg["targets"] == {"probe/c0000:prod": "<<c0000>>", "probe/c0001:prod": "<<c0001>>"}
    assert cfg_file.stat().st_mode & 0o077 == 0
    capsys.readouterr()

    ok_file = tmp_path / "ok.prom"
    assert main(["probe", "run", "--config", str(cfg_file), "--requests", "6", "--rate", "10",
                 "--metrics-file", str(ok_file)]) == 0
    text = ok_file.read_text()
    assert sample(text, "lorafarm_probe_requests_total", model="probe/c0000:prod", result="ok") == 3
    assert sample(text, "lorafarm_probe_wrong_marker_total", model="probe/c0000:prod") == 0

    # the fault: probe/c0000:prod now points at c0001's adapter (a deploy gone wrong)
    from lorafarm.registry_client import RegistryClient

    async def swap():
        async with RegistryClient(info["registry_url"], info["admin_token"]) as reg:
            target = (await reg.get_alias("probe/c0001:prod"))["adapter_id"]
            await reg.set_alias("probe/c0000:prod", target)

    asyncio.run(swap())
    bad_file = tmp_path / "bad.prom"
    assert main(["probe", "run", "--config", str(cfg_file), "--requests", "6", "--rate", "10",
                 "--metrics-file", str(bad_file)]) == 1
    text = bad_file.read_text()
    assert sample(text, "lorafarm_probe_wrong_marker_total", model="probe/c0000:prod") == 3
    assert sample(text, "lorafarm_probe_requests_total", model="probe/c0000:prod", result="wrong_marker") == 3
    assert sample(text, "lorafarm_probe_requests_total", model="probe/c0001:prod", result="ok") == 3
    assert "answered '<<c0001>>', expected '<<c0000>>'" in capsys.readouterr().err


def test_probe_expect_override_on_the_demo_tenant(farm, tmp_path):
    """The other test-only fault: the probe told that an adapter has another's marker."""
    (tmp_path / "farm.json").write_text(json.dumps(farm_json(farm)))
    alias = sorted(farm["tenants"][0]["aliases"])[0]
    out = tmp_path / "m.prom"
    assert main(["probe", "run", "--farm", str(tmp_path / "farm.json"), "--models", alias, "--requests", "2",
                 "--rate", "10", "--expect", f"{alias}=<<c9999>>", "--metrics-file", str(out)]) == 1
    assert sample(out.read_text(), "lorafarm_probe_wrong_marker_total", model=alias) == 2
