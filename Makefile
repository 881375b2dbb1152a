# Newcomer entry points; see README.md.
PY := .venv/bin/python

.PHONY: setup test test-scenarios test-package test-image test-slow test-multihost lint demo proto bench

setup:
	bash scripts/setup.sh

test: setup
	$(PY) -m pytest

# whole deployments on one host (Ray scaling and role switches, faults, tensor-parallel clusters, overload): tests/scenarios/
test-scenarios: setup
	$(PY) -m pytest tests/scenarios

# the wheel as a user installs it: built, installed into a fresh virtualenv outside the checkout, `pdserve serve`
# on the demo model from a temporary directory (gRPC, OpenAI, status, bench, clean stop): tests/package/
test-package: setup
	$(PY) -m pytest -s tests/package

# the container image of deploy/docker/Dockerfile built with buildah (root; ~10 min warm, ~20 cold; not in CI): tests/image/
test-image: setup
	$(PY) -m pytest -s tests/image

test-slow: setup
	$(PY) -m pytest -m slow tests/scenarios

# hosts as network namespaces (needs root; skipped with a reason otherwise): tests/multihost/
test-multihost: setup
	$(PY) -m pytest -m multihost tests/multihost

lint:
	.venv/bin/ruff check .

# pdserve serve on the demo model (embedded Ray, router + prefill + decode actors), one gRPC and
# one OpenAI HTTP request, then SIGTERM: see scripts/demo.sh
demo: setup
	bash scripts/demo.sh

proto:
	bash scripts/gen_proto.sh

bench: setup
	.venv/bin/pdserve bench engine
