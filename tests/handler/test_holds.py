"""The test-only hold point (handler/serving/holds.py): off unless $LORAFARM_TEST_HOLD names a
folder; a marked request's events block the engine thread after its N-th token until released,
once per request id (a failover to another replica is not held again)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from handler.serving import holds
from tests.waiting import wait_for


def _token(i):
    return SimpleNamespace(token_id=100 + i, finished=False)


def test_off_without_the_env_or_the_marker(monkeypatch, tmp_path):
    monkeypatch.delenv(holds.HOLD_ENV, raising=False)
    assert holds.for_request("hold3-abc") is None
    monkeypatch.setenv(holds.HOLD_ENV, str(tmp_path))
    assert holds.for_request("req-123") is None and holds.for_request(None) is None
    assert holds.for_request("hold3-abc").after_tokens == 3


def test_holds_after_n_tokens_until_released_and_only_once(monkeypatch, tmp_path):
    monkeypatch.setenv(holds.HOLD_ENV, str(tmp_path))
    hold = holds.for_request("hold2-xyz")
    passed = []

    def engine():
        for i in range(4):
            hold.on_event(_token(i))
            passed.append(i)

    t = threading.Thread(target=engine, daemon=True)
    t.start()
    wait_for(lambda: (tmp_path / "hold2-xyz.held").exists(), 30, what="the hold taken")
    assert t.is_alive() and passed == [0]  # the second token's event has not returned: held
    (tmp_path / "hold2-xyz.release").touch()
    t.join(30)
    assert passed == [0, 1, 2, 3]
    again = holds.for_request("hold2-xyz")  # the same id on another replica (a failover): not held again
    for i in range(3):
        again.on_event(_token(i))
