"""Whole deployments on one host, driven through what users do to them: Ray deploys that scale, autoscale and
switch roles, workers killed or paused mid-request, tensor-parallel clusters losing a rank, overload, routing
policies compared, the secure defaults of `pdserve serve`.

Each test starts a cluster of its own, ~20 min in all here, so this folder is collected only when it is named
(`make test-scenarios`, `pytest tests/scenarios/test_faults.py`): a bare `pytest` / `make test` leaves it out
(tests/conftest.py). CI runs `make test-scenarios` after `make test`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

RESULTS_ENV = "PDSERVE_RESULTS_DIR"


@pytest.fixture(scope="session")
def results_dir(tmp_path_factory) -> Path:
    """Where scenarios write their measurements (faults.json, overload.json, soak.json): the directory the
    command names in $PDSERVE_RESULTS_DIR (`PDSERVE_RESULTS_DIR=bench/results make test-scenarios` refreshes the
    committed ones), else this session's temporary directory: a test never writes under the repository unasked."""
    named = os.environ.get(RESULTS_ENV)
    path = Path(named).resolve() if named else tmp_path_factory.mktemp("results")
    path.mkdir(parents=True, exist_ok=True)
    return path
