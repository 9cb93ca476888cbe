#!/bin/sh
# deploy/compose.env (gitignored) holds the compose farm's secrets: written here from
# deploy/compose.env.example with fresh random values unless it exists (mode 0600).
#
# Least privilege: no service reads compose.env itself. Each run splits it into one env file per
# secret (gitignored, mode 0600), and deploy/compose.yaml gives each service only the files it uses:
#   compose.postgres.env  POSTGRES_USER, POSTGRES_DB, POSTGRES_PASSWORD    -> postgres
#   compose.database.env  LORAFARM_DATABASE_URL (holds the password)       -> registry
#   compose.admin.env     LORAFARM_ADMIN_TOKEN                             -> registry, router, replicas, seed, tools
#   compose.s3.env        AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...    -> init, registry, replicas r0/r1
# A variable of no group is refused (say which services need it here and in compose.yaml).
# `make compose-up` runs this every time: edit compose.env, then compose-up again.
set -eu
cd "$(dirname "$0")"
umask 077
if [ ! -e compose.env ]; then
    rand() { od -An -tx1 -N24 /dev/urandom | tr -d ' \n'; }  # 48 hex digits
    token="$(rand)"; pw="$(rand)"; key="$(rand)"; secret="$(rand)"
    sed -e "s/^LORAFARM_ADMIN_TOKEN=.*/LORAFARM_ADMIN_TOKEN=$token/" \
        -e "s/^POSTGRES_PASSWORD=.*/POSTGRES_PASSWORD=$pw/" \
        -e "s#^LORAFARM_DATABASE_URL=.*#LORAFARM_DATABASE_URL=postgresql+asyncpg://lorafarm:$pw@postgres:5432/lorafarm#" \
        -e "s/^AWS_ACCESS_KEY_ID=.*/AWS_ACCESS_KEY_ID=$key/" \
        -e "s/^AWS_SECRET_ACCESS_KEY=.*/AWS_SECRET_ACCESS_KEY=$secret/" \
        compose.env.example > compose.env.tmp
    mv compose.env.tmp compose.env
    echo "compose_env: wrote deploy/compose.env (random secrets, mode 0600, gitignored)"
fi

groups="postgres database admin s3"
for g in $groups; do : > "compose.$g.env.tmp"; done
while IFS= read -r line || [ -n "$line" ]; do
    case "$line" in ''|'#'*) continue ;; esac
    name="${line%%=*}"
    case "$name" in
        POSTGRES_USER|POSTGRES_DB|POSTGRES_PASSWORD) g=postgres ;;
        LORAFARM_DATABASE_URL) g=database ;;
        LORAFARM_ADMIN_TOKEN) g=admin ;;
        AWS_ACCESS_KEY_ID|AWS_SECRET_ACCESS_KEY|AWS_SESSION_TOKEN) g=s3 ;;
        *)
            for g in $groups; do rm -f "compose.$g.env.tmp"; done
            echo "compose_env: deploy/compose.env sets $name, which no service is given: add it to a group in deploy/compose_env.sh and to the services that need it in deploy/compose.yaml" >&2
            exit 1 ;;
    esac
    printf '%s\n' "$line" >> "compose.$g.env.tmp"
done < compose.env
for g in $groups; do mv "compose.$g.env.tmp" "compose.$g.env"; done
