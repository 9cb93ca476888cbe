#!/usr/bin/env bash
# Smoke test of the compose farm (make compose-smoke; not part of make test, it needs Docker):
#   make image && make compose-up && deploy/compose_smoke.sh && make compose-down
# Waits for health; trains the canary adapters (lorafarm devadapters, cached on the models volume);
# creates a tenant and uploads them through the registry; sends canary requests through the router
# with the openai client (0 wrong markers); kills the replica container serving a stream mid-stream
# (the client must get the router's error event, then requests fail over to the other replica);
# restarts it and checks it rejoins and serves; checks Prometheus (every target up, the alert rules
# loaded, the paged-attention gauge); records memory per container (docker stats); tears down
# (SMOKE_KEEP=1 leaves the farm running). Figures: var/compose_smoke/summary.json.
set -Eeuo pipefail
cd "$(dirname "$0")/.."

COMPOSE="${COMPOSE:-docker-compose}"
PROJECT="${COMPOSE_PROJECT:-lorafarm}"
DC=($COMPOSE -p "$PROJECT" -f deploy/compose.yaml)
OUT="${SMOKE_OUT:-var/compose_smoke}"
CANARIES="${SMOKE_CANARIES:-4}"
REQUESTS="${SMOKE_REQUESTS:-40}"
mkdir -p "$OUT"
: > "$OUT/results.jsonl"
t_start=$SECONDS

say() { echo "compose_smoke: $*" >&2; }
tools() { "${DC[@]}" run --rm -T tools "$@"; }
step() {  # step NAME ARGS...: run a compose_smoke.py step, keep its RESULT line
    local name="$1"; shift
    say "step $name $*"
    local log="$OUT/$name.log" rc=0
    tools python /deploy/compose_smoke.py "$name" "$@" > "$log" 2>&1 || rc=$?
    grep '^RESULT ' "$log" | sed 's/^RESULT //' | tee -a "$OUT/results.jsonl" >&2 || true
    if [ "$rc" != 0 ]; then say "step $name failed (rc $rc); log: $log"; tail -20 "$log" >&2; return "$rc"; fi
}
teardown() {
    if [ "${SMOKE_KEEP:-0}" = 1 ]; then say "SMOKE_KEEP=1: the farm keeps running"; return; fi
    say "tearing down"
    "${DC[@]}" --profile tools down -v --remove-orphans >/dev/null 2>&1 || true
}
failed() {
    say "FAILED after $((SECONDS - t_start)) s; container logs in $OUT/logs/"
    mkdir -p "$OUT/logs"
    for s in registry router replica-0 replica-1 embed-0 prometheus init postgres s3; do
        "${DC[@]}" logs --no-color --tail 200 "$s" > "$OUT/logs/$s.log" 2>&1 || true
    done
    teardown
}
trap failed ERR

# the farm must be up (make compose-up); start it if it is not
if [ -z "$("${DC[@]}" ps -q router 2>/dev/null)" ]; then
    say "the farm is not running: make compose-up"
    make compose-up
fi

step wait
# Canaries are trained once and cached by content (base fingerprint + spec). A cache of them from this
# checkout's test suite (.cache/lorafarm/canaries-tiny-s0, or SMOKE_CANARY_CACHE) is copied in first,
# when there is one; devadapters re-checks every cache key and trains whatever does not match.
cache="${SMOKE_CANARY_CACHE:-.cache/lorafarm/canaries-tiny-s0}"
if [ -d "$cache" ] && [ "$cache" != none ]; then
    say "seeding the canary cache from $cache"
    "${DC[@]}" run --rm -T -u 0 -v "$(cd "$cache" && pwd):/seed:ro" tools sh -c \
        'mkdir -p /models/canaries && for d in /seed/c*; do n=$(basename "$d"); [ -e "/models/canaries/$n/cache_key" ] || cp -r "$d" /models/canaries/; done; chown -R 10001:10001 /models/canaries' \
        > "$OUT/canary-cache.log" 2>&1
fi
say "canary adapters: lorafarm devadapters (reuses the cached ones whose key matches, trains the rest)"
t=$SECONDS
tools lorafarm devadapters --base /models/lorafarm-dev-tiny --out /models/canaries --count "$CANARIES" \
    > "$OUT/devadapters.log" 2>&1
say "canaries ready in $((SECONDS - t)) s"
step seed
step canary "$REQUESTS"

# -- a replica killed mid-stream --------------------------------------------------------------------
say "step midstream: a long stream, the replica serving it killed after 3 chunks"
log="$OUT/midstream.log"
: > "$log"
tools python /deploy/compose_smoke.py midstream > "$log" 2>&1 &
client=$!
rid=""
for _ in $(seq 600); do
    rid="$(sed -n 's/^MIDSTREAM //p' "$log" | head -1)"
    [ -n "$rid" ] && break
    kill -0 "$client" 2>/dev/null || break
    sleep 0.1
done
[ -n "$rid" ] || { say "the stream never reached 3 chunks"; cat "$log" >&2; false; }
svc="replica-${rid#r}"
"${DC[@]}" kill -s SIGKILL "$svc" >/dev/null 2>&1
say "killed $svc (replica $rid) mid-stream"
rc=0; wait "$client" || rc=$?
grep '^RESULT ' "$log" | sed 's/^RESULT //' | tee -a "$OUT/results.jsonl" >&2 || true
[ "$rc" = 0 ] || { say "midstream failed"; cat "$log" >&2; false; }

step failover "$rid"
say "restarting $svc"
"${DC[@]}" start "$svc" >/dev/null
step rejoin "$rid"
step prometheus
step canary "$REQUESTS"

# -- figures ------------------------------------------------------------------------------------------
docker stats --no-stream --format '{{.Name}}\t{{.MemUsage}}\t{{.CPUPerc}}' \
    $(docker ps -q --filter "label=com.docker.compose.project=$PROJECT") > "$OUT/docker_stats.txt"
say "memory per container:"; sed 's/^/    /' "$OUT/docker_stats.txt" >&2
for s in replica-0 replica-1; do
    "${DC[@]}" logs --no-color "$s" 2>&1 | grep -i -m3 -E "paged|attention" | sed "s/^/    /" >&2 || true
done
python3 - "$OUT" "$((SECONDS - t_start))" <<'PY'
import json, sys
out, seconds = sys.argv[1], int(sys.argv[2])
steps = [json.loads(line) for line in open(f"{out}/results.jsonl") if line.strip()]
stats = [line.rstrip("\n").split("\t") for line in open(f"{out}/docker_stats.txt") if line.strip()]
summary = {"ok": all(s.get("ok") for s in steps), "seconds": seconds, "steps": steps,
           "memory": {name: mem for name, mem, _ in stats}}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
canary = [s for s in steps if s.get("step") == "canary"]
print(f"compose_smoke: {sum(s['requests'] for s in canary)} canary requests, "
      f"{sum(s['wrong_markers'] for s in canary)} wrong markers, {sum(s['errors'] for s in canary)} errors; "
      f"summary in {out}/summary.json", file=sys.stderr)
PY
trap - ERR
teardown
say "OK in $((SECONDS - t_start)) s"
