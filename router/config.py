"""Router configuration: ``etc/router.toml`` → frozen dataclasses (+ Artemis ``broker.xml`` import).

``load_router_config(path) -> RouterProcessConfig`` reads the whole router process file (name,
users file, management, routing log, acceptors, workers, routers). Every error is a
``broker.wire.io.tomlconfig.ConfigError`` naming file, dotted key and value, e.g.::

    etc/router.toml: routers.main.pool.quorum-size: 0 must be > 0

Key names follow Artemis's XML (hyphens); times keep the Artemis names ``check-period``,
``quorum-timeout`` and ``timeout`` and are milliseconds. Defaults are Artemis's: key-type
SOURCE_IP, check-period 5000, quorum-size 1, quorum-timeout 3000, cache timeout 0 (never).

``import_artemis_xml(path)`` maps ``<connection-routers>``, ``<connectors>`` and
``<discovery-groups>`` of an Artemis ``broker.xml`` (parsed with defusedxml) onto the same
``RouterConfig`` model, choosing the Artemis-exact settings: ``HASH = FNV1A``, ``VIRTUAL_NODES = 1``
and Artemis key resolution (``artemis-keys = true``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import parse_qsl, urlsplit

from broker.wire.limits import SourceLimits, source_limits_from
from broker.wire.io.tomlconfig import ConfigError, Table, open_config

from router.core.filters import compile_key_filter, compile_local_filter
from router.core.keys import KeyType
from router.core.policies import Target, create_policy
from router.core.pool import membership_source_names
from router import cluster_source  # noqa: F401  (registers the "cluster" membership source)
from router import discovery_source  # noqa: F401  (registers the "discovery" membership source)
from router.errors import FilterError, MembershipSourceError, PolicyError
from defusedxml import ElementTree as DET
from defusedxml.common import DefusedXmlException

ARTEMIS_DEFAULTS = {"key-type": "SOURCE_IP", "check-period": 5000, "quorum-size": 1,
                    "quorum-timeout": 3000, "timeout": 0}
SASL_MECHANISMS = ("PLAIN", "EXTERNAL", "ANONYMOUS")
CACHE_BACKENDS = ("memory", "embedded", "redis")


# -- model ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ManagementConfig:
    host: str = "127.0.0.1"
    port: int = 8160
    user: str | None = None
    password: str | None = None


@dataclass(frozen=True)
class RoutingLogConfig:
    path: Path | None = None
    max_bytes: int = 10 * 1024 * 1024
    backups: int = 5
    enabled: bool = True
    max_field_chars: int = 1024             # longer string fields are truncated (marked)


@dataclass(frozen=True)
class AcceptorConfig:
    name: str
    host: str
    port: int
    router: str
    mode: str = "redirect"                 # "redirect" | "proxy" | "auto"
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    upstream_tls: bool = False
    upstream_ca: Path | None = None
    max_connections: int = 10000           # 0 = no limit
    handshake_timeout_ms: int = 10000
    connect_timeout_ms: int = 5000
    idle_timeout_s: float = 0              # 0 = none
    tcp_user_timeout_ms: int = 30000       # TCP_USER_TIMEOUT on both sockets; 0 = the OS's
    connect_retries: int = 2               # proxy: other brokers tried when the chosen one fails first
    upstream_close_grace_ms: int = 1000    # proxy: the client's time to close after its broker ended
    tls_handshake_timeout_ms: int = 5000
    sasl_mechanisms: tuple[str, ...] = ("PLAIN", "EXTERNAL")
    anonymous: bool = False
    limits: SourceLimits = SourceLimits()  # per-source limits (broker.wire.limits)
    upstream_proxy_protocol: bool = False  # proxy mode: PROXY v2 header with the client's address


@dataclass(frozen=True)
class TargetConfig:
    name: str
    host: str
    port: int
    tls: bool = False
    management_url: str | None = None
    node_id: str | None = None
    username: str | None = None             # management API credentials of this target,
    password: str | None = None             # overriding the pool's
    #: imported from a broker.xml <connector>: Artemis's TransportConfiguration params and
    #: extraProps for it (management getTargetAsJSON shows them); None for TOML targets
    connector_params: tuple[tuple[str, str], ...] | None = None
    connector_extra: tuple[tuple[str, str], ...] | None = None
    #: an HA backup: the name of the pool target (its primary) whose node id it serves when active
    backup_of: str | None = None
    #: the HA pair this target is a member of (its primary's name; set on the primary too)
    pair: str | None = None

    def to_target(self) -> Target:
        return Target(self.node_id, self.host, self.port, self.tls, self.management_url, self.name,
                      self.pair, self.backup_of is not None)


@dataclass(frozen=True)
class PoolConfig:
    check_period_ms: int = 5000
    quorum_size: int = 1
    quorum_timeout_ms: int = 3000
    local_target_enabled: bool = False
    username: str | None = None
    password: str | None = None
    targets: tuple[TargetConfig, ...] = ()
    source: str = "static"
    #: dynamic sources' options: cluster = {"seed-connectors": (url, ...), "leave-after-ms": int};
    #: discovery = the checked ``[...pool.discovery-group]`` (``discovery_source.check_options``)
    source_options: Mapping[str, object] = field(default_factory=dict)
    #: False: a target that went down and comes back waits for an operator's readmit while
    #: another serves (``router.core.pool``; docs/site-failover.md)
    allow_failback: bool = True
    #: where the held targets are kept across restarts (only with allow_failback = False)
    state_path: Path | None = None
    #: a drained target's clients leave at this rate (``router.drain``), after the grace
    drain_rate_per_s: float = 10.0
    drain_grace_ms: int = 0


@dataclass(frozen=True)
class PolicyConfig:
    name: str
    properties: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CacheConfig:
    timeout_ms: int = 0                     # 0 = never expire
    persisted: bool = False
    backend: str = "memory"                 # "memory" | "embedded" | "redis"
    path: Path | None = None                # embedded file
    redis_url: str | None = None
    redis_key_prefix: str = "lodestone:"
    redis_timeout_ms: int = 50
    max_entries: int = 100_000              # least recently used evicted beyond this
    redis_connect_timeout_ms: int = 1000
    fail_back: str = "stay"                 # "stay" (Artemis) | "return": see docs/configuration.md


@dataclass(frozen=True)
class PinsConfig:
    file: Path


@dataclass(frozen=True)
class RouterConfig:
    name: str
    key_type: KeyType = KeyType.SOURCE_IP
    key_filter: str | None = None
    local_target_filter: str | None = None
    artemis_keys: bool = False
    policy: PolicyConfig | None = None
    cache: CacheConfig | None = None
    pool: PoolConfig | None = None
    local_target: TargetConfig | None = None
    pins: PinsConfig | None = None
    file: Path | None = None
    max_key_length: int = 255               # longer keys are refused (never hashed/truncated)
    root_target_filter: str | None = None    # keys (full match) sent to the cluster's root (OpenAMQ)


@dataclass(frozen=True)
class RouterProcessConfig:
    name: str = "router"
    users_file: Path | None = None
    management: ManagementConfig = ManagementConfig()
    routing_log: RoutingLogConfig = RoutingLogConfig()
    acceptors: tuple[AcceptorConfig, ...] = ()
    workers: int = 1                        # 0 = one per core
    routers: Mapping[str, RouterConfig] = field(default_factory=dict)
    file: Path | None = None


# -- TOML -------------------------------------------------------------------------------------
def load_router_config(path: str | Path, data: bytes | None = None) -> RouterProcessConfig:
    """Read a router TOML file (``data``: its content, read earlier: a worker of a multi-worker
    router runs the text its supervisor has in force); raises ConfigError (file, key, value) on
    any problem."""
    root = open_config(path, data)
    file = root.file
    name = root.str("name", "router")
    users_file = root.path_value("users-file", None)
    if users_file is not None and not users_file.is_file():
        raise ConfigError(file, "users-file", f"{str(users_file)!r}: no such file")
    workers = root.int("workers", 1, min=0)
    management = _management(root.table("management"))
    routing_log = _routing_log(root.table("routing-log"))
    routers: dict[str, RouterConfig] = {}
    for rname, t in root.tables("routers").items():
        routers[rname] = _router(rname, t)
    xml, xml_kw = _import_artemis_xml_settings(root)
    if xml is not None:
        for rname, rc in import_artemis_xml(xml, **xml_kw).items():
            if rname in routers:
                raise root.error("import-artemis-xml",
                                 f"router {rname!r} from {xml} is also defined in [routers]")
            routers[rname] = rc
    acceptors = []
    seen: set[str] = set()
    for t in root.array_of_tables("acceptors"):
        acc = _acceptor(t)
        if acc.name in seen:
            raise t.error("name", f"{acc.name!r} is used by two acceptors")
        seen.add(acc.name)
        if acc.router not in routers:
            raise t.error("router", f"{acc.router!r} is not a router defined in [routers] "
                                    f"(defined: {', '.join(routers) or 'none'})")
        acceptors.append(acc)
    if not routers:
        raise ConfigError(file, "routers", "no router defined (add a [routers.<name>] table)")
    for rname, rc in routers.items():
        if rc.max_key_length > routing_log.max_field_chars:
            raise ConfigError(file, f"routers.{rname}.max-key-length",
                              f"{rc.max_key_length} must be <= routing-log.max-field-chars "
                              f"({routing_log.max_field_chars}), so accepted keys are logged whole")
    root.done()
    return RouterProcessConfig(name, users_file, management, routing_log, tuple(acceptors),
                               workers, routers, file)


def _import_artemis_xml_settings(root: Table) -> tuple[Path | None, dict[str, Any]]:
    """``import-artemis-xml = "broker.xml"`` or the table form, which adds what broker.xml does
    not say: ``[import-artemis-xml.local-target]`` (the broker this router stands for, as
    ``[routers.<r>.local-target]``; needed by ``local-target-filter`` / ``local-target-enabled``)
    and ``[import-artemis-xml.connectors.<connector name>]`` with ``node-id`` and
    ``management-url`` for that connector's target."""
    if not root.has("import-artemis-xml"):
        return None, {}
    if not isinstance(root.data["import-artemis-xml"], dict):
        return root.path_value("import-artemis-xml"), {}
    t = root.table("import-artemis-xml")
    xml = t.path_value("file")
    local = _target(t.table("local-target"), "local") if t.has("local-target") else None
    node_ids: dict[str, str] = {}
    urls: dict[str, str] = {}
    for cname, ct in t.tables("connectors").items():
        nid = ct.str("node-id", None)
        url = _mgmt_url(ct, "management-url")
        ct.done()
        if nid is not None:
            node_ids[cname] = nid
        if url is not None:
            urls[cname] = url
    t.done()
    return xml, {"local_target": local, "node_ids": node_ids, "management_urls": urls,
                 "settings_where": (root.file, "import-artemis-xml")}


