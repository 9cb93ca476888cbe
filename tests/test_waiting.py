"""The suite's wait helper: returns the condition's value; on timeout the failure says what was
awaited, how long, what the condition last gave, and the ends of the logs."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.waiting import wait_for, wait_until


def test_returns_the_value_once_the_condition_holds():
    calls = iter([0, None, "here"])
    assert wait_for(lambda: next(calls), 10, what="the third call", interval=0) == "here"


def test_a_refused_connection_is_not_yet_then_the_failure_says_everything(tmp_path):
    (tmp_path / "replica-r0.log").write_text("\n".join(f"line {i}" for i in range(100)) + "\nboom: the end\n")

    def refused():
        raise httpx.ConnectError("connection refused")

    with pytest.raises(pytest.fail.Exception) as exc:
        wait_for(refused, 0.2, what="r0 back in routing", interval=0.05, logs=tmp_path)
    msg = str(exc.value)
    assert "r0 back in routing" in msg and "not reached" in msg and "waited 0." in msg
    assert "ConnectError" in msg  # the last thing the condition gave
    assert "replica-r0.log" in msg and "boom: the end" in msg and "line 10\n" not in msg  # the tail only


def test_an_unnamed_condition_is_named_by_its_source():
    with pytest.raises(pytest.fail.Exception) as exc:
        wait_for(lambda: 1 + 1 == 3, 0, interval=0)
    assert "1 + 1 == 3" in str(exc.value)


def test_wait_until_on_an_event_loop():
    async def main():
        flag = asyncio.Event()
        asyncio.get_running_loop().call_later(0.01, flag.set)
        assert await wait_until(flag.is_set, 10, what="the flag")
        with pytest.raises(pytest.fail.Exception, match="never"):
            await wait_until(lambda: False, 0.05, what="never")

    asyncio.run(main())


def test_wait_until_awaits_an_async_or_threaded_condition():
    async def main():
        calls = []

        async def check():
            calls.append(1)
            return len(calls) >= 3 and "third"

        assert await wait_until(check, 10, interval=0.001) == "third"
        assert await wait_until(lambda: asyncio.to_thread(lambda: {"in": "a thread"}), 10) == {"in": "a thread"}

        async def refused():
            raise httpx.ConnectError("refused")

        with pytest.raises(pytest.fail.Exception, match=r"async never.*ConnectError"):
            await wait_until(refused, 0.05, what="async never")

    asyncio.run(main())
