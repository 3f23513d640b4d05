"""One local Ray cluster for every Ray test (`ray.cluster_utils.Cluster`: several Ray nodes as
processes on this machine): a head node with no CPU to hand out, so that every actor and
replica lands on one of the two 2-CPU worker nodes, as on a real cluster whose driver runs
elsewhere. Started once for this folder (~25 s on a loaded 2-core machine)."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STORE = 80 * 2**20  # object store per node: the tests move a few KiB per step


@pytest.fixture(scope="package")  # its processes stop when this folder is done
def cluster():
    pytest.importorskip("ray")
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False, "object_store_memory": STORE})
    for _ in range(2):
        c.add_node(num_cpus=2, object_store_memory=STORE)
    c.wait_for_nodes()
    # the checkout under test, for every Ray worker process (Serve replicas included)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    ray.init(address=c.address, log_to_driver=False, runtime_env={"env_vars": env})
    yield c
    ray.shutdown()
    c.shutdown()
