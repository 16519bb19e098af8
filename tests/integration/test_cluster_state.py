"""The replicated cluster state (issue 10, OpenAMQ on the same cluster): addresses declared in
config or through the management API reach every node, a node that joins later receives them,
conflicting declarations converge by the documented rule, deletions replicate, the state has a
cap; with ``require-client-key`` clients must present the cluster key.
"""

from __future__ import annotations

import pytest
from proton import ConnectionException, symbol
from proton.utils import BlockingConnection

from tests.brokerproc import ADMIN
from tests.clusterproc import cluster_view, start_cluster, start_node, wait_mesh, wait_until
from tests.serverproc import http_json

pytestmark = pytest.mark.timeout(180)



def declare(node, body) -> tuple[int, object]:
    return http_json(node.management_url + "/api/v1/addresses", method="POST", body=body, auth=ADMIN, timeout_s=10)


def addr(node, name):
    status, addrs = node.management_get("/api/v1/addresses")
    return next((a for a in addrs if a["name"] == name), None)


def test_declared_addresses_reach_every_node_and_late_joiners(tmp_path, procs):
    a, b = start_cluster(tmp_path, 2, config={"addresses.from-config": {"routing-types": ["multicast"]}})
    procs += [a, b]
    wait_mesh([a, b])
    status, body = declare(a, {"name": "shared.orders", "routing_types": ["anycast"], "filter": "color = 'red'"})
    assert status == 201, body
    wait_until(lambda: (b.queue("shared.orders") or {}).get("filter") == "color = 'red'", 20, "B has it")
    late = start_node(tmp_path, "late", static=[b.amqp_url])  # its config declares nothing
    procs.append(late)
    wait_until(lambda: (late.queue("shared.orders") or {}).get("filter") == "color = 'red'", 20, "late joiner")
    wait_until(lambda: {"name": "from-config", "routing_types": ["multicast"], "queues": []}.items()
               <= (addr(late, "from-config") or {}).items(), 20, "config-declared address")
    # auto-created addresses stay on their node
    c = BlockingConnection(a.amqp_url, timeout=10, user="app", password="app", allowed_mechs="PLAIN")
    c.create_sender("auto.made")
    c.close()
    assert addr(a, "auto.made") is not None
    assert all(addr(n, "auto.made") is None for n in (b, late))
    # a deletion replicates as a tombstone
    status, _ = http_json(a.management_url + "/api/v1/addresses/shared.orders", method="DELETE", auth=ADMIN,
                          timeout_s=10)
    assert status == 204
    wait_until(lambda: addr(b, "shared.orders") is None and addr(late, "shared.orders") is None, 20, "deleted")


def test_conflicting_declarations_converge_on_the_latest(tmp_path, procs):
    nodes = start_cluster(tmp_path, 3)
    procs += nodes
    wait_mesh(nodes)
    assert declare(nodes[0], {"name": "q", "filter": "x = 1"})[0] == 201
    wait_until(lambda: all((n.queue("q") or {}).get("filter") == "x = 1" for n in nodes), 20, "x = 1 everywhere")
    assert declare(nodes[2], {"name": "q", "filter": "x = 2"})[0] == 201  # a later declaration wins
    wait_until(lambda: all((n.queue("q") or {}).get("filter") == "x = 2" for n in nodes), 20, "x = 2 everywhere")
    # the same filter declared again with another routing type adds it (Artemis createAddress)
    assert declare(nodes[1], {"name": "q", "routing_types": ["multicast"], "filter": "x = 2"})[0] == 400
    assert declare(nodes[1], {"name": "r", "routing_types": ["anycast"]})[0] == 201
    wait_until(lambda: addr(nodes[2], "r") is not None, 20, "r reaches node 2")
    assert declare(nodes[2], {"name": "r", "routing_types": ["multicast"]})[0] == 201
    wait_until(lambda: all((addr(n, "r") or {}).get("routing_types") == ["anycast", "multicast"] for n in nodes),
               20, "routing types merged")


def test_the_state_has_a_cap(tmp_path, procs):
    a, b = start_cluster(tmp_path, 2, extra={"max-state-bytes": 2048})
    procs += [a, b]
    wait_mesh([a, b])
    made = 0
    for i in range(100):
        status, body = declare(a, {"name": f"address-with-a-longish-name-{i:04d}"})
        if status == 507:
            assert "max-state-bytes" in body["error"]
            break
        assert status == 201
        made += 1
    assert 0 < made < 100
    view = cluster_view(a)["state"]
    assert view["bytes"] <= 2048 and view["addresses"] == made and view["refused"] == 1
    wait_until(lambda: cluster_view(b)["state"]["addresses"] == made, 20, "B holds the same state")


def test_require_client_key(tmp_path, procs):
    a, b = start_cluster(tmp_path, 2, extra={"key": "secret-key", "require-client-key": True})
    procs += [a, b]
    wait_mesh([a, b])  # the cluster's own connections present the key
    with pytest.raises(ConnectionException) as e:
        c = BlockingConnection(a.amqp_url, timeout=10, user="app", password="app", allowed_mechs="PLAIN")
        c.create_sender("x")
    assert "amqp:unauthorized-access" in str(e.value) or "cluster-key" in str(e.value)
    c = BlockingConnection(a.amqp_url, timeout=10, user="app", password="app", allowed_mechs="PLAIN",
                           properties={symbol("cluster-key"): "secret-key"})
    c.create_sender("x")
    c.close()
    assert "require-client-key" in a.stderr_text()
