"""Shared clusters of the fault suite.

Starting a worker costs seconds of CPU, so the scenarios share one
two-prefill, two-decode cluster (`pd22`) for the whole session: prefill-0
and decode-0 are the survivors, prefill-1 and decode-1 the victims that get
killed, hung and restarted. `pd` hands it to a test only after every worker
is running and answering again, so a scenario never inherits another's fault.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdcluster.runtime.pd.compat import CompatInfo
from tests.faults.harness import FaultCluster, PDClient, base_spec
from tests.faults.rogue import fetch_instance


def pd22_spec() -> dict[str, object]:
    spec = base_spec()
    spec["prefill"]["replicas"] = 2  # type: ignore[index]
    spec["decode"]["replicas"] = 2  # type: ignore[index]
    return spec


@pytest.fixture(scope="session")
def pd22_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultCluster]:
    tmp: Path = tmp_path_factory.mktemp("pd22")
    with FaultCluster(tmp, "faults-pd22", pd22_spec()) as cluster:
        yield cluster


def make_ready(cluster: FaultCluster, names: list[str] | None = None) -> FaultCluster:
    """Resume every hung worker, restart the named dead ones (in parallel), wait for health."""
    names = cluster.workers() if names is None else names
    for name in cluster.workers():
        cluster.cont(name)
    for name in names:
        if cluster.launcher.procs[name].poll() is not None:
            cluster.restart(name, wait=False)
    for name in names:
        cluster.wait_healthy(name)
    # A decode holds new rooms on a prefill it declared dead for one probe (and
    # refuses them after an operator report): wait until every decode sees the
    # prefill answering, so no scenario inherits a verdict or its timing.
    alive = [p for p in cluster.workers("prefill") if cluster.launcher.procs[p].poll() is None]
    cluster.wait_seen_answering(alive)
    return cluster


@pytest.fixture
def pd(pd22_cluster: FaultCluster) -> FaultCluster:
    """The shared cluster with every worker alive, resumed and healthy."""
    return make_ready(pd22_cluster)


@pytest.fixture
def client() -> Iterator[PDClient]:
    c = PDClient()
    yield c
    c.close()


@pytest.fixture
def compat(pd: FaultCluster) -> CompatInfo:
    """What the cluster's prefill instances announce (rogue peers copy it to pass the check)."""
    return fetch_instance(pd.bootstrap("prefill-0"), pd.token).compat
