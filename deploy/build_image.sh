#!/usr/bin/env bash
# Build the lorafarm image (`make image`) and, with `services`, the compose farm's helper images.
#
#   deploy/build_image.sh [app|services|all|base]   (base: only the local mmdebstrap base)
#
# Environment (all optional):
#   IMAGE        tag of the lorafarm image          (default lorafarm:0.1.0-$VARIANT)
#   VARIANT      cpu | cuda                          (default cpu)
#   BASE         base image. Unset: python:3.11-slim when it is present or can be pulled, else the
#                local Debian base lorafarm-base:bookworm, made here with mmdebstrap when missing
#                (this is the machine-without-a-registry path; it says so when it takes it).
#   TORCH_INDEX  passed to the Dockerfile (default: the pip configuration, else PyTorch's index)
#   PIP_CONF_FOR_BUILD=none   do not pass this host's pip configuration and CA bundle to the build
#   DOCKER       docker client (default: the first one on PATH that can build with BuildKit)
#
# The host's pip configuration (`pip config list`, PIP_* variables) and CA bundle go to the build
# as BuildKit secrets (pip.conf, ca.crt): they are in no layer of the image. Local folders it
# names (find-links folders, file:// indexes) are served over HTTP on 127.0.0.1 for the length
# of the build, which then runs with --network host so it can reach them.
set -euo pipefail
cd "$(dirname "$0")/.."

what="${1:-app}"
VARIANT="${VARIANT:-cpu}"
IMAGE="${IMAGE:-lorafarm:0.1.0-$VARIANT}"
LOCAL_BASE="${LOCAL_BASE:-lorafarm-base:bookworm}"
SERVICES_TAG="${SERVICES_TAG:-0.1.0}"

say() { echo "build_image: $*" >&2; }

# -- a docker client that builds with BuildKit (RUN --mount=type=secret) ---------------------------
pick_docker() {
    local cands=() c
    [ -n "${DOCKER:-}" ] && cands+=("$DOCKER")
    while read -r c; do cands+=("$c"); done < <(type -ap docker || true)
    for c in "${cands[@]}"; do
        if "$c" buildx version >/dev/null 2>&1; then
            DOCKER="$c"; BUILD=("$c" buildx build --load); return
        fi
        # clients before 23.0 have BuildKit built in (DOCKER_BUILDKIT=1)
        local v; v="$("$c" version --format '{{.Client.Version}}' 2>/dev/null || true)"
        if [ -n "$v" ] && [ "${v%%.*}" -lt 23 ] 2>/dev/null; then
            DOCKER="$c"; BUILD=(env DOCKER_BUILDKIT=1 "$c" build); return
        fi
    done
    say "no docker client here can build with BuildKit: install docker-buildx, or set DOCKER to a client < 23"
    exit 1
}
pick_docker
say "docker client: ${BUILD[*]}"

# -- the base image -------------------------------------------------------------------------------
have_image() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }

make_local_base() {
    if have_image "$LOCAL_BASE"; then return; fi
    command -v mmdebstrap >/dev/null || { say "no registry and no mmdebstrap: apt-get install mmdebstrap"; exit 1; }
    say "building the local Debian base $LOCAL_BASE with mmdebstrap (no registry reachable; ~2 min)"
    mmdebstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates bookworm - \
        | "$DOCKER" import - "$LOCAL_BASE"
}

if [ "$what" = base ]; then make_local_base; exit 0; fi
if [ -z "${BASE:-}" ]; then
    if have_image python:3.11-slim || timeout 60 "$DOCKER" pull -q python:3.11-slim >/dev/null 2>&1; then
        BASE=python:3.11-slim
    else
        say "python:3.11-slim cannot be pulled (no registry): using the local base $LOCAL_BASE"
        BASE="$LOCAL_BASE"
    fi
fi
[ "$BASE" = "$LOCAL_BASE" ] && make_local_base
say "base: $BASE"

