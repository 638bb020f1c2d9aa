#!/usr/bin/env bash
# Install the real services the tests run against (Debian packages), when they are missing.
# Slurm and munge are for the multi-host test bed, which starts its own daemons from its own config; Chromium is
# for the browser tests of the healer's pages.
# Run by `make test` (and so by .ci/run) on every machine; a no-op where everything is present.
# Tests start and stop their own instances on 127.0.0.1; nothing here starts a service.
set -euo pipefail

need=()
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null 2>&1 && command -v amtool >/dev/null 2>&1 || need+=(prometheus-alertmanager)
# Compose v1 validates docker-compose.yml without a Docker engine (tests/deploy).
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  need+=(postgresql)
fi
# The multi-host test bed (testbed/): Slurm's daemons and clients and munge; the bed starts its own.
command -v slurmd >/dev/null 2>&1 || need+=(slurmd)
command -v slurmctld >/dev/null 2>&1 || need+=(slurmctld)
command -v srun >/dev/null 2>&1 && command -v sinfo >/dev/null 2>&1 || need+=(slurm-client)
command -v munged >/dev/null 2>&1 || need+=(munge)
# The browser tests (tests/pages/) drive Debian's headless Chromium through Playwright (pointed at /usr/bin/chromium:
# a browser download step cannot reach its servers from these machines). chromium-driver is for Selenium/WebDriver.
# The container tier (tests/containers): podman with runc (crun refuses these hosts' cgroups), netavark and
# aardvark-dns (compose's services find each other by name), iptables for netavark, and debootstrap for the Debian
# base image.
command -v podman >/dev/null 2>&1 || need+=(podman)
command -v runc >/dev/null 2>&1 || need+=(runc)
command -v netavark >/dev/null 2>&1 || [ -x /usr/lib/podman/netavark ] || need+=(netavark)
[ -x /usr/lib/podman/aardvark-dns ] || command -v aardvark-dns >/dev/null 2>&1 || need+=(aardvark-dns)
# netavark 1.4 sets up each compose network's NAT and forwarding with iptables (its only firewall driver): without
# it every container start fails with "netavark: No such file or directory".
command -v iptables >/dev/null 2>&1 || need+=(iptables)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)

if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "install-system-deps: missing ${need[*]}; run as root or install them: apt-get install ${need[*]}" >&2
  exit 1
fi
echo "install-system-deps: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