def _management(t: Table) -> ManagementConfig:
    m = ManagementConfig(t.str("host", "127.0.0.1"), t.int("port", 8160, min=0, max=65535),
                         t.str("user", None), t.str("password", None))
    t.done()
    return m


def parse_routing_log_table(t: Table) -> RoutingLogConfig:
    """``[routing-log]`` (the router's, and a broker's with an embedded router)."""
    return _routing_log(t)


def _routing_log(t: Table) -> RoutingLogConfig:
    r = RoutingLogConfig(t.path_value("path", None), t.int("max-bytes", 10 * 1024 * 1024, min=1),
                         t.int("backups", 5, min=0), t.bool("enabled", True),
                         t.int("max-field-chars", 1024, min=64))
    t.done()
    return r


def _acceptor(t: Table) -> AcceptorConfig:
    tls_cert, tls_key = t.path_value("tls-cert", None), t.path_value("tls-key", None)
    if (tls_cert is None) != (tls_key is None):
        raise t.error("tls-key" if tls_key is None else "tls-cert",
                      "missing: tls-cert and tls-key go together")
    mechs = t.str_list("sasl-mechanisms", ["PLAIN", "EXTERNAL"])
    for i, m in enumerate(mechs):
        if m not in SASL_MECHANISMS:
            raise t.error(f"sasl-mechanisms[{i}]",
                          f"{m!r} must be one of {', '.join(SASL_MECHANISMS)}")
    idle = t.float("idle-timeout-s", 0.0, min=0.0)
    acc = AcceptorConfig(
        name=t.str("name"), host=t.str("host", "127.0.0.1"),
        port=t.int("port", min=0, max=65535), router=t.str("router"),
        mode=t.choice("mode", ("redirect", "proxy", "auto"), "redirect"),
        tls_cert=tls_cert, tls_key=tls_key, tls_client_ca=t.path_value("tls-client-ca", None),
        upstream_tls=t.bool("upstream-tls", False), upstream_ca=t.path_value("upstream-ca", None),
        max_connections=t.int("max-connections", 10000, min=0),
        handshake_timeout_ms=t.int("handshake-timeout-ms", 10000, min=1),
        connect_timeout_ms=t.int("connect-timeout-ms", 5000, min=1),
        idle_timeout_s=idle, tls_handshake_timeout_ms=t.int("tls-handshake-timeout-ms", 5000, min=1),
        tcp_user_timeout_ms=t.int("tcp-user-timeout-ms", 30000, min=0, max=2**31 - 1),
        connect_retries=t.int("connect-retries", 2, min=0, max=16),
        upstream_close_grace_ms=t.int("upstream-close-grace-ms", 1000, min=50, max=60000),
        sasl_mechanisms=tuple(mechs), anonymous=t.bool("anonymous", False), limits=source_limits_from(t),
        upstream_proxy_protocol=t.bool("upstream-proxy-protocol", False))
    t.done()
    if acc.upstream_proxy_protocol and acc.mode == "redirect":
        raise t.error("upstream-proxy-protocol",
                      "true needs mode = \"proxy\" or \"auto\" (a redirect opens no upstream)")
    return acc


