#!/usr/bin/env bash
# Smoke test of the compose farm (make compose-smoke; not part of make test, it needs Docker):
#   make image && make compose-up && deploy/compose_smoke.sh && make compose-down
# Waits for health; takes the demo tenant the `seed` service made (the real model's four demo
# adapters, aliases demo/<name>:prod; their archives under s3://lorafarm/adapters/...); chats with the
# base and each alias at temperature 0 and checks the answers show their behaviour (base: "Paris";
# support prefix, French, valid JSON, pirate); requests through the router with the openai client
# (every answer must show its adapter's behaviour); kills the replica container serving a stream
# mid-stream (the client must get the router's error event, then requests fail over to the other
# replica); restarts it and checks it rejoins and serves; checks Prometheus (every target up, the
# alert rules loaded, the C decode step's steps above 0 on both replicas) and the replicas' logs (the
# "decode steps of 1-64 rows: C decode step" line); records each replica's start (container start to
# serving) and memory per container (docker stats). Figures: var/compose_smoke/summary.json.
# It leaves the farm running (`make compose-down` removes it), also when it fails (logs in
# var/compose_smoke/logs/).
set -Eeuo pipefail
cd "$(dirname "$0")/.."

COMPOSE="${COMPOSE:-docker-compose}"
PROJECT="${COMPOSE_PROJECT:-lorafarm}"
DC=($COMPOSE -p "$PROJECT" -f deploy/compose.yaml)
OUT="${SMOKE_OUT:-var/compose_smoke}"
REQUESTS="${SMOKE_REQUESTS:-16}"
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
failed() {
    say "FAILED after $((SECONDS - t_start)) s; container logs in $OUT/logs/ (the farm keeps running: make compose-down)"
    mkdir -p "$OUT/logs"
    for s in registry router replica-0 replica-1 embed-0 prometheus init seed postgres s3; do
        "${DC[@]}" logs --no-color --tail 200 "$s" > "$OUT/logs/$s.log" 2>&1 || true
    done
}
trap failed ERR

replica_logs() {  # replica_logs LABEL: each replica's log (timestamps) and container start, as of now
    local s id
    for s in replica-0 replica-1; do
        id="$("${DC[@]}" ps -q "$s")"
        docker logs -t "$id" > "$OUT/$s.$1.log" 2>&1 || true
        printf '%s\t%s\t%s\n' "$1" "$s" "$(docker inspect -f '{{.State.StartedAt}}' "$id")" >> "$OUT/replica_starts.txt"
    done
}
: > "$OUT/replica_starts.txt"

# the farm must be up (make compose-up); start it if it is not
if [ -z "$("${DC[@]}" ps -q router 2>/dev/null)" ]; then
    say "the farm is not running: make compose-up"
    make compose-up
fi

step wait
replica_logs first
step seed
step demo
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
replica_logs end
grep -h -E "decode steps of|decode attention| started in " "$OUT"/replica-?.end.log | sed "s/^/    /" >&2 || true
python3 - "$OUT" "$((SECONDS - t_start))" <<'PY'
import json, re, sys
from datetime import datetime
out, seconds = sys.argv[1], int(sys.argv[2])
steps = [json.loads(line) for line in open(f"{out}/results.jsonl") if line.strip()]
stats = [line.rstrip("\n").split("\t") for line in open(f"{out}/docker_stats.txt") if line.strip()]

def when(stamp):  # docker's RFC 3339 with nanoseconds -> datetime
    return datetime.fromisoformat(re.sub(r"(\.\d{6})\d*", r"\1", stamp.replace("Z", "+00:00")))

replicas = {}  # (label, service) -> from the container's start to its server listening, and its C decode step line
for line in open(f"{out}/replica_starts.txt"):
    label, name, started = line.split()
    if any(r["started_at"] == started for k, r in replicas.items() if k.startswith(name + " ")):
        continue  # the same run as before (the replica was not restarted)
    lines = [ln.split(" ", 1) for ln in open(f"{out}/{name}.{label}.log") if ln.strip()]
    # this run's lines (a restarted container's log holds the earlier run too)
    lines = [(when(t), text) for t, text in lines if t[:1].isdigit() and when(t) >= when(started)]
    ready = next((t for t, text in lines if "Uvicorn running on" in text or "Application startup complete" in text), None)
    step_line = next((text.strip() for _, text in lines if "decode steps of" in text), None)
    phases = next((text.strip() for _, text in lines if " started in " in text), None)  # the replica's own phases
    replicas[f"{name} ({label})"] = {
        "started_at": started, "decode_step_log": step_line, "phases_log": phases,
        "start_to_serving_s": round((ready - when(started)).total_seconds(), 1) if ready else None}
c_step = all(r["decode_step_log"] and r["decode_step_log"].endswith("C decode step") for r in replicas.values())
summary = {"ok": all(s.get("ok") for s in steps) and c_step, "seconds": seconds, "steps": steps,
           "replicas": replicas, "memory": {name: mem for name, mem, _ in stats}}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=2)
canary = [s for s in steps if s.get("step") == "canary"]
print(f"compose_smoke: {sum(s['requests'] for s in canary)} demo requests, "
      f"{sum(s['wrong'] for s in canary)} without their behaviour, {sum(s['errors'] for s in canary)} errors; "
      f"replica start to serving: " + ", ".join(f"{n} {r['start_to_serving_s']} s" for n, r in replicas.items())
      + f"; C decode step in both replicas' logs: {c_step}; summary in {out}/summary.json", file=sys.stderr)
sys.exit(0 if summary["ok"] else 1)
PY
trap - ERR
say "OK in $((SECONDS - t_start)) s (the farm keeps running: make compose-down)"
