# The megaheal image: the healer and the node sidecar (docker-compose.yml runs both from it).
#   docker build -t megaheal:0.1.0 .
# On a machine that reaches no image registry, `make images` builds it (and the rest of the stack) from Debian's
# packages and a wheelhouse made on the host: see scripts/build-images.sh.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
FROM ${PYTHON_IMAGE}

# Where pip finds packages: PyPI. build-images.sh points it at a local wheelhouse (a PEP 503 directory it mounts at
# build time).
ARG PIP_INDEX_URL=https://pypi.org/simple

# A virtual environment, not the system's site-packages: Debian's python refuses pip there (PEP 668), and the
# official python image does not mind either way.
ENV VIRTUAL_ENV=/opt/megaheal PATH=/opt/megaheal/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/megaheal

WORKDIR /app
COPY pyproject.toml README.md LICENSE alembic.ini ./
COPY ground ground
COPY wire wire
COPY megaheal megaheal
COPY train train
COPY exporters exporters
COPY healer healer
COPY runbooks runbooks
COPY dashboards dashboards
COPY migrations migrations
COPY configs configs
COPY testbed testbed
COPY sim sim
# NOTE: the core install and the healer extra, no torch: the image runs `megaheal healer` and `megaheal sidecar`,
# neither of which imports it (the trainer extra is for training hosts). The NVIDIA runtime provides libnvidia-ml.
RUN pip install --no-cache-dir --index-url "$PIP_INDEX_URL" ".[healer]"

# Unprivileged by default; the sidecar service in compose needs only the shared socket directory.
RUN useradd --uid 10001 --create-home megaheal
USER megaheal
ENTRYPOINT ["megaheal"]
CMD ["--help"]