# -- the host's pip configuration, CA bundle and local wheel folders --------------------------------
# serve_dir runs inside $(...), a subshell: the pids of the servers it starts go to a file, not a
# variable, so the exit trap (every exit: success, an error under set -e, Ctrl-C, TERM) can stop them.
work="$(mktemp -d)"
: > "$work/servers"
cleanup() {
    local p
    while read -r p; do
        kill "$p" 2>/dev/null || true
    done < "$work/servers"
    while read -r p; do  # and wait until they are gone
        for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    done < "$work/servers"
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

PYHOST="$(command -v python3 || true)"
serve_dir() {  # serve_dir DIR -> prints http://127.0.0.1:PORT
    local dir="$1" port
    port="$("$PYHOST" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    "$PYHOST" -m http.server --bind 127.0.0.1 --directory "$dir" "$port" >/dev/null 2>&1 &
    echo "$!" >> "$work/servers"
    for _ in $(seq 50); do
        "$PYHOST" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/', timeout=1)" \
            >/dev/null 2>&1 && break
        sleep 0.1
    done
    echo "http://127.0.0.1:$port"
}

secrets=()
net=()
if [ "${PIP_CONF_FOR_BUILD:-}" != none ] && [ -n "$PYHOST" ] && "$PYHOST" -m pip --version >/dev/null 2>&1; then
    "$PYHOST" -m pip config list 2>/dev/null > "$work/pip-config.txt" || true
    # key=value lines; environment (":env:.") wins over files, later files over earlier
    "$PYHOST" - "$work/pip-config.txt" > "$work/pip-settings.txt" <<'PY'
import ast, sys
vals = {}
env = {}
for line in open(sys.argv[1]):
    key, _, value = line.rstrip("\n").partition("=")
    if not value:
        continue
    scope, _, name = key.rpartition(".")
    try:
        value = ast.literal_eval(value)
    except Exception:
        pass
    (env if scope == ":env:" else vals)[name] = value
vals.update(env)
for name in ("index-url", "extra-index-url", "find-links", "trusted-host", "cert", "timeout", "default-timeout"):
    if name in vals:
        print(f"{name}\t{vals[name]}")
PY
    {
        echo "[global]"
        served=0
        while IFS=$'\t' read -r name value; do
            case "$name" in
                cert) [ -s "$value" ] && cp "$value" "$work/ca.crt" ;;
                index-url|extra-index-url|find-links)
                    out=()
                    for u in $value; do
                        p="${u#file://}"
                        if [ "$p" != "$u" ] || [[ "$u" == /* ]]; then  # a local folder: serve it
                            if [ ! -d "$p" ]; then say "pip config $name $u: no such folder, skipped"; continue; fi
                            if [ "$name" = find-links ]; then
                                out+=("$(serve_dir "$p")/")
                            else  # an index's links may climb above it (../../files): serve its parent
                                out+=("$(serve_dir "$(dirname "$p")")/$(basename "$p")/")
                            fi
                            served=1
                            say "serving $p (pip $name) on loopback for the build"
                        else
                            out+=("$u")
                        fi
                    done
                    [ "${#out[@]}" -gt 0 ] && echo "$name = ${out[*]}"
                    ;;
                *) echo "$name = $value" ;;
            esac
        done < "$work/pip-settings.txt"
        [ "$served" = 1 ] && touch "$work/served"
    } > "$work/pip.conf"
    # the CA bundle pip uses here (pip's cert, else the usual variables), so the build trusts the same CAs
    if [ ! -s "$work/ca.crt" ]; then
        for f in "${PIP_CERT:-}" "${REQUESTS_CA_BUNDLE:-}" "${SSL_CERT_FILE:-}"; do
            if [ -n "$f" ] && [ -s "$f" ]; then cp "$f" "$work/ca.crt"; break; fi
        done
    fi
    if [ "$(wc -l < "$work/pip.conf")" -gt 1 ]; then
        secrets+=(--secret "id=pip.conf,src=$work/pip.conf")
        say "pip configuration for the build (a secret, not in the image):"; sed 's/^/    /' "$work/pip.conf" >&2
    fi
    [ -s "$work/ca.crt" ] && secrets+=(--secret "id=ca.crt,src=$work/ca.crt")
    # loopback servers are reachable only from the host's network namespace
    [ -e "$work/served" ] && net=(--network host)
fi

build_app() {
    local t0=$SECONDS
    say "building $IMAGE (VARIANT=$VARIANT)"
    "${BUILD[@]}" -f deploy/Dockerfile "${net[@]}" "${secrets[@]}" \
        --build-arg "BASE=$BASE" --build-arg "VARIANT=$VARIANT" \
        ${TORCH_INDEX:+--build-arg "TORCH_INDEX=$TORCH_INDEX"} \
        -t "$IMAGE" .
    say "built $IMAGE in $((SECONDS - t0)) s: $("$DOCKER" image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
}

build_services() {
    local t target
    for target in postgres s3 prometheus; do
        t=$SECONDS
        say "building lorafarm-$target:$SERVICES_TAG"
        "${BUILD[@]}" -f deploy/services.Dockerfile --target "$target" "${net[@]}" "${secrets[@]}" \
            --build-arg "BASE=$BASE" -t "lorafarm-$target:$SERVICES_TAG" deploy
        say "built lorafarm-$target:$SERVICES_TAG in $((SECONDS - t)) s"
    done
}

case "$what" in
    app) build_app ;;
    services) build_services ;;
    all) build_app; build_services ;;
    *) say "usage: $0 [app|services|all]"; exit 2 ;;
esac