def _regex(t: Table, key: str, *, local: bool) -> str | None:
    value = t.str(key, None)
    if value is None:
        return None
    try:
        compile_local_filter(value, from_config=True) if local else compile_key_filter(value)
    except FilterError as exc:
        raise t.error(key, str(exc)) from None
    return value


def _mgmt_url(t: Table, key: str) -> str | None:
    url = t.str(key, None)
    if url is not None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise t.error(key, f"{url!r} must be an http:// or https:// URL")
    return url


def _target(t: Table, default_name: str | None = None, *, pool: bool = False) -> TargetConfig:
    if not pool and t.has("backup-of"):
        raise t.error("backup-of", "only a pool target can be a backup (of another pool target)")
    host = t.str("host")
    port = t.int("port", min=1, max=65535)
    tc = TargetConfig(name=t.str("name", default_name or f"{host}:{port}"), host=host, port=port,
                      tls=t.bool("tls", False), management_url=_mgmt_url(t, "management-url"),
                      node_id=t.str("node-id", None), username=t.str("username", None),
                      password=t.str("password", None), backup_of=t.str("backup-of", None))
    t.done()
    return tc


def _pairs(t: Table, targets: tuple[TargetConfig, ...]) -> tuple[TargetConfig, ...]:
    """Check ``backup-of`` and mark both members of each HA pair with the pair's name (the
    primary's): a backup names a target listed before it that is no backup itself, both have a
    management URL (only the broker's API tells an active member from a passive one), and the
    node id is the primary's to give."""
    index = {tc.name: i for i, tc in enumerate(targets)}
    primaries: set[str] = set()
    for i, tc in enumerate(targets):
        if tc.backup_of is None:
            continue
        where = f"targets[{i}]"
        j = index.get(tc.backup_of)
        if j is None or j == i:
            raise t.error(f"{where}.backup-of", f"{tc.backup_of!r} names no other target of this pool")
        if j > i:
            raise t.error(f"{where}.backup-of", f"{tc.backup_of!r} must be listed before its backup "
                                                f"{tc.name!r}")
        if targets[j].backup_of is not None:
            raise t.error(f"{where}.backup-of", f"{tc.backup_of!r} is itself a backup (of "
                                                f"{targets[j].backup_of!r}): name the primary")
        if tc.node_id is not None:
            raise t.error(f"{where}.node-id", f"{tc.node_id!r}: a backup serves its primary's node "
                                              f"id; set node-id on {tc.backup_of!r}")
        for k, m in ((i, tc), (j, targets[j])):
            if m.management_url is None:
                raise t.error(f"targets[{k}].management-url",
                              f"missing: {m.name!r} is a member of the pair {tc.backup_of!r} (only "
                              "its management API tells an active member from a passive backup)")
        primaries.add(tc.backup_of)
    if not primaries:
        return targets
    return tuple(replace(tc, pair=tc.backup_of or tc.name)
                 if (tc.backup_of or tc.name) in primaries else tc for tc in targets)


