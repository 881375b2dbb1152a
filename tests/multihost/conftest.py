"""Fixtures of the multi-host tests: clusters of namespace hosts, removed whatever happens.

Every test module here sets `pytestmark = pytest.mark.multihost`; the tests are skipped, with the reason, where network namespaces
cannot be made (not root, no `ip netns`).
"""

from __future__ import annotations

import pytest

from bench import net
from tests.multihost.cluster import HostSpec, MultiHostCluster, remove_leftovers


def pytest_collection_modifyitems(config, items) -> None:
    reason = None
    for item in items:
        if "tests/multihost/" not in str(item.fspath):
            continue
        if reason is None:
            reason = net.cannot_make_namespaces() or ""
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def make_cluster():
    """make_cluster([HostSpec, ...]) -> a started MultiHostCluster; every one is torn down after the test."""
    made: list[MultiHostCluster] = []

    def make(specs: list[HostSpec]) -> MultiHostCluster:
        leftovers = remove_leftovers()  # a crashed earlier run must not collide with this one
        if leftovers:
            print(f"removed leftovers of an earlier run: {leftovers}")
        cluster = MultiHostCluster(specs)
        made.append(cluster)
        return cluster.up()

    yield make
    for cluster in made:
        cluster.down()
    assert not net.leftover_namespaces(), "a namespace of the harness survived teardown"
