"""Rate limits shared by several routers through a real redis-server (Debian's package; .ci/run
starts one and exports LORAFARM_TEST_REDIS_URL, else this module starts its own on a free port)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from router.ratelimit import RateLimiter, RedisRateLimiter, make_limiter
from tests.handler.conftest_service import free_port
from tests.waiting import wait_for


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    url = os.environ.get("LORAFARM_TEST_REDIS_URL")
    if url:
        yield url
        return
    exe = shutil.which("redis-server")
    if exe is None:
        if os.environ.get("CI"):  # .ci/run installs and starts it: missing there is a broken CI
            pytest.fail("redis-server missing under CI (.ci/run installs Debian's redis-server)")
        pytest.skip("redis-server not installed (apt-get install redis-server; .ci/run does)")
    port = free_port()
    d = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(d)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)

    def answers() -> bool:
        try:
            return client.ping()
        except redis.ConnectionError:  # still starting
            return False

    wait_for(answers, 30, interval=0.05, what=f"redis answering on port {port}")
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def test_two_routers_share_one_limit(redis_url):
    # a bucket of 4 requests that refills one every 25 s: the checks below see no refill however
    # slowly a busy machine runs them (at 4 req/s a refill came within 250 ms)
    prefix = f"t{time.monotonic_ns()}:"
    rate, burst = 0.04, 100.0
    a = RedisRateLimiter(redis_url, burst_seconds=burst, prefix=prefix)
    b = RedisRateLimiter(redis_url, burst_seconds=burst, prefix=prefix)
    allowed = 0
    for i in range(10):
        r = (a if i % 2 else b).check("acme", requests_per_s=rate, tokens_per_s=None, tokens=10)
        allowed += r.allowed
    assert allowed == 4  # the 4-request bucket is shared; two local limiters would admit 8
    denied = a.check("acme", requests_per_s=rate, tokens_per_s=None, tokens=10)
    assert not denied.allowed and int(denied.headers["retry-after"]) >= 1
    assert denied.headers["x-ratelimit-limit-requests"] == "4"
    assert a.fallbacks == 0 and b.fallbacks == 0
    # the same traffic through two per-router limiters admits twice as much
    la, lb = RateLimiter(burst_seconds=burst), RateLimiter(burst_seconds=burst)
    assert sum((la if i % 2 else lb).check("acme", requests_per_s=rate, tokens_per_s=None, tokens=10).allowed
               for i in range(10)) == 8


def test_token_bucket_and_settle(redis_url):
    prefix = f"s{time.monotonic_ns()}:"
    a = RedisRateLimiter(redis_url, prefix=prefix)
    b = RedisRateLimiter(redis_url, prefix=prefix)
    assert a.check("t", requests_per_s=None, tokens_per_s=100.0, tokens=80).allowed
    assert not b.check("t", requests_per_s=None, tokens_per_s=100.0, tokens=80).allowed  # 20 left
    a.settle("t", 80, 10)  # the request used 10 of its 80: 70 back, for every router
    r = b.check("t", requests_per_s=None, tokens_per_s=100.0, tokens=80)
    assert r.allowed and int(r.headers["x-ratelimit-remaining-tokens"]) < 20


def test_unreachable_redis_falls_back_to_the_local_buckets():
    lim = RedisRateLimiter(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.05)
    results = [lim.check("x", requests_per_s=2.0, tokens_per_s=None, tokens=1).allowed for _ in range(3)]
    assert results == [True, True, False] and lim.fallbacks == 3
    assert isinstance(make_limiter(None), RateLimiter)
