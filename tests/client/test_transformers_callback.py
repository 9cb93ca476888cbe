"""`LorafarmCallback` under a real `transformers.Trainer` (a few steps on the dev model) against a
live registry: the adapter uploaded with its base hash and tags, checkpoints on save, the alias set
on a first upload and a rollout started on the next."""

from __future__ import annotations

import pytest

from lorafarm.client import LorafarmClient, LorafarmError
from lorafarm.integrations.transformers import LorafarmCallback, RolloutPolicy, trainer_tags
from tests.client.trainer_run import train
from tests.registry.helpers import ADMIN_TOKEN, live_server, unique


@pytest.fixture(scope="module")
def database_url(tmp_path_factory) -> str:
    """SQLite only: the callback is the client's user, not the database's (the client's own tests and
    the registry's run on both)."""
    return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('callback-db') / 'registry.db'}"


@pytest.fixture(scope="module")
def url(make_settings):
    with live_server(make_settings()) as u:
        yield u


def test_trainer_uploads_then_rolls_out(url, dev_model, base_hash, tmp_path):
    tenant = unique("tr")
    alias = f"{tenant}/sft:prod"
    with LorafarmClient(url, ADMIN_TOKEN) as reg:
        reg.create_tenant(tenant)
        # first run: checkpoints uploaded on save, the final version sets the (new) alias
        cb = LorafarmCallback(tenant, alias=alias, registry_url=url, admin_token=ADMIN_TOKEN,
                              base_model_path=dev_model, upload_on_save=True, tags={"dataset": "toy-v1"},
                              rollout=RolloutPolicy(steps=(10, 100), interval="1m"))
        train(dev_model, tmp_path / "run1", [cb], steps=4, save_steps=2, run_name="sft-run-1")
        assert len(cb.uploads) == 3  # checkpoint-2, checkpoint-4, the final adapter (same as checkpoint-4)
        final = cb.uploads[-1]
        assert final["adapter_id"] == cb.uploads[1]["adapter_id"]  # same weights: same id, not registered twice
        tags = reg.get_adapter(cb.uploads[0]["adapter_id"])["tags"]
        assert tags["global_step"] == 2 and tags["run_name"] == "sft-run-1" and tags["dataset"] == "toy-v1"
        a = reg.get_adapter(final["adapter_id"])
        assert a["base_model_hash"] == base_hash and a["tenant_id"] == tenant
        assert reg.get_alias(alias)["adapter_id"] == final["adapter_id"]  # nothing to compare with: set
        assert cb.rollout is None

        # second run: a new version, rolled out progressively on the alias
        cb2 = LorafarmCallback(tenant, alias=alias, registry_url=url, admin_token=ADMIN_TOKEN,
                               base_model_path=dev_model, rollout=RolloutPolicy(steps=(10, 50, 100), interval="1m"))
        trainer = train(dev_model, tmp_path / "run2", [cb2], steps=3, run_name="sft-run-2", seed=1)
        new = cb2.uploads[-1]
        assert new["adapter_id"] != final["adapter_id"]
        tags = reg.get_adapter(new["adapter_id"])["tags"]
        assert tags["global_step"] == 3 and "eval_loss" in tags and "loss" in tags
        assert tags["eval_loss"] == pytest.approx(trainer.state.log_history[-2]["eval_loss"], rel=1e-5)
        assert cb2.rollout["state"] == "running" and cb2.rollout["percent"] == 10
        split = reg.get_alias(alias)["split"]
        assert split == [{"adapter_id": final["adapter_id"], "weight": 90.0},
                         {"adapter_id": new["adapter_id"], "weight": 10.0}]
        reg.abort_rollout(cb2.rollout["rollout_id"])


def test_callback_needs_a_known_base_and_a_peft_model(url, tmp_path):
    cb = LorafarmCallback("nobody", registry_url=url, admin_token=ADMIN_TOKEN)
    with pytest.raises(LorafarmError, match="base the adapter was trained on is unknown"):
        cb.base_model_hash(object())
    with pytest.raises(ValueError):
        LorafarmCallback("t", rollout=RolloutPolicy())

    class State:
        is_world_process_zero = True
        global_step = 7
        epoch = 1.5
        log_history = [{"loss": 2.0, "step": 1}, {"eval_loss": 1.25, "eval_acc": float("nan"), "step": 7}]

    class Args:
        run_name = "r"

    with pytest.raises(LorafarmError, match="needs a PEFT model"):
        cb.on_train_end(Args(), State(), None, model=object())
    tags = trainer_tags(Args(), State(), {"extra": [1, 2], "lr": 0.1})
    assert tags == {"run_name": "r", "global_step": 7, "epoch": 1.5, "loss": 2.0, "eval_loss": 1.25, "lr": 0.1}
