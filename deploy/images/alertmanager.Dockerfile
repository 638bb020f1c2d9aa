# Alertmanager from Debian's package, a stand-in for prom/alertmanager (scripts/build-images.sh): the binary is
# the entrypoint, it runs as nobody, its state under /alertmanager, `wget` for the compose health check.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus-alertmanager wget >/dev/null \
 && rm -rf /var/lib/apt/lists/* \
 && install -d -o nobody -g nogroup -m 0755 /alertmanager
USER nobody
WORKDIR /alertmanager
EXPOSE 9093
ENTRYPOINT ["/usr/bin/prometheus-alertmanager"]
CMD ["--config.file=/etc/alertmanager/alertmanager.yml", "--storage.path=/alertmanager"]
