# Python 3.11 on Debian bookworm from Debian's own packages: the base of the megaheal image where python's
# official image cannot be pulled (scripts/build-images.sh). Elsewhere use python:3.11-slim-bookworm.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3 python3-venv >/dev/null \
 && rm -rf /var/lib/apt/lists/*
CMD ["python3"]
