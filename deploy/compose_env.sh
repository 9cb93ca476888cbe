#!/bin/sh
# Write deploy/compose.env (gitignored) from deploy/compose.env.example with fresh random secrets,
# unless it exists. Mode 0600.
set -eu
cd "$(dirname "$0")"
[ -e compose.env ] && exit 0
rand() { python3 -c 'import secrets; print(secrets.token_hex(24))'; }
token="$(rand)"; pw="$(rand)"; key="$(rand)"; secret="$(rand)"
umask 077
sed -e "s/^LORAFARM_ADMIN_TOKEN=.*/LORAFARM_ADMIN_TOKEN=$token/" \
    -e "s/^POSTGRES_PASSWORD=.*/POSTGRES_PASSWORD=$pw/" \
    -e "s#^LORAFARM_DATABASE_URL=.*#LORAFARM_DATABASE_URL=postgresql+asyncpg://lorafarm:$pw@postgres:5432/lorafarm#" \
    -e "s/^AWS_ACCESS_KEY_ID=.*/AWS_ACCESS_KEY_ID=$key/" \
    -e "s/^AWS_SECRET_ACCESS_KEY=.*/AWS_SECRET_ACCESS_KEY=$secret/" \
    compose.env.example > compose.env.tmp
mv compose.env.tmp compose.env
echo "compose_env: wrote deploy/compose.env (random secrets, mode 0600, gitignored)"
