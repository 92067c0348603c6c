# Everyday commands; each runs what .ci/run runs, or a part of it, in the venv the README makes.
# `make venv` makes that venv (torch pinned first: see README "Try it on a fresh machine").
PY := .venv/bin/python

.PHONY: venv test quick lint format bench

venv:
	python3 -m venv .venv && .venv/bin/pip install -q --upgrade pip && .venv/bin/pip install -q --no-compile torch==2.13.0 -c constraints.txt && .venv/bin/pip install -q --no-compile -e '.[test]' -c constraints.txt && .venv/bin/pip check

test: lint  # the whole suite, as CI runs it
	$(PY) -m pytest -n auto

quick:  # the quick tier: every module, no S3 servers, torchrun, fuzzing, kills or benchmarks
	$(PY) -m pytest -m "not slow" -n auto -q

lint:
	.venv/bin/ruff check rbtool tests benchmarks
	.venv/bin/ruff format --check rbtool tests benchmarks
	.venv/bin/mypy

format:
	.venv/bin/ruff format rbtool tests benchmarks
	.venv/bin/ruff check --fix rbtool tests benchmarks

bench:  # the benchmarks' quick runs (figures side by side, never asserted); see benchmarks/README.md
	$(PY) benchmarks/bench.py --quick
