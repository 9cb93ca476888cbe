"""Issue 21 (grammar half): a hostile tenant's schemas against one real replica, and what another
tenant sees meanwhile. Writes the figures of docs/reliability.md ("Untrusted grammars").

    python benchmarks/grammar_attack.py [--out var/grammar_attack.json] [--base .cache/lorafarm/devmodel-tiny-s0]

One `lorafarm replica` process on 127.0.0.1 (default grammar flags), tenant B streaming small
requests (16 tokens, base model) back to back the whole time. Phases, each measuring B's latency
(whole streamed request) p50/p95 while the attack is in flight:

  (before each: the other tenant alone for --window-s, its baseline; the box is shared, load drifts)
  4x4000-props  4 concurrent distinct object schemas of 4,000 optional integer properties (400 expected)
  10000-props   one schema of 10,000 required properties (~350 KB; compiles: 200, finish "length")
  ref-chain     4 distinct 1,000-link $ref chains (SIGSEGV in a worker: 400), sequential
  enum-200      200 distinct ~700 KB enum schemas, 2 at a time (RSS before/after)

and whether the replica process survived (replicas lost).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.handler.test_grammar_pool import many_properties, ref_chain  # noqa: E402
from tests.handler.test_grammar_replica import Replica, rss_bytes, schema_format  # noqa: E402


def p(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class OtherTenant:
    def __init__(self, url: str):
        self.url = url
        self.samples: list[tuple[float, float]] = []  # (end time, latency)
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)

    def run(self):
        body = {"model": "dev-tiny", "messages": [{"role": "user", "content": "a story"}], "max_tokens": 16,
                "temperature": 1.0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=300) as c:
            while not self.stop.is_set():
                t0 = time.monotonic()
                with c.stream("POST", f"{self.url}/v1/chat/completions", json=body,
                              headers={"x-lorafarm-tenant": "tenant-b"}) as r:
                    for _ in r.iter_lines():
                        pass
                t1 = time.monotonic()
                self.samples.append((t1, t1 - t0))

    def window(self, t0, t1):
        return [lat for end, lat in self.samples if t0 <= end - lat and end <= t1 + lat]


def attack(url, schemas, concurrency, max_tokens=8):
    out, errs = [], []
    lock = threading.Lock()
    it = iter(enumerate(schemas))

    def worker():
        with httpx.Client(timeout=600) as c:
            while True:
                with lock:
                    nxt = next(it, None)
                if nxt is None:
                    return
                i, s = nxt
                body = {"model": "dev-tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": max_tokens,
                        "response_format": schema_format(s)}
                r = c.post(f"{url}/v1/chat/completions", json=body, headers={"x-lorafarm-tenant": f"tenant-a{i % 4}"})
                with lock:
                    out.append(r.status_code)
                    if r.status_code != 200:
                        errs.append(r.json()["error"]["message"][:120])

    ts = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out, errs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default=str(REPO / ".cache/lorafarm/devmodel-tiny-s0"))
    ap.add_argument("--out", default=str(REPO / "var/grammar_attack.json"))
    ap.add_argument("--grammar-timeout-s", type=float, default=60.0,
                    help="the replica's flag (default here 60: the 10,000-property schema compiles on a loaded box)")
    ap.add_argument("--window-s", type=float, default=8.0, help="baseline window before each attack")
    a = ap.parse_args()
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="grammar-attack-"))
    rep = Replica(Path(a.base), tmp, flags=("--grammar-timeout-s", str(a.grammar_timeout_s)))
    results = {}
    b = OtherTenant(rep.url)
    b.t.start()
    try:
        time.sleep(2)
        phases = {
            "4x4000-props": ([many_properties(4000, prefix=f"k{j}_") for j in range(4)], 4),
            "10000-props": ([many_properties(10000, required=True)], 1),
            "ref-chain": ([{**ref_chain(1000), "description": f"chain {j}"} for j in range(4)], 1),
            "enum-200": ([{"type": "object", "required": ["v"], "properties": {
                "v": {"enum": [f"value-{k}-{i:06d}-{'x' * 20}" for i in range(20000)]}}} for k in range(200)], 2),
        }
        for name, (schemas, conc) in phases.items():
            t0 = time.monotonic()  # the other tenant alone, just before (the box is shared: load drifts)
            time.sleep(a.window_s)
            base = b.window(t0, time.monotonic())
            rss0 = rss_bytes(rep.proc.pid)
            t0 = time.monotonic()
            statuses, errors = attack(rep.url, schemas, conc)
            t1 = time.monotonic()
            lat = b.window(t0, t1)
            rss1 = rss_bytes(rep.proc.pid)
            results[name] = {"baseline_p50": p(base, .5), "baseline_p95": p(base, .95), "baseline_n": len(base),
                             "p50": p(lat, .5), "p95": p(lat, .95), "n": len(lat), "attack_s": t1 - t0,
                             "errors": sorted(set(errors))[:3],
                             "statuses": {str(s): statuses.count(s) for s in set(statuses)},
                             "rss_before_mib": rss0 / 2**20, "rss_after_mib": rss1 / 2**20,
                             "replica_alive": rep.proc.poll() is None}
            print(name, results[name], flush=True)
            time.sleep(1)
    finally:
        b.stop.set()
        b.t.join(60)
        results["replicas_lost"] = int(rep.proc.poll() is not None)
        rep.stop()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
