#!/usr/bin/env bash
# Build the images of docker-compose.yml on a machine that cannot pull from an image registry, from sources it can
# reach: a Debian base made with debootstrap, Prometheus, Alertmanager and PostgreSQL from Debian's packages, and
# the megaheal image (healer and sidecar) from this repository with a wheelhouse pip makes on the host.
# `make images` runs it; podman or docker, whichever is present (CONTAINER_ENGINE=... to choose).
#
#   MEGAHEAL_BASE_IMAGE=debian:bookworm-slim scripts/build-images.sh   # start from an image you can pull instead
#
# It ends by writing build/images.env: the image names for docker-compose.yml (copy its lines into .env, or pass
# `--env-file build/images.env`). Grafana, Tempo and the OpenTelemetry Collector have no Debian package: their
# images come from their registries or not at all (the stack runs without them; docs/operations.md).
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
engine=${CONTAINER_ENGINE:-$(command -v podman || command -v docker || true)}
if [ -z "$engine" ]; then
  echo "build-images: neither podman nor docker is installed" >&2
  exit 1
fi
engine_name=$(basename "$engine")
if [ "$engine_name" = podman ] && [ -z "${CONTAINERS_CONF:-}" ]; then
  # runc, cgroupfs and lower ulimits: what podman needs on hosts without systemd (deploy/podman/containers.conf).
  export CONTAINERS_CONF="$here/deploy/podman/containers.conf"
fi
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
pip=${PIP:-$here/.venv/bin/pip}
images=deploy/images
out=build

base=${MEGAHEAL_BASE_IMAGE:-localhost/megaheal/debian:bookworm}
# NOTE: `image inspect`, not podman's `image exists`: docker has only the former.
if [ -z "${MEGAHEAL_BASE_IMAGE:-}" ] && ! "$engine" image inspect "$base" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null || { echo "build-images: debootstrap is needed for the base image (or set MEGAHEAL_BASE_IMAGE)" >&2; exit 1; }
  [ "$(id -u)" -eq 0 ] || { echo "build-images: debootstrap needs root (or set MEGAHEAL_BASE_IMAGE)" >&2; exit 1; }
  # The archive this host's apt uses (a mirror where there is one).
  mirror=$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1)
  mirror=${mirror:-http://deb.debian.org/debian}
  rootfs=$(mktemp -d "${TMPDIR:-/tmp}/megaheal-rootfs.XXXXXX")
  trap 'rm -rf "$rootfs"' EXIT
  echo "build-images: debootstrap bookworm from $mirror"
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$out-debootstrap.log" 2>&1 \
    || { echo "build-images: debootstrap failed; its log: $out-debootstrap.log" >&2; exit 1; }
  rm -f "$out-debootstrap.log"
  tar -C "$rootfs" -c . | "$engine" import - "$base" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
fi

build() {  # build TAG DOCKERFILE [ARGS...]
  local tag=$1 file=$2
  shift 2
  echo "build-images: $tag"
  # The host's network for the build's apt and pip: a build needs no network of its own.
  local log rc=0
  log=$(mktemp)
  "$engine" build --quiet --network host --tag "$tag" --file "$file" "$@" >/dev/null 2>"$log" || rc=$?
  grep -v "^debconf: delaying package configuration" "$log" >&2 || true
  rm -f "$log"
  [ "$rc" -eq 0 ] || { echo "build-images: building $tag failed (exit $rc)" >&2; exit 1; }
}
mkdir -p "$out"
build localhost/megaheal/prometheus:bookworm "$images/prometheus.Dockerfile" --build-arg "BASE_IMAGE=$base" "$images"
build localhost/megaheal/alertmanager:bookworm "$images/alertmanager.Dockerfile" --build-arg "BASE_IMAGE=$base" "$images"
build localhost/megaheal/postgres:15-bookworm "$images/postgres.Dockerfile" --build-arg "BASE_IMAGE=$base" "$images"
build localhost/megaheal/python:3.11-bookworm "$images/python.Dockerfile" --build-arg "BASE_IMAGE=$base" "$images"

python_args=(--build-arg PYTHON_IMAGE=localhost/megaheal/python:3.11-bookworm)
if [ "$engine_name" = podman ]; then
  # Every wheel the image needs, from the host's own pip (its index, its cache, its local wheels), laid out as a
  # PEP 503 index that the build reads through a mount: the build itself needs no network. Docker's build has no
  # mounts of this kind: with docker the image's pip reaches PyPI itself. The image installs '.[healer]' (no torch).
  wheels=$out/wheelhouse
  rm -rf "$wheels" && mkdir -p "$wheels/files" "$wheels/simple"
  # NOTE: setuptools too: pip builds megaheal in the image in an isolated environment that needs it (pyproject's
  # build-system), and no dependency brings it since torch left the image.
  "$pip" wheel --quiet --wheel-dir "$wheels/files" '.[healer]' 'setuptools>=77' 2>&1 | grep -v "^WARNING: Location" >&2 || true
  for whl in "$wheels"/files/*.whl; do
    file=$(basename "$whl")
    name=$(printf '%s' "$file" | cut -d- -f1 | tr 'A-Z_.' 'a-z--')
    mkdir -p "$wheels/simple/$name"
    ln "$whl" "$wheels/simple/$name/"
    # pip reads a file:// index through its pages, not a directory listing.
    printf '<a href="%s">%s</a>\n' "$file" "$file" >>"$wheels/simple/$name/index.html"
  done
  python_args+=(--volume "$here/$wheels:/wheelhouse:ro"
                --build-arg PIP_INDEX_URL=file:///wheelhouse/simple)
fi
build "megaheal:$version" Dockerfile "${python_args[@]}" .

cat >"$out/images.env" <<ENV
# Written by scripts/build-images.sh: the images it built, for docker-compose.yml.
PROMETHEUS_IMAGE=localhost/megaheal/prometheus:bookworm
ALERTMANAGER_IMAGE=localhost/megaheal/alertmanager:bookworm
POSTGRES_IMAGE=localhost/megaheal/postgres:15-bookworm
MEGAHEAL_VERSION=$version
ENV
echo "build-images: done; image names in $out/images.env"
