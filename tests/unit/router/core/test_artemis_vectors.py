"""Every row of the Artemis sample vectors (tests/vectors, copied from ../shared/artemis-vectors)
run through the public API in Artemis-exact mode (HASH=FNV1A, VIRTUAL_NODES=1, artemis_keys)."""

from __future__ import annotations

import csv
import json

import pytest

from router.core.cache import StickyCache
from router.core.decide import Outcome, Router
from router.core.filters import compile_key_filter, compile_local_filter
from router.core.keys import ConnectionInfo, KeyResolver, KeyType
from router.core.pool import Pool, TargetState
from router.policies import Target, create_policy, fnv1a_utf16
from tests.paths import VECTORS



def rows(name: str) -> list[dict[str, str]]:
    with (VECTORS / name).open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))


def jload(s: str):
    return json.loads(s) if s != "" else None


def row_id(r: dict) -> str:
    return "|".join(v[:24] for v in r.values())


FNV = rows("fnv_raw_vectors.tsv")
HASH = rows("hash_vectors.tsv")
KEYS = rows("key_resolver_vectors.tsv")
ROUTER = rows("router_vectors.tsv")
SETS = rows("target_sets.tsv")


def test_vector_files_are_all_there():
    assert len(FNV) >= 45 and len(HASH) >= 800 and len(KEYS) >= 140 and len(ROUTER) >= 45
    assert len(SETS) >= 13


@pytest.mark.parametrize("r", FNV, ids=row_id)
def test_fnv1a_utf16_matches_java_getHash(r):
    key = json.loads(r["key_json"])
    assert fnv1a_utf16(key) == int(r["java_getHash_int32"])
    assert fnv1a_utf16(key) & 0xFFFFFFFF == int(r["java_getHash_uint32_hex"], 16)


@pytest.mark.parametrize("r", SETS, ids=row_id)
def test_target_set_node_hashes(r):
    assert fnv1a_utf16(r["node_id"]) == int(r["java_getHash_int32"])


ARTEMIS_HASH = {"HASH": "FNV1A", "VIRTUAL_NODES": "1"}


@pytest.mark.parametrize("r", HASH, ids=row_id)
def test_hash_vectors(r):
    key = json.loads(r["key_json"])
    assert fnv1a_utf16(key) == int(r["key_hash_int32"])
    if r["policy"] == "CONSISTENT_HASH":
        ids = [x for x in r["target_node_ids"].split(";") if x]
        assert len(ids) == int(r["param"])
        targets = [Target(node_id=n, host="h", port=5672 + i, name=f"t{i}")
                   for i, n in enumerate(ids)]
        policy = create_policy("CONSISTENT_HASH", ARTEMIS_HASH)
        assert policy.transform_key(key) == key
        got = policy.select_target(targets, key)
        expected = int(r["expected"])
        assert (targets.index(got) if got is not None else -1) == expected
    else:
        assert r["policy"] == "CONSISTENT_HASH_MODULO"
        policy = create_policy("CONSISTENT_HASH_MODULO", {"MODULO": r["param"], "HASH": "FNV1A"})
        expected = key if r["expected"] == "UNCHANGED" else r["expected"]
        assert policy.transform_key(key) == expected
        assert policy.select_target([Target("n", "h", 1)], key) is None


def conn_for(key_type: KeyType, value) -> ConnectionInfo:
    if key_type is KeyType.CLIENT_ID:
        return ConnectionInfo(source="10.0.0.1:1", container_id=value)
    if key_type is KeyType.USER_NAME:
        return ConnectionInfo(source="10.0.0.1:1", user=value)
    if key_type is KeyType.SNI_HOST:
        return ConnectionInfo(source="10.0.0.1:1", sni_host=value)
    if key_type is KeyType.SOURCE_IP:
        return ConnectionInfo(source=value)
    # ROLE_NAME: "<insertion order> | iteration order: <HashSet order>"; Artemis iterates the
    # HashSet, we iterate roles as listed, so list them in Artemis's iteration order.
    if value is None:
        return ConnectionInfo(source="10.0.0.1:1", roles=())
    order = value.split("| iteration order:")[1].strip()
    return ConnectionInfo(source="10.0.0.1:1",
                          roles=tuple(x for x in order.split(",") if x) if order else ())


@pytest.mark.parametrize("r", KEYS, ids=row_id)
def test_key_resolver_vectors(r):
    kt = KeyType.parse(r["key_type"])
    # sni_lowercase=False: the vectors exercise Artemis's KeyResolver alone; in Artemis the Netty
    # SNI handler lower-cases first, which is what our default (sni_lowercase=True) reproduces.
    resolver = KeyResolver(kt, compile_key_filter(jload(r["key_filter_json"])),
                           artemis_keys=True, sni_lowercase=False)
    _raw, key = resolver.resolve(conn_for(kt, jload(r["input_json"])))
    assert key == json.loads(r["expected_key_json"])


UUIDS = [r["node_id"] for r in SETS if r["set"] == "uuids"]


def parse_java_map(s: str) -> dict[str, str]:
    s = s.strip()
    assert s[0] == "{" and s[-1] == "}"
    out = {}
    for part in s[1:-1].split(", "):
        k, _, v = part.partition("=")
        out[k] = v
    return out


@pytest.mark.parametrize("r", ROUTER, ids=row_id)
def test_router_vectors(r):
    assert r["key_type"] == "CLIENT_ID"
    local_target = Target(node_id="local-node-id", host="localhost", port=61616, name="local")
    pool_ids = [x for x in r["pool_node_ids"].split(";") if x]
    policy = None
    if r["policy"]:
        props = dict(ARTEMIS_HASH) if r["policy"] == "CONSISTENT_HASH" else {}
        if r["policy"] == "CONSISTENT_HASH_MODULO":
            props = {"MODULO": r["policy_param"], "HASH": "FNV1A"}
        policy = create_policy(r["policy"], props)
    pool = None
    local = TargetState(local_target, local=True)
    if pool_ids:
        pool = Pool([Target(n, "h", 5672 + i, name=f"t{i}") for i, n in enumerate(pool_ids)],
                    quorum_size=0, local_target=local_target)
        for i in range(len(pool_ids)):
            pool.set_ready(f"t{i}", True)
        local = pool.local
    local.ready = True  # Artemis's local target is always ready
    cache = None
    if r["cache"].startswith("preloaded"):
        cache = StickyCache(0)
        cache.put("client-1", UUIDS[2], 0.0)
        cache.put("client-2", "gone-node-id", 0.0)
    else:
        assert r["cache"] == "none"
    resolver = KeyResolver(KeyType.CLIENT_ID, compile_key_filter(jload(r["key_filter_json"])),
                           artemis_keys=True)
    router = Router("r", resolver, policy=policy, pool=pool, cache=cache, local=local,
                    local_filter=compile_local_filter(jload(r["local_target_filter_json"]),
                                                      from_config=True))
    d = router.decide(ConnectionInfo(source="10.0.0.1:1",
                                     container_id=jload(r["input_json"])), now=1.0)
    assert d.outcome is Outcome[r["result_status"]]
    if d.outcome is Outcome.OK:
        assert d.target.node_id == r["result_node_id"]
        assert d.local == (r["result_node_id"] == "local-node-id")
    else:
        assert d.target is None and r["result_node_id"] == ""
    if r["cache_after_json"]:
        after = parse_java_map(json.loads(r["cache_after_json"]))
        assert {k: e[0] for k, e in cache.entries.items()} == after
