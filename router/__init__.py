"""The router (gateway): the OpenAI-compatible front door of the farm.

Modules, one concept each:
- `config`: `RouterSettings` (every knob, with production defaults);
- `auth`: API key -> `Tenant` via the registry's `POST /internal/auth/verify`, TTL-cached;
- `view`: the registry routing table + every replica's polled state ("possibly warm" on failure);
- `routing`: `choose(request, view, strategy, k)`, the pure ranking function (simulator reuses it);
- `catalog`: `GET /v1/models` (union of replica models + the caller's aliases) and name resolution;
- `ratelimit`: per-tenant token buckets (requests/s, tokens/s);
- `proxy`: httpx forwarding with failover before the first byte and unbuffered SSE after it;
- `slo`: per-tenant p95 TTFT over a sliding window; `stats`: per-adapter traffic to the registry;
- `metrics`: Prometheus; `openai_api`: request parsing and OpenAI error objects;
- `app`: `create_app(settings)`; `cli`: `lorafarm router`.
"""
