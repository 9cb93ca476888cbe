# Helper images of the compose farm (deploy/compose.yaml), built from the same BASE as the lorafarm
# image so they need no registry: Debian's PostgreSQL, moto's S3 server, Debian's Prometheus.
#   deploy/build_image.sh services     (make compose-images)
# Where a registry is reachable, postgres:15 / prom/prometheus images would do as well; these keep
# the farm buildable offline from Debian packages and PyPI.
ARG BASE=python:3.11-slim

FROM ${BASE} AS debian-apt
# no daemon starts during package installation
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d

# -- PostgreSQL (the registry's database) ----------------------------------------------------------
FROM debian-apt AS postgres
RUN mkdir -p /etc/postgresql-common \
 && echo 'create_main_cluster = false' > /etc/postgresql-common/createcluster.conf \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
 && mkdir -p /var/lib/postgresql/data && chown postgres:postgres /var/lib/postgresql/data
COPY compose/postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint
ENV PGDATA=/var/lib/postgresql/data
USER postgres
EXPOSE 5432
HEALTHCHECK --interval=5s --timeout=5s --start-period=60s --retries=5 \
    CMD ["sh", "-c", "PATH=$(ls -d /usr/lib/postgresql/*/bin | tail -1):$PATH pg_isready -q -h 127.0.0.1 -U \"${POSTGRES_USER:-postgres}\""]
ENTRYPOINT ["postgres-entrypoint"]

# -- moto's S3 server (the object store) -------------------------------------------------------------
FROM ${BASE} AS s3
RUN --mount=type=secret,id=pip.conf --mount=type=secret,id=ca.crt \
    set -e; \
    if [ -s /run/secrets/pip.conf ]; then export PIP_CONFIG_FILE=/run/secrets/pip.conf; fi; \
    if [ -s /run/secrets/ca.crt ]; then export PIP_CERT=/run/secrets/ca.crt; fi; \
    python3 -m venv /opt/moto \
 && /opt/moto/bin/pip install --no-cache-dir --disable-pip-version-check 'moto[server]>=5,<6' \
 && useradd --uid 10002 --shell /usr/sbin/nologin moto
USER 10002
EXPOSE 5000
HEALTHCHECK --interval=5s --timeout=5s --start-period=30s --retries=5 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:5000/', timeout=4)"]
ENTRYPOINT ["/opt/moto/bin/moto_server", "-H", "0.0.0.0", "-p", "5000"]

# -- Prometheus (scrapes the farm, evaluates deploy/monitoring/alerts.rules.yaml) ---------------------
FROM debian-apt AS prometheus
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
 && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
USER prometheus
EXPOSE 9090
HEALTHCHECK --interval=5s --timeout=5s --start-period=30s --retries=5 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9090/-/ready', timeout=4)"]
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", \
     "--web.listen-address=0.0.0.0:9090", "--storage.tsdb.retention.time=2d"]
