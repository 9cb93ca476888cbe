#!/usr/bin/env bash
# Wait until the compose farm is up: the init and seed steps exited 0 and every long-running container is
# healthy (their HEALTHCHECKs: /health of registry, router, replicas; pg_isready; moto; Prometheus).
set -euo pipefail
cd "$(dirname "$0")/.."
COMPOSE="${COMPOSE:-docker-compose}"
DC=($COMPOSE -p "${COMPOSE_PROJECT:-lorafarm}" -f deploy/compose.yaml)
timeout="${COMPOSE_WAIT_S:-600}"
t0=$SECONDS
while :; do
    pending=()
    for id in $("${DC[@]}" ps -q); do
        read -r name status health code < <(docker inspect -f \
            '{{.Name}} {{.State.Status}} {{if .State.Health}}{{.State.Health.Status}}{{else}}none{{end}} {{.State.ExitCode}}' "$id")
        name="${name#/}"
        case "$status/$health" in
            running/healthy) ;;
            exited/none)
                if [ "$code" != 0 ]; then
                    echo "compose_wait: $name exited with $code" >&2
                    docker logs --tail 30 "$id" >&2 || true
                    exit 1
                fi ;;
            exited/*|dead/*)
                echo "compose_wait: $name $status (exit $code)" >&2; docker logs --tail 30 "$id" >&2 || true; exit 1 ;;
            *) pending+=("$name:$status/$health") ;;
        esac
    done
    if [ "${#pending[@]}" = 0 ]; then
        echo "compose_wait: every container up and healthy after $((SECONDS - t0)) s" >&2
        "${DC[@]}" ps >&2
        # the seed step's tenant, API key and a chat to try (deploy/compose/seed.py)
        "${DC[@]}" logs --no-color seed 2>/dev/null | sed -n 's/^.*| seed: /compose_wait: /p' >&2 || true
        exit 0
    fi
    if [ $((SECONDS - t0)) -ge "$timeout" ]; then
        echo "compose_wait: still waiting after $timeout s for: ${pending[*]}" >&2
        exit 1
    fi
    sleep 3
done
