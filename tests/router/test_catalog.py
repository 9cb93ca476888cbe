"""The tenant's catalog through the router: `/v1/models` lists each adapter the tenant may call once
(under its alias, else its id; `parent` = the base model), `GET /v1/models/{id}` answers an alias, an
adapter id or a base model, and
the requested name travels to the replica so the response's `model` can echo it."""

from __future__ import annotations

import openai
import pytest

from tests.router.conftest import router_farm

pytestmark = pytest.mark.timeout(60)


async def test_models_list_get_and_echo():
    async with router_farm() as farm:
        key = farm.registry.add_tenant("acme")
        other_key = farm.registry.add_tenant("other")
        v1 = farm.registry.add_adapter("acme", "v1", "dev-a", alias="acme/support:prod")
        v2 = farm.registry.add_adapter("acme", "v2", "dev-a")  # no alias: callable by id, listed too
        foreign = farm.registry.add_adapter("other", "x", "dev-a", alias="other/x:prod")
        await farm.sync()
        client = farm.client(key)

        listed = {m.id: m for m in (await client.models.list()).data}
        assert {"dev-a", "acme/support:prod", v2} <= set(listed)
        assert v1 not in listed  # listed once, under its alias
        assert foreign not in listed and "other/x:prod" not in listed
        for name, root in (("acme/support:prod", v1), (v2, v2)):
            entry = listed[name].model_dump()
            assert entry["root"] == entry["adapter_id"] == root
            assert entry["parent"] == "dev-a" and entry["owned_by"] == "acme"
        assert (await client.models.retrieve(v1)).model_dump()["root"] == v1  # its id still answers

        # One model by name: alias (its slash and colon in the path), id, base; others' are 404.
        got = await client.models.retrieve("acme/support:prod")
        assert got.id == "acme/support:prod" and got.model_dump()["root"] == v1
        assert (await client.models.retrieve(v2)).model_dump()["parent"] == "dev-a"
        assert (await client.models.retrieve("dev-a")).id == "dev-a"
        for missing in ("other/x:prod", foreign, "acme/nope:prod"):
            with pytest.raises(openai.NotFoundError) as exc:
                await client.models.retrieve(missing)
            assert exc.value.code == "model_not_found"
        assert (await farm.client(other_key).models.retrieve("other/x:prod")).model_dump()["root"] == foreign
        with pytest.raises(openai.AuthenticationError):
            await farm.client("lf-wrong").models.retrieve(v1)

        # The replica gets the resolved id as `model` and the requested name beside it.
        raw = await client.chat.completions.with_raw_response.create(
            model="acme/support:prod", messages=[{"role": "user", "content": "hi"}])
        assert raw.headers["x-adapter-id"] == v1
        sent = [r for rep in farm.replicas.values() for r in rep.requests]
        assert sent[-1]["model"] == v1 and sent[-1]["echo"] == "acme/support:prod"
