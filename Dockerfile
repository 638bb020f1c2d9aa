# The megaheal image: the healer and the node sidecar (docker-compose.yml runs both from it).
#   docker build -t megaheal:0.1.0 .
FROM python:3.11.11-slim-bookworm

# NOTE: torch pinned and from the CPU index: the sidecar and the healer never run kernels, and PyPI's
# default Linux wheel pulls several GB of CUDA libraries. The NVIDIA runtime provides libnvidia-ml.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY megaheal megaheal
COPY train train
COPY exporters exporters
COPY healer healer
COPY runbooks runbooks
COPY dashboards dashboards
COPY migrations migrations
COPY configs configs
RUN pip install --no-cache-dir .

# Unprivileged by default; the sidecar service in compose needs only the shared socket directory.
RUN useradd --uid 10001 --create-home megaheal
USER megaheal
ENTRYPOINT ["megaheal"]
CMD ["--help"]
