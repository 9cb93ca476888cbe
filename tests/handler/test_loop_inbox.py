"""handler.threads.LoopInbox: the engine thread's events reach the serving loop in the order posted,
with one wake-up of the loop per batch (a wake-up per event made the loop and the engine thread
trade the GIL thousands of times a second under a heavy tenant's streams: issue 35, attack 1)."""

from __future__ import annotations

import asyncio
import threading

from handler.threads import LoopInbox


async def test_posts_run_in_order_with_one_wake_up_per_batch():
    loop = asyncio.get_running_loop()
    wakeups = []
    real = loop.call_soon_threadsafe

    def counting(cb, *args, **kw):
        if getattr(cb, "__self__", None) is inbox:  # the inbox's own (other threads share this test loop)
            wakeups.append(cb)
        return real(cb, *args, **kw)

    inbox = LoopInbox(loop)
    loop.call_soon_threadsafe = counting  # asyncio's method, counted; the inbox is the real one
    try:
        got: list[int] = []
        done = asyncio.Event()

        def deliver(i: int) -> None:
            got.append(i)
            if i == 999:
                done.set()

        def engine_thread() -> None:  # posts while the loop is busy: the posts batch up
            for i in range(1000):
                inbox.post(deliver, i)

        t = threading.Thread(target=engine_thread)
        t.start()
        t.join()  # the loop has not run since: every post is in one batch
        await asyncio.wait_for(done.wait(), 60)
        assert got == list(range(1000))
        assert len(wakeups) == 1
        inbox.post(deliver, 1000)  # after a drain, the next post wakes the loop again
        await asyncio.sleep(0)
        assert got[-1] == 1000 and len(wakeups) == 2
    finally:
        del loop.call_soon_threadsafe


async def test_a_failing_receiver_loses_no_other_event():
    inbox = LoopInbox(asyncio.get_running_loop())
    got: list[int] = []

    def deliver(i: int) -> None:
        if i == 1:
            raise RuntimeError("receiver gone")
        got.append(i)

    for i in range(3):
        inbox.post(deliver, i)
    await asyncio.sleep(0)
    assert got == [0, 2]


def test_a_post_after_the_loop_closed_is_dropped():
    loop = asyncio.new_event_loop()
    inbox = LoopInbox(loop)
    loop.close()
    inbox.post(print, "never")  # no exception: shutdown
