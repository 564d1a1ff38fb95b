# PostgreSQL 15 from Debian's own package, for CI where postgres:15-bookworm cannot be pulled.
# Same contract as the official image for what the compose stack uses: POSTGRES_USER,
# POSTGRES_PASSWORD, POSTGRES_DB create the role and database on first start, data in
# /var/lib/postgresql/data (a volume), pg_isready for the health check. Listens on 127.0.0.1
# only, on PGPORT (5432 unless set).
ARG BASE_IMAGE=debian:bookworm-20251117-slim
FROM ${BASE_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql-15 \
 && rm -rf /var/lib/apt/lists/*
ENV PATH=/usr/lib/postgresql/15/bin:$PATH \
    PGDATA=/var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
VOLUME /var/lib/postgresql/data
ENTRYPOINT ["/usr/local/bin/postgres-entrypoint.sh"]
