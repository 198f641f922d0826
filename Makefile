# The two commands the README promises: `make demo` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test races lint bench dist clean

install: $(STAMP)

# The package with what users get (`all`), plus the `dev` dependency group (test, lint and
# bench tools); --group needs pip 25.1 or later, hence the upgrade first.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[all]' --group dev
	touch $(STAMP)

demo: install
	$(BIN)/fenced demo

# The suite spread over TEST_WORKERS processes, one file each at a time (a file's
# servers and workers are started once); most tests wait on servers, not the CPU, so
# six on two cores finish sooner than four (about 5 min against 5 min 50 s here).
TEST_WORKERS ?= 6
test: install tests/npm/node_modules/.installed
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Servers the tests start that pip does not ship (Azurite, for the object store's races),
# from the npm registry at the versions tests/npm/package-lock.json pins. Without npm
# they are skipped outside CI (their tests say how to install them).
tests/npm/node_modules/.installed: tests/npm/package.json tests/npm/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
	  cd tests/npm && npm ci --no-audit --no-fund --loglevel=error && touch node_modules/.installed; \
	else echo "npm not found: the tests that need Azurite are skipped (see tests/npm)"; fi

# The object store's race at full scale (tests/test_store_object_races.py): 16 writers,
# zombies among them stopped past their lease, for RACE_ROUNDS rounds on Azurite; `make
# test` runs 50 of them. Needs Azurite as `make test` does (tests/npm).
RACE_ROUNDS ?= 1000
races: install tests/npm/node_modules/.installed
	FENCED_RACE_ROUNDS=$(RACE_ROUNDS) $(BIN)/pytest -q -p no:cacheprovider -o timeout=1800 tests/test_store_object_races.py

lint: install
	$(BIN)/ruff check src tests benchmarks examples chaos scripts
	$(BIN)/ruff format --check src tests benchmarks examples chaos scripts
	$(BIN)/mypy src tests

# Every benchmark runs; the target fails if any of them missed a target (exit 1).
bench: install
	@fail=0; for b in claim_cycle lifecycle_cost lock_cycle held_claims records_memory aio_cycle metrics_cost celery_throughput celery_flood upsert_rows beat_side_by_side object_publish; do \
	  $(BIN)/python benchmarks/$$b.py || { echo "benchmarks/$$b.py exited $$?"; fail=1; }; \
	done; exit $$fail

# The sdist and the wheel, built by the standard front end and checked: their metadata
# (twine), each extra alone in a fresh virtual environment of its own (the `celery` one runs
# the quick start's worker), then the wheel with every extra, outside the checkout.
DIST_VENV := build/wheel-venv
dist: install
	rm -rf dist build
	$(BIN)/python -m build --outdir dist .
	$(BIN)/twine check --strict dist/*
	$(BIN)/python scripts/check_dist.py dist
	$(BIN)/python scripts/check_extras.py dist
	$(PYTHON) -m venv $(DIST_VENV)
	$(DIST_VENV)/bin/pip install --quiet --upgrade pip
	$(DIST_VENV)/bin/pip install --quiet "$$(ls dist/*.whl)[all]"
	cd /tmp && $(CURDIR)/$(DIST_VENV)/bin/fenced --version
	cd /tmp && $(CURDIR)/$(DIST_VENV)/bin/python -c "import fenced, fenced.aio, fenced.celery, fenced.cli, fenced.metrics, fenced.store, fenced.web, fenced.demo; print('imports: ok', fenced.__file__)"
	cd /tmp && $(CURDIR)/$(DIST_VENV)/bin/fenced demo --walkthrough

clean:
	rm -rf $(VENV) build dist .pytest_cache .mypy_cache .ruff_cache

# Fault injection (chaos/; the README's "Under faults"): five minutes by default.
# CHAOS_SECONDS=60 make chaos; CHAOS_ARGS="--workers 3 --no-celery --no-dedup" (python -m chaos --help).
CHAOS_SECONDS ?= 300
.PHONY: chaos
chaos: install
	CHAOS_SECONDS=$(CHAOS_SECONDS) $(BIN)/python -m chaos $(CHAOS_ARGS)

# The protocol's model (spec/, docs/model.md): Quint from the npm registry, the version
# spec/package-lock.json pins, installed in spec/node_modules; its TypeScript evaluator
# (the default one downloads a binary). At least 10,000 simulated traces with every
# invariant holding, then a counterexample for each limit the docs state.
# MODEL_TRACES, MODEL_SEED ("random" for none), MODEL_JOBS: see spec/check.sh. Last, the
# traces it wrote to spec/traces/ are replayed on the real scripts (tests/test_model_replay.py),
# then on copies of the code with a deliberate fault each (spec/mutants.py): each must fail.
.PHONY: model
model: install spec/node_modules/.installed
	spec/check.sh
	$(BIN)/pytest -q -p no:cacheprovider -n 2 tests/test_model_replay.py
	$(BIN)/python spec/mutants.py --replayed

spec/node_modules/.installed: spec/package.json spec/package-lock.json
	cd spec && npm ci --no-audit --no-fund --loglevel=error
	touch $@
