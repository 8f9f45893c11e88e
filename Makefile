# The two commands of the README. Both are idempotent: .venv is rebuilt only when
# pyproject.toml or constraints.txt change.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# What `make demo` needs and no more (tally[demo]: the services, the SDK, the simulated fleet and the
# report's plot): no test tools, no docs, no checkov. `make test` installs the rest into the same venv.
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: test lint demo docs docs-serve bench-smoke clean prometheus postgresql gateway-tools images test-containers test-full

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[all,test,docs]'
	# checkov (policy checks of k8s/ and docker/) pins old versions of common packages: own venv.
	test -x $(VENV)/checkov/bin/checkov || { $(PYTHON) -m venv $(VENV)/checkov && \
		$(VENV)/checkov/bin/pip install --quiet checkov==3.3.30; }
	touch $(STAMP)

# The monitoring tests need a real Prometheus and promtool (Debian package `prometheus`); installed
# when missing and apt-get can run (as root, or with passwordless sudo), else those tests skip.
prometheus:
	@command -v promtool >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo "sudo -n"); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
			--no-install-recommends prometheus >/dev/null || echo "prometheus not installed: its tests will skip"; }

# The coordinator-replica tests need a real PostgreSQL server (Debian package `postgresql`): installed
# when missing, as Prometheus is, else those tests skip. They start their own on 127.0.0.1.
postgresql:
	@command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo "sudo -n"); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
			--no-install-recommends postgresql >/dev/null || echo "postgresql not installed: its tests will skip"; }

# The edge gateway's tests run a real SNI router (Debian's haproxy) and the container test pulls the
# images from a real registry (Debian's docker-registry); installed when missing, as Prometheus is.
gateway-tools:
	@command -v haproxy >/dev/null && command -v docker-registry >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo "sudo -n"); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
			--no-install-recommends haproxy docker-registry >/dev/null || echo "haproxy/docker-registry not installed: their tests will skip"; }

# Tests run in TEST_WORKERS processes (pytest-xdist): most of the suite waits on servers, child
# processes and deadlines, so three workers on two cores finish sooner than one (docs/contributing.md).
TEST_WORKERS ?= 3

# The house's rules, checked before any test runs: ruff (pyflakes, pycodestyle, bugbear, pyupgrade,
# isort, logging), mypy --strict on the torch-free layers, and the import contracts (all configured in
# pyproject.toml). PYTHONPATH: lint-imports reads the tree it is run in, not another editable install.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m mypy
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports --no-cache

test: $(STAMP) prometheus postgresql gateway-tools lint
	$(PY) -m pytest -q -m "not containers and not full" -n $(TEST_WORKERS)

# What `make test` runs smaller or leaves out, at full size: the 10,000-device cohort, the attacks at
# 1,000 devices, the algorithms' paper-scale toys, each role's extra in its own venv, jobs through
# device fronts, the population benchmark over PostgreSQL. CI runs it too.
# By file across two workers: a module builds its fixtures once (the per-role venvs take minutes).
# The attacks at 1,000 devices run first and alone: their services and fleet share one process,
# which the other worker's campaigns could starve past the protocol's deadlines.
ALONE := tests/e2e/test_split_view_services.py
test-full: $(STAMP) postgresql
	$(PY) -m pytest -q -m full -p no:cacheprovider $(ALONE)
	$(PY) -m pytest -q -m full -p no:cacheprovider -n 2 --dist loadfile --ignore $(ALONE)

# One image per role (localhost/tally-{aggregator,coordinator,client}), built offline with podman:
# a debootstrap base once, a wheelhouse from this machine's pip (docker/build-images.sh). It needs
# no .venv: any Python with pip builds the wheelhouse. REGISTRY=host[:port]/prefix also pushes them
# there and pins them by digest in k8s/components/images (TLS_VERIFY=false: a plain-HTTP registry).
# PACKAGES="dir ..." installs algorithm and model packages in the coordinator and client images;
# TAG (default: the version) names the images, e.g. TAG=0.1.0-fedavgm beside the plain ones.
images:
	PYTHON=$(PYTHON) REGISTRY=$(REGISTRY) TLS_VERIFY=$(TLS_VERIFY) PACKAGES="$(PACKAGES)" TAG=$(TAG) \
		bash docker/build-images.sh

# The images' contents; the dev overlay's pods run from them with a real Prometheus, the replicas
# overlay's over PostgreSQL, and the edge overlay's pulled from a registry behind an SNI gateway.
test-containers: $(STAMP) images prometheus postgresql gateway-tools
	TALLY_REQUIRE_CONTAINERS=1 $(PY) -m pytest -q -m containers -p no:cacheprovider tests/e2e/test_containers.py

$(DEMO_STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[demo]'
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/tally demo

# The documentation site, into site/; warnings (a broken link, a page outside the navigation) fail it.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The site at http://127.0.0.1:8000/, rebuilt on every edit (search works only when served).
docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8000

bench-smoke: $(STAMP)
	$(PY) bench/secagg_engine.py --clients 20 --dim 1000 --dropout 0.1 --repeat 1 --json $(VENV)/bench-smoke.json

clean:
	rm -rf $(VENV)
