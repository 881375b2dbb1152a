# Newcomer entry points; see README.md.
PY := .venv/bin/python

.PHONY: setup test test-slow demo proto bench

setup:
	bash scripts/setup.sh

test: setup
	$(PY) -m pytest

test-slow: setup
	$(PY) -m pytest -m slow

demo: setup
	.venv/bin/pdserve generate "What is the capital of France?" --local --max-tokens 32

proto:
	bash scripts/gen_proto.sh

bench: setup
	.venv/bin/pdserve bench engine
