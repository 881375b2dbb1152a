"""Whole deployments on one host, driven through what users do to them: Ray deploys that scale, autoscale and
switch roles, workers killed or paused mid-request, tensor-parallel clusters losing a rank, overload, routing
policies compared, the secure defaults of `pdserve serve`.

Each test starts a cluster of its own, ~20 min in all here, so this folder is collected only when it is named
(`make test-scenarios`, `pytest tests/scenarios/test_faults.py`): a bare `pytest` / `make test` leaves it out
(tests/conftest.py). CI runs `make test-scenarios` after `make test`.
"""
