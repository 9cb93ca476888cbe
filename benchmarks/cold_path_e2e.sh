#!/usr/bin/env bash
# Issue 13, end to end: p95 TTFT by tier before and after the cold-path change, on the same seeded
# replay. A farm from OLD_TREE (a worktree of the commit before the change, e.g. 8b580fb), then one
# from this tree, both started by benchmarks/e2e_farm.py with the same replica flags; this tree's
# `lorafarm adapters synth` uploads the same 200 adapters into each, and this tree's
# `lorafarm loadtest --farm` drives each with the same workload. Results in OUT/before, OUT/after.
#
#   flock /tmp/measure.lock benchmarks/cold_path_e2e.sh /work/wt/pre13 var/e2e-cold [after-first]
set -euo pipefail
OLD=$(cd "$1" && pwd)
OUT=$(mkdir -p "$2" && cd "$2" && pwd)
NEW=$(cd "$(dirname "$0")/.." && pwd)
REPLICA_FLAGS=(--slots 2 --ram-bytes 8MiB --disk-bytes 32MiB)
LOAD=(--rates 2 --duration 60 --warmup 10 --seed 0 --quiet)
SETTLE_S=30  # after the upload: routing tables and prefetch settle before the replay

farm_pid=""
stop_farm() {
  if [[ -n "$farm_pid" ]]; then kill -TERM "$farm_pid" 2>/dev/null || true; wait "$farm_pid" 2>/dev/null || true; fi
  farm_pid=""
}
trap stop_farm EXIT INT TERM

run_one() {  # NAME TREE
  local name=$1 tree=$2 state=/tmp/e2e-cold-$1
  rm -rf "$state" "$OUT/$name"
  (cd "$tree" && PYTHONPATH=$tree exec python "$NEW/benchmarks/e2e_farm.py" "$state" 2 "${REPLICA_FLAGS[@]}") \
    > "$OUT/$name-farm.log" 2>&1 &
  farm_pid=$!
  for _ in $(seq 600); do grep -q '^farm.json:' "$OUT/$name-farm.log" && break; sleep 0.5; done
  grep -q '^farm.json:' "$OUT/$name-farm.log" || { echo "$name: farm did not come up"; tail "$OUT/$name-farm.log"; exit 1; }
  echo "$name: farm up from $tree ($(git -C "$tree" rev-parse --short HEAD)) $(date -u +%H:%M:%S)"
  local key
  key=$(PYTHONPATH=$NEW python -m lorafarm adapters synth --count 200 --seed 0 --tenant loadtest --aliases \
        --farm "$state/farm.json" 2>&1 | tee "$OUT/$name-synth.log" | sed -n 's/.*API key (shown only now): //p')
  tail -1 "$OUT/$name-synth.log"
  PYTHONPATH=$NEW python - "$state/farm.json" "$key" <<'PY'
import json, sys, time, httpx
url = json.load(open(sys.argv[1]))["router_url"]
for _ in range(240):
    data = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {sys.argv[2]}"}).json()["data"]
    if sum(1 for m in data if m.get("root")) >= 200:
        break
    time.sleep(0.5)
PY
  sleep "$SETTLE_S"
  PYTHONPATH=$NEW python -m lorafarm loadtest --farm "$state/farm.json" --key "$key" "${LOAD[@]}" --out "$OUT/$name" \
    2>&1 | grep '^lorafarm loadtest' || true
  stop_farm
  cp -r "$state/logs" "$OUT/$name-logs" 2>/dev/null || true
  rm -rf "$state"
}

if [[ "${3:-}" == after-first ]]; then
  run_one after "$NEW"
  run_one before "$OLD"
else
  run_one before "$OLD"
  run_one after "$NEW"
fi
echo "done $(date -u +%H:%M:%S)"
