# Prometheus from Debian's package, a stand-in for prom/prometheus where no registry can be reached
# (scripts/build-images.sh). Same contract as the official image: the binary is the entrypoint, it runs as nobody,
# its data under /prometheus, and busybox-style `wget` for the compose health check.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus wget >/dev/null \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o nobody -g nogroup -m 0755 /prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
