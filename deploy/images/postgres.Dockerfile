# PostgreSQL 15 from Debian's package, a stand-in for postgres:15-bookworm (scripts/build-images.sh). It keeps the
# part of the official image's contract that docker-compose.yml uses: POSTGRES_USER, POSTGRES_DB and
# POSTGRES_PASSWORD_FILE create the database on first start, the data lives in /var/lib/postgresql/data, and
# pg_isready is on PATH for the health check.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql-15 >/dev/null \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o postgres -g postgres -m 0700 /var/lib/postgresql/data \
 && install -d -o postgres -g postgres -m 2775 /var/run/postgresql
COPY --chmod=0755 postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint.sh
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
USER postgres
EXPOSE 5432
ENTRYPOINT ["/usr/local/bin/postgres-entrypoint.sh"]
