"""A test-only hold point, so a fault test can act mid-generation instead of racing the stream.

Only when $LORAFARM_TEST_HOLD names a folder (a test farm's; unset in production: no effect): a
request whose x-request-id (the client's, passed on by the router) is `hold<N>-<anything>` stops
the engine thread right after its N-th token has been handed to the stream. The replica that holds
it first creates `<folder>/<request id>.held` (exclusively: a failover to another replica with the
same id is not held again) and waits until `<folder>/<request id>.release` exists, or MAX_HOLD_S.
A test reads N tokens (or waits for the .held file), then SIGKILLs or SIGSTOPs the replica while
it is provably generating.

While held the whole engine of that replica waits (its event loop still answers): a test farm only.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

HOLD_ENV = "LORAFARM_TEST_HOLD"
MAX_HOLD_S = 120.0  # a test that never releases wedges its replica this long at most
_MARKER = re.compile(r"hold(\d{1,5})-[A-Za-z0-9._:-]+")


class Hold:
    """Holds the engine thread once, after `after_tokens` tokens of one request (see the module doc)."""

    def __init__(self, folder: Path, request_id: str, after_tokens: int):
        self.folder, self.request_id, self.after_tokens = folder, request_id, after_tokens
        self._tokens = 0
        self._spent = False

    def on_event(self, ev) -> None:
        """Called on the engine thread after the event went to the stream; blocks there at the N-th token."""
        if self._spent or ev.token_id is None or ev.token_id < 0 or ev.finished:
            return
        self._tokens += 1
        if self._tokens >= self.after_tokens:
            self._spent = True
            self._hold()

    def _hold(self) -> None:
        held = self.folder / f"{self.request_id}.held"
        try:
            fd = os.open(held, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:  # held once already (on this or another replica)
            return
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()} {self._tokens}\n")
        release = self.folder / f"{self.request_id}.release"
        deadline = time.monotonic() + MAX_HOLD_S
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.02)  # test farms only: the engine thread has nothing else to do while held


def for_request(request_id: str | None) -> Hold | None:
    """The hold for a marked request in a test farm, else None."""
    folder = os.environ.get(HOLD_ENV)
    if not folder or not request_id:
        return None
    m = _MARKER.fullmatch(request_id)
    return Hold(Path(folder), request_id, max(1, int(m.group(1)))) if m else None