def _prop_value(t: Table, key: str) -> str:
    v = t.get(key, (str, int, float, bool))
    return str(v).lower() if isinstance(v, bool) else str(v)


def _policy(t: Table) -> PolicyConfig:
    name = t.str("name")
    props_t = t.table("properties")
    props = {k: _prop_value(props_t, k) for k in list(props_t.keys())}
    props_t.done()
    try:
        create_policy(name, props)
    except PolicyError as exc:
        msg = str(exc)
        m = re.search(r"propert(?:y|ies) '?([A-Za-z0-9_\-]+)'?", msg)
        if msg.startswith("no policy named"):
            raise t.error("name", msg) from None
        if m and m.group(1) in props:
            raise props_t.error(m.group(1), f"{props[m.group(1)]!r}: {msg}") from None
        raise t.error("properties", msg) from None
    t.done()
    return PolicyConfig(name, props)


def _without_password(url: str) -> str:
    """``url`` for an error message: a password in it shown as ``***``."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
        return parts._replace(netloc=netloc).geturl()
    except ValueError:
        return "<unparsable URL>"


def _cache(t: Table, router: str, default_dir: Path | None = None) -> CacheConfig:
    timeout = t.int("timeout", 0, min=0)
    persisted = t.bool("persisted", False)
    backend = t.choice("backend", CACHE_BACKENDS, "embedded" if persisted else "memory")
    if backend == "memory" and persisted:
        raise t.error("backend", "'memory' cannot be persisted (use 'embedded' or 'redis')")
    if backend == "embedded":
        persisted = True
    path = t.path_value("path", None)
    if path is not None and backend != "embedded":
        raise t.error("path", f"{str(path)!r} is only used with backend = 'embedded'")
    if backend == "embedded" and path is None:
        path = (default_dir or t.file.parent) / f"router-cache-{router}.log"
    redis_url = t.str("redis-url", None)
    if backend == "redis":
        if redis_url is None:
            raise t.error("redis-url", "missing (required with backend = 'redis')")
        if urlsplit(redis_url).scheme not in ("redis", "rediss", "unix"):
            raise t.error("redis-url", f"{_without_password(redis_url)!r} must be a redis://, rediss:// or unix:// URL")
    elif redis_url is not None:
        raise t.error("redis-url", f"{_without_password(redis_url)!r} is only used with backend = 'redis'")
    c = CacheConfig(timeout, persisted, backend, path, redis_url,
                    t.str("redis-key-prefix", "lodestone:"), t.int("redis-timeout-ms", 50, min=1),
                    t.int("max-entries", 100_000, min=1),
                    t.int("redis-connect-timeout-ms", 1000, min=1),
                    t.choice("fail-back", ("stay", "return"), "stay"))
    t.done()
    return c


def _failback(t: Table, router: str, default_dir: Path | None) -> dict:
    """``allow-failback`` and, with it false, ``state-path`` (the held targets across restarts;
    default ``router-pool-<router>.json`` beside the config)."""
    allow = t.bool("allow-failback", True)
    path = t.path_value("state-path", None)
    if path is not None and allow:
        raise t.error("state-path", f"{str(path)!r} is only used with allow-failback = false")
    if not allow and path is None:
        path = (default_dir or t.file.parent) / f"router-pool-{router}.json"
    return {"allow_failback": allow, "state_path": path,
            "drain_rate_per_s": t.float("drain-rate-per-s", 10.0, min=0.01),
            "drain_grace_ms": t.int("drain-grace-ms", 0, min=0)}


def _pool(t: Table, embedded: bool = False, router: str = "", default_dir: Path | None = None
          ) -> PoolConfig:
    source = t.str("source", "static")
    if embedded and source == "cluster":
        return _broker_cluster_pool(t, router, default_dir)
    if source not in membership_source_names():
        raise t.error("source", f"{source!r} is not available (known: "
                                f"{', '.join(membership_source_names())})")
    targets = tuple(_target(tt, pool=True) for tt in t.array_of_tables("targets"))
    names = set()
    for i, tc in enumerate(targets):
        if tc.name in names:
            raise t.error(f"targets[{i}].name", f"{tc.name!r} is used by two targets")
        names.add(tc.name)
    targets = _pairs(t, targets)
    options: dict = {}
    if source == "cluster":
        if targets:
            raise t.error("targets", "a cluster pool takes its targets from the cluster "
                                     "(use seed-connectors)")
        seeds = t.str_list("seed-connectors", [])
        if not seeds:
            raise t.error("seed-connectors", "a cluster pool needs at least one broker "
                                             "management URL")
        for i, url in enumerate(seeds):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise t.error(f"seed-connectors[{i}]", f"{url!r} must be an http:// or https:// "
                                                       "management URL")
        options = {"seed-connectors": tuple(seeds),
                   "leave-after-ms": t.int("leave-after-ms", cluster_source.DEFAULT_LEAVE_AFTER_MS,
                                           min=0)}
    if source == "discovery":
        if targets:
            raise t.error("targets", "a discovery pool takes its targets from the brokers' "
                                     "announcements (use [...pool.discovery-group])")
        options = _discovery_group(t.table("discovery-group", required=True))
    p = PoolConfig(check_period_ms=t.int("check-period", 5000, min=1),
                   quorum_size=t.int("quorum-size", 1, min=1),
                   quorum_timeout_ms=t.int("quorum-timeout", 3000, min=0),
                   local_target_enabled=t.bool("local-target-enabled", False),
                   username=t.str("username", None), password=t.str("password", None),
                   targets=targets, source=source, source_options=options,
                   **_failback(t, router, default_dir))
    if source == "static" and not targets:
        raise t.error("targets", "a static pool needs at least one [[...pool.targets]]")
    t.done()
    return p


def _broker_cluster_pool(t: Table, router: str = "", default_dir: Path | None = None) -> PoolConfig:
    """``source = "cluster"`` inside a broker: the pool is the broker's own cluster (Artemis's
    ``<cluster-connection>`` pool), so no seeds; ``cluster-connection`` may name it (checked
    against ``[cluster] name`` by the broker's config)."""
    if t.has("seed-connectors"):
        raise t.error("seed-connectors", "inside a broker a cluster pool is this broker's own cluster "
                                         "(remove seed-connectors)")
    if t.has("targets"):
        raise t.error("targets", "a cluster pool takes its targets from the cluster")
    options = {"cluster-connection": t.str("cluster-connection", None)}
    p = PoolConfig(check_period_ms=t.int("check-period", 5000, min=1),
                   quorum_size=t.int("quorum-size", 1, min=1),
                   quorum_timeout_ms=t.int("quorum-timeout", 3000, min=0),
                   local_target_enabled=t.bool("local-target-enabled", False),
                   username=t.str("username", None), password=t.str("password", None),
                   source="broker-cluster", source_options=options,
                   **_failback(t, router, default_dir))
    t.done()
    return p


def _discovery_group(d: Table) -> dict:
    """``[routers.<r>.pool.discovery-group]``: the keys of a broker's ``[discovery-groups.*]``
    plus ``cluster`` (only its announcements) and ``key`` (only packets signed with it)."""
    raw = {"group-address": d.str("group-address"), "group-port": d.int("group-port"),
           "local-bind-address": d.str("local-bind-address", "0.0.0.0"),
           "refresh-timeout-ms": d.int("refresh-timeout-ms", 10_000),
           "initial-wait-timeout-ms": d.int("initial-wait-timeout-ms", 10_000),
           "cluster": d.str("cluster", None), "key": d.str("key", None)}
    d.done()
    try:
        return discovery_source.check_options(raw)
    except MembershipSourceError as exc:
        raise d.error(exc.key, exc.detail) from None


def parse_router_table(name: str, t: Table, *, embedded: bool = False,
                       cache_dir: Path | None = None) -> RouterConfig:
    """One ``[routers.<name>]`` table. ``embedded``: the table sits in a broker's TOML (the
    router inside the broker): the broker itself is the local target (no ``[local-target]``
    table; ``local-target-filter`` and ``pool.local-target-enabled`` need none),
    ``pool.source = "cluster"`` means the broker's own cluster (``source`` becomes
    ``"broker-cluster"``), and an embedded cache file defaults to ``cache_dir``."""
    return _router(name, t, embedded=embedded, cache_dir=cache_dir)


def _router(name: str, t: Table, *, embedded: bool = False, cache_dir: Path | None = None) -> RouterConfig:
    try:
        key_type = t.convert("key-type", KeyType.parse, "SOURCE_IP")
    except ConfigError:
        raise
    key_filter = _regex(t, "key-filter", local=False)
    local_filter = _regex(t, "local-target-filter", local=True)
    root_filter = _regex(t, "root-target-filter", local=True)
    artemis_keys = t.bool("artemis-keys", False)
    max_key_length = t.int("max-key-length", 255, min=1)
    policy = _policy(t.table("policy")) if t.has("policy") else None
    cache = _cache(t.table("cache"), name, cache_dir) if t.has("cache") else None
    pool = _pool(t.table("pool"), embedded, name, cache_dir) if t.has("pool") else None
    if embedded and t.has("local-target"):
        raise t.error("local-target", "inside a broker the broker itself is the local target "
                                      "(remove this table)")
    local = (_target(t.table("local-target"), "local") if t.has("local-target") else None)
    pins = None
    if t.has("pins"):
        pt = t.table("pins")
        pins = PinsConfig(pt.path_value("file"))
        pt.done()
    if local is None and not embedded:
        if local_filter is not None:
            raise t.error("local-target-filter",
                          f"{local_filter!r} needs a [routers.{name}.local-target]")
        if pool is not None and pool.local_target_enabled:
            raise t.error("pool.local-target-enabled",
                          f"true needs a [routers.{name}.local-target]")
    if root_filter is not None and (pool is None or pool.source not in ("cluster", "broker-cluster")):
        raise t.error("root-target-filter", f"{root_filter!r} needs a pool with source = \"cluster\" "
                                            "(the root comes from the brokers' cluster view)")
    t.done()
    return RouterConfig(name, key_type, key_filter, local_filter, artemis_keys, policy, cache,
                        pool, local, pins, t.file, max_key_length, root_filter)


# -- Artemis broker.xml import -----------------------------------------------------------------
def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _child(el, name: str):
    for c in el:
        if isinstance(c.tag, str) and _local(c.tag) == name:
            return c
    return None


def _children(el, name: str) -> list:
    return [c for c in el if isinstance(c.tag, str) and _local(c.tag) == name]


def _text(el, name: str, default: str | None = None) -> str | None:
    c = _child(el, name)
    if c is None or c.text is None:
        return default
    return c.text.strip()


#: ``TransportConstants.ALLOWABLE_CONNECTOR_KEYS`` (Artemis, netty connector): a connector URL's
#: query keys in this set are ``params``, the others ``extraProps``.
ARTEMIS_CONNECTOR_KEYS = frozenset({
    "activemqServerName", "sslEnabled", "httpEnabled", "httpClientIdleTime",
    "httpClientIdleScanPeriod", "httpRequiresSessionId", "httpUpgradeEnabled",
    "httpUpgradeEndpoint", "useServlet", "servletPath", "useNio", "useNioGlobalWorkerPool",
    "useEpoll", "useKQueue", "useGlobalWorkerPool", "host", "port", "localAddress", "localPort",
    "keyStoreProvider", "keyStoreType", "keyStorePath", "keyStorePassword", "keyStoreAlias",
    "trustStoreProvider", "trustStoreType", "trustStorePath", "trustStorePassword",
    "enabledCipherSuites", "enabledProtocols", "verifyHost", "trustAll", "forceSSLParameters",
    "sniHost", "tcpNoDelay", "tcpSendBufferSize", "tcpReceiveBufferSize",
    "writeBufferHighWaterMark", "writeBufferLowWaterMark", "nioRemotingThreads",
    "remotingThreads", "batchDelay", "socksEnabled", "socksHost", "socksPort", "socksVersion",
    "socksUsername", "socksPassword", "socksRemoteDNS", "connect-timeout-millis",
    "useDefaultSslContext", "sslProvider", "trustManagerFactoryPlugin", "handshake-timeout",
    "crlPath", "activemq.usemaskedpassword", "activemq.passwordcodec",
})


def artemis_connector_params(url: str) -> tuple[dict[str, str], dict[str, str]]:
    """(params, extraProps) of the TransportConfiguration Artemis builds from a connector URL
    (``TCPTransportConfigurationSchema`` → ``BeanSupport.setData``): ``"host"`` and ``"port"``
    from the URI as strings (``"" + uri.getPort()``, so ``"-1"`` without a port), then every
    query key — an allowable connector key into params (overriding host/port), others into
    extraProps."""
    head, _, query = url.strip().partition("?")
    parts = urlsplit(head)
    host = parts.hostname
    if host is not None and ":" in host:
        host = f"[{host}]"  # java.net.URI.getHost keeps an IPv6 literal's brackets
    params = {"host": "null" if host is None else host,
              "port": str(parts.port if parts.port is not None else -1)}
    extra: dict[str, str] = {}
    for k, v in parse_qsl(query.replace(";", "&"), keep_blank_values=True):
        (params if k in ARTEMIS_CONNECTOR_KEYS else extra)[k] = v
    return params, extra


def parse_connector_url(url: str) -> tuple[str, int, bool]:
    """``tcp://host:port?sslEnabled=true;...`` → (host, port, tls); Artemis defaults localhost:61616."""
    head, _, query = url.strip().partition("?")
    parts = urlsplit(head)
    params = dict(parse_qsl(query.replace(";", "&"), keep_blank_values=True))
    host = params.get("host") or parts.hostname or "localhost"
    port = int(params.get("port") or parts.port or 61616)
    tls = params.get("sslEnabled", "false").lower() == "true"
    return host, port, tls


def import_artemis_xml(path: str | Path, *, local_target: TargetConfig | None = None,
                       management_urls: Mapping[str, str] | None = None,
                       node_ids: Mapping[str, str] | None = None,
                       settings_where: tuple[Path | None, str] | None = None) -> dict[str, RouterConfig]:
    """Import the ``<connection-routers>`` of an Artemis ``broker.xml`` as ``RouterConfig`` objects.

    Static pools become targets from ``<connectors>`` (named after the connector); since
    broker.xml has no management URL, ``management_urls`` / ``node_ids`` (connector name → value)
    may supply them, else the target is probed by TCP connect. CONSISTENT_HASH gets
    ``HASH=FNV1A, VIRTUAL_NODES=1`` and CONSISTENT_HASH_MODULO ``HASH=FNV1A`` unless set, and keys
    resolve as Artemis does. A discovery-group pool becomes ``source = "discovery"`` with the
    ``<discovery-group>``'s group-address, group-port, local-bind-address, refresh-timeout and
    initial-wait-timeout (ms) as its options (JGroups settings are refused); it hears Lodestone
    brokers' broadcast groups, not Artemis's UDP format; a cluster-connection pool ``source = "cluster"`` seeded with
    the management URLs of the local target and of the cluster-connection's connectors (its
    ``connector-ref`` and ``static-connectors``; at least one is needed) — Artemis precedence:
    cluster > discovery > static. Errors are ConfigError
    naming the file and ``connection-routers.<name>.<element>``.
    """

    p = Path(path)
    try:
        tree = DET.parse(str(p))
    except FileNotFoundError:
        raise ConfigError(p, "", "no such file") from None
    except (DET.ParseError, DefusedXmlException) as exc:
        raise ConfigError(p, "", f"invalid XML: {exc}") from None
    root = tree.getroot()
    core = _child(root, "core") if _local(root.tag) == "configuration" else root
    if core is None:
        raise ConfigError(p, "core", "missing <core> element")
    connectors: dict[str, tuple[str, int, bool]] = {}
    connector_params: dict[str, tuple[dict[str, str], dict[str, str]]] = {}
    cons = _child(core, "connectors")
    for c in _children(cons, "connector") if cons is not None else []:
        cname = c.get("name")
        try:
            connectors[cname] = parse_connector_url(c.text or "")
            connector_params[cname] = artemis_connector_params(c.text or "")
        except ValueError as exc:
            raise ConfigError(p, f"connectors.{cname}", f"{(c.text or '').strip()!r}: {exc}") \
                from None
    for what, given in (("node-id", node_ids), ("management-url", management_urls)):
        for cname in given or {}:
            if cname not in connectors:
                file, where = settings_where or (p, "import_artemis_xml")
                raise ConfigError(file, f"{where}.connectors.{cname}.{what}",
                                  f"{cname!r} is not a <connector> in {p} "
                                  f"(connectors: {', '.join(connectors) or 'none'})")
    groups: dict[str, dict[str, str]] = {}
    dgs = _child(core, "discovery-groups")
    for g in _children(dgs, "discovery-group") if dgs is not None else []:
        groups[g.get("name")] = {_local(c.tag): (c.text or "").strip() for c in g
                                 if isinstance(c.tag, str)}
    # cluster-connection name → its connector-refs (this broker's, then static-connectors')
    clusters: dict[str, list[str]] = {}
    ccs = _child(core, "cluster-connections")
    for cc in _children(ccs, "cluster-connection") if ccs is not None else []:
        refs = [(_text(cc, "connector-ref") or "")]
        sc = _child(cc, "static-connectors")
        refs += [(ref.text or "").strip() for ref in (_children(sc, "connector-ref") if sc is not None else [])]
        clusters[cc.get("name") or ""] = [r for r in refs if r]
    out: dict[str, RouterConfig] = {}
    crs = _child(core, "connection-routers")
    for r in _children(crs, "connection-router") if crs is not None else []:
        name = r.get("name")
        where = f"connection-routers.{name}"
        if not name:
            raise ConfigError(p, "connection-routers.connection-router", "missing name attribute")

        def err(key: str, msg: str) -> ConfigError:
            return ConfigError(p, f"{where}.{key}", msg)

        def num(el, key: str, default: int, minimum: int, prefix: str = "") -> int:
            raw = _text(el, key)
            key = prefix + key
            if raw is None:
                return default
            try:
                v = int(raw)
            except ValueError:
                raise err(key, f"{raw!r} must be an integer") from None
            if v < minimum:
                raise err(key, f"{v} must be {'> 0' if minimum == 1 else '>= 0'}")
            return v

        kt_raw = _text(r, "key-type", "SOURCE_IP")
        try:
            key_type = KeyType.parse(kt_raw)
        except ValueError as exc:
            raise err("key-type", f"{kt_raw!r} {exc}") from None
        key_filter = _text(r, "key-filter")
        local_filter = None
        lf_el = _child(r, "local-target-filter")
        if lf_el is not None:
            local_filter = (lf_el.text or "").strip()  # Artemis getString() trims
        for key, val, local in (("key-filter", key_filter, False),
                                ("local-target-filter", local_filter, True)):
            try:
                compile_local_filter(val, from_config=True) if local else compile_key_filter(val)
            except FilterError as exc:
                raise err(key, str(exc)) from None
        cache = None
        ce = _child(r, "cache")
        if ce is not None:
            persisted = (_text(ce, "persisted", "false") or "false").lower() == "true"
            cache = CacheConfig(num(ce, "timeout", 0, 0, "cache."), persisted,
                                "embedded" if persisted else "memory",
                                p.parent / f"router-cache-{name}.log" if persisted else None)
        policy = None
        pe = _child(r, "policy")
        if pe is not None:
            pname = pe.get("name") or ""
            props = {pr.get("key"): pr.get("value") for pr in _children(pe, "property")}
            if pname in ("CONSISTENT_HASH", "CONSISTENT_HASH_MODULO"):
                props.setdefault("HASH", "FNV1A")
            if pname == "CONSISTENT_HASH":
                props.setdefault("VIRTUAL_NODES", "1")
            try:
                create_policy(pname, props)
            except PolicyError as exc:
                raise err("policy", str(exc)) from None
            policy = PolicyConfig(pname, props)
        pool = None
        po = _child(r, "pool")
        if po is not None:
            targets = []
            source, options = "static", {}
            dg = _child(po, "discovery-group-ref")
            if _child(po, "cluster-connection") is not None:
                source, where_src = "cluster", "pool.cluster-connection"
                ccn = _text(po, "cluster-connection") or ""
                if ccn not in clusters:
                    raise err(where_src, f"{ccn!r} is not a <cluster-connection>")
                # the cluster is read from a broker's management API: the seeds are the
                # management URLs given for the cluster-connection's connectors and the local
                # target's (broker.xml has none)
                seeds = [(management_urls or {})[c] for c in clusters[ccn] if c in (management_urls or {})]
                if local_target is not None and local_target.management_url:
                    seeds.insert(0, local_target.management_url)
                if not seeds:
                    raise err(where_src, f"{ccn!r}: a cluster pool reads the cluster from a broker's "
                                         "management API; give a management-url to the local target "
                                         "or to one of the cluster-connection's connectors "
                                         f"({', '.join(clusters[ccn]) or 'none'})")
                options = {"seed-connectors": tuple(dict.fromkeys(seeds)),
                           "leave-after-ms": cluster_source.DEFAULT_LEAVE_AFTER_MS}
            elif dg is not None:
                g = dg.get("discovery-group-name")
                if g not in groups:
                    raise err("pool.discovery-group-ref", f"{g!r} is not a <discovery-group>")
                source, where_src = "discovery", "pool.discovery-group-ref"
                # Artemis's <discovery-group> elements → the discovery source's options; the
                # router then hears Lodestone brokers' broadcast groups (Artemis's own UDP
                # packet is another format), JGroups is not supported
                xml_keys = {"group-address": "group-address", "group-port": "group-port",
                            "local-bind-address": "local-bind-address",
                            "refresh-timeout": "refresh-timeout-ms",
                            "initial-wait-timeout": "initial-wait-timeout-ms"}
                other = sorted(set(groups[g]) - set(xml_keys))
                if other:
                    raise err(where_src, f"{g!r}: <{other[0]}> is not supported in a discovery "
                                         f"pool (supported: {', '.join(xml_keys)})")
                try:
                    options = discovery_source.check_options(
                        {xml_keys[k]: v for k, v in groups[g].items()})
                except MembershipSourceError as exc:
                    raise err(where_src, f"{g!r}: {exc}") from None
            if source != "static" and source not in membership_source_names():
                raise err(where_src, f"{next(iter(options.values()))!r}: {source} pools are not "
                                     f"supported yet (no {source!r} membership source; known: "
                                     f"{', '.join(membership_source_names())})")
            sc = _child(po, "static-connectors") if source == "static" else None
            for ref in _children(sc, "connector-ref") if sc is not None else []:
                cname = (ref.text or "").strip()
                if cname not in connectors:
                    raise err("pool.static-connectors", f"connector-ref {cname!r} is not a "
                                                        "<connector>")
                host, port, tls = connectors[cname]
                cparams, cextra = connector_params[cname]
                targets.append(TargetConfig(cname, host, port, tls,
                                            (management_urls or {}).get(cname),
                                            (node_ids or {}).get(cname),
                                            connector_params=tuple(cparams.items()),
                                            connector_extra=tuple(cextra.items())))
            lte = (_text(po, "local-target-enabled", "false") or "").lower() == "true"
            if source == "static" and not targets:
                raise err("pool", "Pool configuration not valid (no static-connectors)")
            pool = PoolConfig(num(po, "check-period", 5000, 1, "pool."),
                              num(po, "quorum-size", 1, 1, "pool."),
                              num(po, "quorum-timeout", 3000, 0, "pool."), lte, _text(po, "username"),
                              _text(po, "password"), tuple(targets), source, options)
            if lte and local_target is None:
                raise err("pool.local-target-enabled",
                          "true needs a local target ([import-artemis-xml.local-target] or local_target=...)")
        if local_filter is not None and local_target is None:
            raise err("local-target-filter",
                      f"{local_filter!r} needs a local target ([import-artemis-xml.local-target] "
                      "or local_target=...)")
        out[name] = RouterConfig(name, key_type, key_filter, local_filter, True, policy, cache,
                                 pool, local_target, None, p)
    return out
