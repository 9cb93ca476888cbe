"""The simulator against a measured run: the stored figures of a real load test and the simulator
configured like that farm, with service times fitted from the same run.

Measured (docs/loadtest.md, `lorafarm loadtest --ab --duration 40 --rate 4`): 3 replicas of the tiny
dev model on this machine's CPU, 2 device slots in each rank pool (8/16/32/64), 16 canary adapters
(ranks cycling 8, 16, 32), Zipf(1.1) over the sorted aliases, Poisson 4 req/s for 40 s after a 10 s
warm-up pass, streamed through the router.

Fitted from that run (the figures below, not free parameters):
- decode step = TPOT p50 (6.2 ms);
- prefill: TTFT p50 of device hits (16.7 ms) minus one decode step leaves ~10.5 ms for a ~20-token
  chat prompt (template included) -> 2,000 prompt tokens/s, which also absorbs router + HTTP;
- loads: RAM ~ TTFT p50(ram) - TTFT p50(gpu) = 22.5 - 16.7 = 5.8 ms; disk 26.6 - 17.2 = 9.4 ms (the
  random run); remote (store -> disk -> RAM) ~ 30 ms (not observed in the run);
- output tokens: 22.9 tokens/s over 182 requests in 39.8 s = 5.0 per request (canaries stop after
  their marker), prompt ~20 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from loadtests.simulate import SimConfig, SimResult, simulate

SOURCE = "docs/loadtest.md (lorafarm loadtest --ab --duration 40 --rate 4)"
MEASURED = {
    "affinity": {"p50_ttft_s": 0.0171, "p95_ttft_s": 0.0329, "device_hit_rate": 0.934, "requests": 182},
    "random": {"p50_ttft_s": 0.0182, "p95_ttft_s": 0.0366, "device_hit_rate": 0.621, "requests": 182},
}


def fitted_config(routing: str, seed: int = 0) -> SimConfig:
    return SimConfig(
        replicas=3, adapters=16, rate=4.0, duration=50.0, warmup_s=10.0, routing=routing, seed=seed,
        rank_pools={8: 2, 16: 2, 32: 2, 64: 2}, adapter_ranks=(8, 16, 32), ram_adapters=16, disk_adapters=16,
        prompt_tokens=20.0, output_tokens=5.0, max_request_tokens=512, max_batch=32,
        decode_step_s=0.0062, prefill_tokens_per_s=2000.0,
        load_s={"gpu": 0.0, "ram": 0.0058, "disk": 0.0094, "remote": 0.030},
        load_threshold_tokens=8192, poll_s=1.0, stats_window_s=10.0, sample_s=5.0)


@dataclass(frozen=True)
class Comparison:
    routing: str
    simulated: dict
    measured: dict

    def factor(self, key: str) -> float:
        """simulated / measured."""
        return self.simulated[key] / self.measured[key]


def compare(routing: str, seeds: range = range(5)) -> Comparison:
    """Mean over a few seeds (one 40 s run is ~180 requests: its p95 is noisy)."""
    runs: list[SimResult] = [simulate(fitted_config(routing, seed)) for seed in seeds]
    keys = ("p50_ttft_s", "p95_ttft_s", "device_hit_rate")
    sim = {k: sum(getattr(r, k) for r in runs) / len(runs) for k in keys}
    sim["requests"] = sum(r.requests for r in runs) / len(runs)
    return Comparison(routing, sim, MEASURED[routing])


def markdown(comparisons: list[Comparison]) -> str:
    lines = ["## Validation: simulated vs measured", "",
             f"Measured: {SOURCE}. Simulated: the same farm (loadtests/validation.py), service times fitted "
             "from that run, mean of 5 seeds.", "",
             "| routing | quantity | measured | simulated | factor (sim / measured) |",
             "| --- | --- | ---: | ---: | ---: |"]
    for c in comparisons:
        for key in ("p50_ttft_s", "p95_ttft_s", "device_hit_rate"):
            lines.append(f"| {c.routing} | {key} | {c.measured[key]:.4f} | {c.simulated[key]:.4f} | "
                         f"{c.factor(key):.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown([compare("affinity"), compare("random")]))
