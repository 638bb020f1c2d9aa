# make demo: create .venv on first use, then run the self-healing demo job under its chaos schedule; it ends by
# printing the path of the run's HTML report (RUN_DIR/report.html: its incidents, heat maps, goodput waterfall).
# The demo runs warm (--warm): a crashed or hung rank, a rollback and a bad host's replacement restart from memory.
# make test: same set-up, then the whole test suite (as root also the multi-host tier on a 4-host namespace bed and
# the container tier: the images built here, docker-compose.yml run under podman).
# make test-fast: only the unit and services tiers (no training job; under 3 minutes on 2 cores).
# make test-multihost: only that tier (root: it brings its own bed up and down).
VENV   ?= .venv
PYTHON ?= python3
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast test-multihost test-containers images bench clean system-deps

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: the CPU wheel on these machines' disk, not a multi-GB CUDA build.
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The libraries the adapter tests train with (pyproject's `adapters` extra), for the test targets only.
ADAPTERS := $(VENV)/.adapters
$(ADAPTERS): $(STAMP)
	$(VENV)/bin/pip install --quiet -e '.[dev,adapters]'
	touch $(ADAPTERS)

demo: $(STAMP)
	GLOO_SOCKET_IFNAME=$${GLOO_SOCKET_IFNAME:-lo} $(VENV)/bin/megaheal run --config configs/demo.yaml --chaos configs/chaos-demo.yaml --warm \
		--rules configs/rules/default.yaml --rules configs/demo/remediation.yaml

# The real services tests run against (Prometheus, Alertmanager, PostgreSQL), from Debian when missing.
system-deps:
	scripts/install-system-deps.sh

# The suite in three pytest runs, the first two at once (scripts/run-tests.sh says why and which tiers).
test: $(ADAPTERS) system-deps
	PYTHON=$(VENV)/bin/python scripts/run-tests.sh

test-fast: $(STAMP) system-deps
	PYTHON=$(VENV)/bin/python scripts/run-tests.sh fast

test-multihost: $(STAMP) system-deps
	$(VENV)/bin/python -m pytest -q -m multihost tests

# The images of docker-compose.yml from Debian's packages and this repository (podman or docker; no registry
# needed): scripts/build-images.sh. It writes their names to build/images.env.
images: $(STAMP)
	PIP=$(VENV)/bin/pip scripts/build-images.sh

# make test-containers: only the container tier (root: builds the images, runs the compose stack under podman).
test-containers: $(STAMP) system-deps
	$(VENV)/bin/python -m pytest -q -m containers tests

bench: $(STAMP)
	$(VENV)/bin/python bench/train_throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache
