"""Broker node configuration: one TOML file → frozen dataclasses.

Read strictly with :mod:`broker.wire.io.tomlconfig`: unknown keys are rejected and every error names the
file, the key path and the value (``etc/broker.toml: acceptors.amqp.port: 70000 must be <= 65535``).
Paths are relative to the config file's folder. The full reference is in ``docs/configuration.md`` (section "Broker node").

Tests and the local deployment may override ports and the data directory from the command line
(``--amqp-port``, ``--management-port``, ``--data-dir``); see :func:`apply_overrides`.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from broker.connections.settings import AddressFilter, BrokerConnectionConfig, LinkElement, MirrorConfig, parse_uri
from broker.cluster.settings import (HA_POLICIES, LOAD_BALANCING_MODES, PARTITIONS, BroadcastGroupConfig, ClusterConfig,
                                     DiscoveryGroupConfig, HaConfig, parse_connector)
from broker.cluster.settings import HA_ROLES, MANAGER_TYPES, ColocatedConfig, ManagerConfig
from broker.core.filters import SelectorError, compile_queue_filter
from broker.core.addresses import ANYCAST, MULTICAST, AddressSettings, SettingsResolver, WildcardSettings
from broker.core.duplicates import DEFAULT_ID_CACHE_SIZE, DEFAULT_MAX_IDS
from broker.wire.limits import SourceLimits, source_limits_from
from broker.wire.wildcards import check_pattern
from broker.store.journal import JournalConfig
from broker.wire.io.tomlconfig import ConfigError, Table, open_config
from router.embed import parse_router_table, parse_routing_log_table

if TYPE_CHECKING:  # pragma: no cover
    from router.embed import RouterConfig, RoutingLogConfig

__all__ = ["AcceptorConfig", "BrokerConfig", "ResourceLimits", "ResourceLimitSettings", "ConfigError", "load_config", "apply_overrides", "check_anonymous"]

MECHANISMS = ("PLAIN", "ANONYMOUS", "EXTERNAL")


@dataclass(frozen=True)
class TlsConfig:
    cert_file: Path
    key_file: Path
    ca_file: Path | None = None  # CA for client certificates (EXTERNAL)
    require_client_cert: bool = False


@dataclass(frozen=True)
class AcceptorConfig:
    name: str
    host: str = "127.0.0.1"
    port: int = 5672
    tls: TlsConfig | None = None
    sasl_mechanisms: tuple[str, ...] = ("PLAIN",)
    allow_no_sasl: bool = False  # clients that skip SASL are anonymous; needs [anonymous] in the users file
    max_connections: int = 10000  # Artemis connectionsAllowed; 0 = no limit
    limits: SourceLimits = SourceLimits()   # per-source limits (broker.wire.limits)
    # peers that must open with a PROXY v2 header (the routers); nobody else's header is honoured
    proxy_protocol_from: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    # Artemis anycastPrefix / multicastPrefix: an address starting with one names its routing type
    anycast_prefix: str = ""
    multicast_prefix: str = ""
    # the embedded connection router that routes this acceptor's clients (``[routers.<name>]``)
    router: str | None = None

    def trusts_proxy(self, ip: str) -> bool:
        """Is ``ip`` (the TCP peer) one of ``proxy-protocol-from``?"""
        if not self.proxy_protocol_from:
            return False
        try:
            addr = ipaddress.ip_address(ip)
        except ValueError:
            return False
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return any(addr in net for net in self.proxy_protocol_from)

    @property
    def scheme(self) -> str:
        return "amqps" if self.tls else "amqp"


@dataclass(frozen=True)
class ManagementConfig:
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 8161
    metrics_auth: bool = True  # /metrics needs Basic credentials of a user with manage
    metrics_cache_ms: int = 1000  # per-queue series are rebuilt at most this often


#: -1 means unlimited (Artemis); 0 allows none.
UNLIMITED = -1


@dataclass(frozen=True)
class ResourceLimits:
    """Per user (Artemis ``resource-limit-setting``): connections open at once, queues created."""

    max_connections: int = 1000
    max_queues: int = 10000


@dataclass(frozen=True)
class ResourceLimitSettings:
    """``[resource-limit-defaults]`` for everyone and ``[resource-limits."<user>"]`` per user.

    As in Artemis the match is the user name exactly (no wildcards); a user's table only
    overrides the keys it names.
    """

    default: ResourceLimits = field(default_factory=ResourceLimits)
    users: tuple[tuple[str, ResourceLimits], ...] = ()

    def for_user(self, user: str | None) -> ResourceLimits:
        for name, limits in self.users:
            if name == user:
                return limits
        return self.default


@dataclass(frozen=True)
class ActivityConfig:
    enabled: bool = True
    path: Path | None = None  # default <data-dir>/activity.jsonl
    flush_interval_s: float = 10.0


@dataclass(frozen=True)
class AddressDecl:
    name: str
    routing_types: tuple[str, ...]
    filter: str | None = None  # the anycast queue's filter (a selector; Artemis <queue><filter>)
    shared: bool = False       # OpenAMQ's shared queue (docs/cluster.md "Shared queues"): on the root only


@dataclass(frozen=True)
class BrokerConfig:
    file: Path
    name: str
    data_dir: Path
    persistent: bool
    acceptors: tuple[AcceptorConfig, ...]
    management: ManagementConfig
    users_file: Path
    max_frame_bytes: int
    idle_timeout_s: float
    producer_window: int
    journal: JournalConfig
    activity: ActivityConfig
    settings: SettingsResolver
    addresses: tuple[AddressDecl, ...] = ()
    log_level: str = "INFO"
    log_json: bool = False
    handshake_timeout_s: float = 10.0  # [amqp]: SASL, and then the client's Open, must finish in time
    max_sessions: int = 256  # [amqp]: sessions open at once per connection (channel-max = this)
    max_links: int = 1000  # [amqp]: links attached at once per connection
    limits: ResourceLimitSettings = field(default_factory=ResourceLimitSettings)
    link_stealing: bool = True  # [amqp]: a durable subscription attached elsewhere moves to the new link
    expiry_scan_period_ms: int = 30000  # [node] message-expiry-scan-period-ms (Artemis's default)
    # [node] duplicate detection (Artemis id-cache-size, persist-id-cache; broker.core.duplicates)
    id_cache_size: int = DEFAULT_ID_CACHE_SIZE
    persist_id_cache: bool = True
    id_cache_max_ids: int = DEFAULT_MAX_IDS   # ids remembered over all addresses
    wildcards: WildcardSettings = field(default_factory=WildcardSettings)
    extra: dict = field(default_factory=dict)
    cluster: ClusterConfig | None = None  # [cluster]; None: a single node
    ha: HaConfig = field(default_factory=HaConfig)  # [ha]
    broadcast_groups: tuple[BroadcastGroupConfig, ...] = ()  # [broadcast-groups.<name>]
    discovery_groups: tuple[DiscoveryGroupConfig, ...] = ()  # [discovery-groups.<name>]
    routers: Mapping[str, "RouterConfig"] = field(default_factory=dict)  # [routers.<name>] (embedded)
    routing_log: "RoutingLogConfig | None" = None  # [routing-log] of the embedded routers
    broker_connections: tuple[BrokerConnectionConfig, ...] = ()   # [broker-connections.<name>]


def _address_settings(t: Table, base: AddressSettings) -> AddressSettings:
    rt = t.choice("default-routing-type", (ANYCAST, MULTICAST), base.default_routing_type)
    auto = t.bool("auto-create", base.auto_create)
    mdc = t.int("max-delivery-count", base.max_delivery_count, min=0)
    dla = t.str("dead-letter-address", base.dead_letter_address if base.dead_letter_address else "")
    ea = t.str("expiry-address", base.expiry_address if base.expiry_address else "")
    redistribution = t.int("redistribution-delay-ms", base.redistribution_delay_ms, min=-1)
    id_cache = t.int("id-cache-size", base.id_cache_size, min=1)
    t.done()
    return AddressSettings(rt, auto, mdc, dla or None, ea or None, redistribution_delay_ms=redistribution,
                           id_cache_size=id_cache)


def _limits(t: Table, base: ResourceLimits) -> ResourceLimits:
    mc = t.int("max-connections", base.max_connections, min=UNLIMITED)
    mq = t.int("max-queues", base.max_queues, min=UNLIMITED)
    t.done()
    return ResourceLimits(mc, mq)


def _networks(t: Table, key: str) -> tuple:
    out = []
    for i, text in enumerate(t.str_list(key, [])):
        try:
            out.append(ipaddress.ip_network(text, strict=False))
        except ValueError as exc:
            raise t.error(f"{key}[{i}]", f"{text!r}: {exc}") from None
    return tuple(out)


def _tls(t: Table) -> TlsConfig | None:
    if not t.data:
        t.done()
        return None
    cert = t.path_value("cert-file")
    key = t.path_value("key-file")
    ca = t.path_value("ca-file", None)
    req = t.bool("require-client-cert", False)
    t.done()
    for k, p in (("cert-file", cert), ("key-file", key), ("ca-file", ca)):
        if p is not None and not p.is_file():
            raise t.error(k, f"{str(p)!r}: no such file")
    if req and ca is None:
        raise t.error("require-client-cert", "true needs ca-file")
    return TlsConfig(cert, key, ca, req)


def _connector(t: Table, key: str, url: str, *, own: bool = False) -> str:
    """Validate one connector URL (the error names ``key`` and the URL) and return it in its one
    spelling (``str(Connector)``: lower-case scheme and host, no trailing ``/``), so the node finds
    its own ``connector`` in ``static-connectors`` by equality. Port 0 only for the node's own
    ``connector``: a node started on an OS-chosen port; nobody can dial port 0."""
    try:
        c = parse_connector(url)
    except ValueError as exc:
        raise t.error(key, f"{url!r} {exc}") from None
    if c.port == 0 and not own:
        raise t.error(key, f"{url!r} has port 0: only this node's own connector may (an OS-chosen port)")
    return str(c)


def _connectors(t: Table, key: str) -> tuple[str, ...]:
    return tuple(_connector(t, f"{key}[{i}]", url) for i, url in enumerate(t.str_list(key, [])))


def _not_empty(t: Table, key: str, value: str | None) -> str | None:
    if value is not None and not value:
        raise t.error(key, "'' must not be empty")
    return value


def _cluster(t: Table, discovery_groups: dict, ids: tuple[int, bool] | None = None) -> ClusterConfig:
    """``[cluster]`` (Artemis ``cluster-connection``; docs/cluster.md maps the names). ``ids``: the
    ``[node]`` id-cache-size and persist-id-cache, the defaults of the cluster's (one setting in Artemis)."""
    d = ClusterConfig()
    if ids is not None:
        d = replace(d, id_cache_size=ids[0], persist_id_cache=ids[1])
    name = _not_empty(t, "name", t.str("name", d.name))
    connector = _connector(t, "connector", t.str("connector"), own=True)
    static = _connectors(t, "static-connectors")
    discovery = t.str("discovery-group", None)
    if discovery is not None:
        if static:
            raise t.error("discovery-group", f"{discovery!r}: set discovery-group or static-connectors, not both")
        if discovery not in discovery_groups:
            raise t.error("discovery-group", f"{discovery!r}: no [discovery-groups.{discovery}] table")
    user = _not_empty(t, "user", t.str("user", d.user))
    password = t.str("password", d.password)
    mode = t.choice("message-load-balancing", LOAD_BALANCING_MODES, d.message_load_balancing)
    max_hops = t.int("max-hops", d.max_hops, min=0)
    address = t.str("address", d.address)
    retry = t.int("retry-interval-ms", d.retry_interval_ms, min=0)
    multiplier = t.float("retry-interval-multiplier", d.retry_interval_multiplier, min=1.0)
    if not math.isfinite(multiplier):
        raise t.error("retry-interval-multiplier", f"{multiplier} must be a finite number")
    max_retry = t.int("max-retry-interval-ms", d.max_retry_interval_ms, min=0)
    initial_attempts = t.int("initial-connect-attempts", d.initial_connect_attempts, min=-1)
    reconnect_attempts = t.int("reconnect-attempts", d.reconnect_attempts, min=-1)
    check_period = t.int("check-period-ms", d.check_period_ms, min=0)
    ttl = t.int("connection-ttl-ms", d.connection_ttl_ms, min=0)
    call_timeout = t.int("call-timeout-ms", d.call_timeout_ms, min=0)
    notify_interval = t.int("notification-interval-ms", d.notification_interval_ms, min=1)
    notify_attempts = t.int("notification-attempts", d.notification_attempts, min=0)
    window = t.int("confirmation-window-bytes", d.confirmation_window_bytes, min=-1)
    dup = t.bool("duplicate-detection", d.duplicate_detection)
    id_cache = t.int("id-cache-size", d.id_cache_size, min=1)
    persist_ids = t.bool("persist-id-cache", d.persist_id_cache)
    direct_only = t.bool("allow-direct-connections-only", d.allow_direct_connections_only)
    key = _not_empty(t, "key", t.str("key", None))
    require_key = t.bool("require-client-key", d.require_client_key)
    if require_key and key is None:
        raise t.error("require-client-key", "true needs key")
    ca = t.path_value("ca-file", None)
    if ca is not None and not ca.is_file():
        raise t.error("ca-file", f"{str(ca)!r}: no such file")
    max_state = t.int("max-state-bytes", d.max_state_bytes, min=1024)
    partition, primaries = _partition(t, connector, static)
    t.done()
    return ClusterConfig(
        name=name, connector=connector, static_connectors=static, discovery_group=discovery, user=user,
        password=password, password_set=t.has("password"), message_load_balancing=mode, max_hops=max_hops,
        address=address, retry_interval_ms=retry, retry_interval_multiplier=multiplier,
        max_retry_interval_ms=max_retry, initial_connect_attempts=initial_attempts,
        reconnect_attempts=reconnect_attempts, check_period_ms=check_period, connection_ttl_ms=ttl,
        call_timeout_ms=call_timeout, notification_interval_ms=notify_interval,
        notification_attempts=notify_attempts, confirmation_window_bytes=window, duplicate_detection=dup,
        id_cache_size=id_cache, persist_id_cache=persist_ids, allow_direct_connections_only=direct_only,
        key=key, require_client_key=require_key, ca_file=None if ca is None else str(ca),
        max_state_bytes=max_state, partition=partition, primaries=primaries)


def _partition(t: Table, connector: str, static: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """OpenAMQ's ``partition`` and ``primaries`` (docs/cluster.md "Primaries, secondaries and the
    root"): a primary is one of the defined primaries (its connector, port given, is in the list);
    a secondary is not, and dials only the primaries."""
    partition = t.choice("partition", PARTITIONS, "primary")
    primaries = _connectors(t, "primaries")
    if len(set(primaries)) != len(primaries):
        dup = next(p for p in primaries if primaries.count(p) > 1)
        raise t.error("primaries", f"{dup!r} is listed twice")
    if not primaries:
        if t.has("partition") and partition == "secondary":
            raise t.error("partition", "'secondary' needs primaries (the defined primary brokers' connectors)")
        return partition, ()
    if partition == "primary":
        if parse_connector(connector).port == 0:
            raise t.error("connector", f"{connector!r} has port 0: a defined primary is found in primaries by "
                                       "its connector, so give its port")
        if connector not in primaries:
            raise t.error("primaries", f"{list(primaries)} does not name this node's connector {connector!r} "
                                       "(a primary is one of the defined primaries; a node that is not is "
                                       "partition = 'secondary')")
    else:
        if connector in primaries:
            raise t.error("partition", f"'secondary', but this node's connector {connector!r} is in primaries")
        others = [u for u in static if u not in primaries]
        if others:
            raise t.error("static-connectors", f"{others[0]!r} is not a primary: a secondary connects to the "
                                               "primaries only, never to another secondary")
    return partition, primaries


def _multicast_group(t: Table) -> tuple[str, int]:
    addr = t.str("group-address")
    try:
        ip = ipaddress.IPv4Address(addr)
    except ValueError:
        raise t.error("group-address", f"{addr!r} is not an IPv4 address") from None
    if not ip.is_multicast:
        raise t.error("group-address", f"{addr!r} is not a multicast address (224.0.0.0/4)")
    return addr, t.int("group-port", min=1, max=65535)


def _bind_address(t: Table) -> str:
    addr = t.str("local-bind-address", "0.0.0.0")
    try:
        ipaddress.IPv4Address(addr)
    except ValueError:
        raise t.error("local-bind-address", f"{addr!r} is not an IPv4 address") from None
    return addr


def _broadcast_group(name: str, t: Table) -> BroadcastGroupConfig:
    """``[broadcast-groups.<name>]`` (Artemis ``broadcast-group``)."""
    group, port = _multicast_group(t)
    bind = _bind_address(t)
    bind_port = t.int("local-bind-port", -1, min=-1, max=65535)
    period = t.int("broadcast-period-ms", 2000, min=1)
    connectors = _connectors(t, "connectors")
    t.done()
    return BroadcastGroupConfig(name, group, port, bind, bind_port, period, connectors)


def _discovery_group(name: str, t: Table) -> DiscoveryGroupConfig:
    """``[discovery-groups.<name>]`` (Artemis ``discovery-group``)."""
    group, port = _multicast_group(t)
    bind = _bind_address(t)
    refresh = t.int("refresh-timeout-ms", 10000, min=1)
    initial = t.int("initial-wait-timeout-ms", 10000, min=0)
    t.done()
    return DiscoveryGroupConfig(name, group, port, bind, refresh, initial)


def _broker_connection(name: str, t: Table) -> BrokerConnectionConfig:
    """``[broker-connections.<name>]`` (Artemis ``<amqp-connection>``; docs/broker-connections.md)."""
    text = t.str("uri")
    try:
        uris = parse_uri(text)
    except ValueError as exc:
        raise t.error("uri", f"{text!r}: {exc}") from None
    user = _not_empty(t, "user", t.str("user", None))
    password = t.str("password", None)
    if password is not None and user is None:
        raise t.error("password", "set without a user (no user logs in with SASL ANONYMOUS)")
    retry = t.int("retry-interval-ms", 5000, min=1)
    attempts = t.int("reconnect-attempts", -1, min=-1)
    auto_start = t.bool("auto-start", True)
    ca = t.path_value("ca-file", None)
    if ca is not None and not ca.is_file():
        raise t.error("ca-file", f"{str(ca)!r}: no such file")
    elements: dict[str, list[LinkElement]] = {"sender": [], "receiver": []}
    for kind, key in (("sender", "senders"), ("receiver", "receivers")):
        for i, et in enumerate(t.array_of_tables(key)):
            match = _not_empty(et, "address-match", et.str("address-match", None))
            queue = _not_empty(et, "queue-name", et.str("queue-name", None))
            remote = _not_empty(et, "remote-address", et.str("remote-address", None))
            if (match is None) == (queue is None):
                raise ConfigError(t.file, f"{t.key_path(key)}[{i}]", "needs exactly one of address-match and queue-name")
            if match is not None:
                try:
                    check_pattern(match)
                except ValueError as exc:
                    raise et.error("address-match", f"{match!r}: {exc}") from None
            et.done()
            elements[kind].append(LinkElement(kind, match, queue, remote))
    mirror = None
    if t.has("mirror"):
        mt = t.table("mirror")
        text = mt.str("address-filter", "")
        try:
            afilter = AddressFilter.parse(text)
        except ValueError as exc:
            raise mt.error("address-filter", f"{text!r}: {exc}") from None
        mirror = MirrorConfig(mt.bool("message-acknowledgements", True), mt.bool("queue-creation", True),
                              mt.bool("queue-removal", True), afilter, mt.bool("durable", True),
                              mt.bool("sync", False), mt.bool("initial-sync", False))
        mt.done()
    for i, r in enumerate(elements["receiver"]):
        for s in elements["sender"]:
            if (r.queue_name, r.address_match) == (s.queue_name, s.address_match):
                raise ConfigError(t.file, f"{t.key_path('receivers')}[{i}]",
                                  f"{r.destination} is also a sender's: messages would loop between the brokers")
    t.done()
    return BrokerConnectionConfig(name, uris, user, password, retry, attempts, auto_start,
                                  tuple(elements["sender"]), tuple(elements["receiver"]),
                                  None if ca is None else str(ca), mirror)


#: [ha] keys of the replication policy (Artemis <replication>)
_REPLICATION_KEYS = ("group-name", "cluster-name", "check-for-live-server", "initial-replication-sync-timeout-ms",
                     "vote-on-replication-failure", "quorum-size", "vote-retries", "vote-retry-wait-ms",
                     "quorum-vote-wait-s", "max-saved-replicated-journals-size", "backup-fsync")
_PRIMARY_KEYS = {"check-for-live-server": "replication", "vote-on-replication-failure": "replication",
                 "wait-for-activation": "shared-store"}
_BACKUP_KEYS = {"allow-failback": None, "restart-backup": None, "max-saved-replicated-journals-size": "replication",
                "backup-fsync": "replication"}


def _ha(t: Table, cluster: ClusterConfig | None) -> HaConfig:
    """``[ha]`` (Artemis ``<ha-policy>``): ``live-only`` with scale-down, ``shared-store`` or
    ``replication`` (docs/ha.md)."""
    d = HaConfig()
    policy = t.choice("policy", HA_POLICIES, d.policy)
    colocated = None
    if t.has("colocated"):
        ct = t.table("colocated")
        d_c = ColocatedConfig()
        colocated = ColocatedConfig(
            request_backup=ct.bool("request-backup", d_c.request_backup),
            max_backups=ct.int("max-backups", d_c.max_backups, min=0),
            backup_request_retries=ct.int("backup-request-retries", d_c.backup_request_retries, min=-1),
            backup_request_retry_interval_ms=ct.int("backup-request-retry-interval-ms",
                                                    d_c.backup_request_retry_interval_ms, min=1),
            backup_port_offset=ct.int("backup-port-offset", d_c.backup_port_offset, min=1, max=65535),
            excludes=tuple(ct.str_list("excludes", [])))
        ct.done()
    manager = _manager(t.table("manager")) if t.has("manager") else None
    coordination_id = t.str("coordination-id", None)
    if coordination_id is not None:
        if manager is None:
            raise t.error("coordination-id", f"{coordination_id!r}: a coordination id names the lock in "
                          "[ha.manager]'s coordination service (no [ha.manager] table)")
        if not _COORDINATION_ID.match(coordination_id):
            raise t.error("coordination-id", f"{coordination_id!r}: 1 to 64 letters, digits, '.', '_' or '-'")
    if manager is not None:
        if policy != "replication":
            raise t.error("manager", "a coordination service decides between replication members "
                          "(policy = 'replication')")
        for key, why in (("vote-on-replication-failure", "a primary under [ha.manager] always stops when it "
                          "loses the coordination service's lock, as if it were true"),
                         ("quorum-vote-wait-s", "the coordination service's session decides how long "
                          "(session-ms)"),
                         ("quorum-size", "the coordination service is the quorum")):
            if t.has(key):
                raise t.error(key, f"has no meaning under [ha.manager]: {why}")
        if t.has("colocated"):
            raise t.error("colocated", "colocated backups are not supported under [ha.manager]")
    if policy != "replication":
        for key in _REPLICATION_KEYS:
            if t.has(key):
                raise t.error(key, "is a replication setting (policy = 'replication')")
    role = t.choice("role", HA_ROLES, d.role)
    if policy == "live-only" and t.has("role"):
        raise t.error("role", f"{role!r}: a live-only node has no role (use policy = 'shared-store' or 'replication')")
    for key, only in _PRIMARY_KEYS.items():
        if t.has(key) and (role != "primary" or policy == "live-only" or (only and policy != only)):
            raise t.error(key, f"is a {only} primary setting")
    for key, only in _BACKUP_KEYS.items():
        if t.has(key) and (role != "backup" or policy == "live-only" or (only and policy != only)):
            raise t.error(key, f"is a {only or 'shared-store or replication'} backup setting")
    if t.has("failover-on-shutdown") and policy != "shared-store":
        raise t.error("failover-on-shutdown", "is a shared-store setting")
    allow_failback = t.bool("allow-failback", d.allow_failback)
    failover_on_shutdown = t.bool("failover-on-shutdown", d.failover_on_shutdown)
    wait_for_activation = t.bool("wait-for-activation", d.wait_for_activation)
    restart_backup = t.bool("restart-backup", d.restart_backup)
    group = _not_empty(t, "group-name", t.str("group-name", None))
    cluster_name = _not_empty(t, "cluster-name", t.str("cluster-name", None))
    check_live = t.bool("check-for-live-server", d.check_for_live_server)
    sync_timeout = t.int("initial-replication-sync-timeout-ms", d.initial_replication_sync_timeout_ms, min=1)
    vote_fail = t.bool("vote-on-replication-failure", d.vote_on_replication_failure)
    quorum = t.int("quorum-size", d.quorum_size, min=-1)
    if quorum == 0:
        raise t.error("quorum-size", "0 must be -1 (the largest cluster size seen) or >= 1")
    vote_retries = t.int("vote-retries", d.vote_retries, min=0)
    vote_wait = t.int("vote-retry-wait-ms", d.vote_retry_wait_ms, min=1)
    vote_total = t.int("quorum-vote-wait-s", d.quorum_vote_wait_s, min=1)
    saved = t.int("max-saved-replicated-journals-size", d.max_saved_replicated_journals_size, min=0)
    backup_fsync = t.bool("backup-fsync", d.backup_fsync)
    scale_down = t.bool("scale-down", d.scale_down)
    sd_group = _not_empty(t, "scale-down-group-name", t.str("scale-down-group-name", d.scale_down_group_name))
    connectors = _connectors(t, "scale-down-connectors")
    t.done()
    if scale_down and cluster is None:
        raise t.error("scale-down", "true needs a [cluster] table (scale-down moves messages over the "
                      "cluster's bridges, with its credential)")
    if scale_down and policy != "live-only" and role != "backup":
        raise t.error("scale-down", f"scale-down from a {policy} {role} is not supported (live-only nodes and "
                      "backups scale down; see docs/ha.md)")
    if colocated is not None and not (policy == "replication" and role == "primary"):
        raise t.error("colocated", "colocated backups are for replication primaries (policy = 'replication', "
                      "role = 'primary')")
    if policy == "replication":
        if cluster is None:
            raise t.error("policy", "'replication' needs a [cluster] table: the backup finds its primary "
                          "through the cluster and votes with its members")
        if cluster_name is not None and cluster_name != cluster.name:
            raise t.error("cluster-name", f"{cluster_name!r} is not this node's cluster ({cluster.name!r})")
    return HaConfig(policy=policy, role=role if policy != "live-only" else "primary", allow_failback=allow_failback,
                    failover_on_shutdown=failover_on_shutdown, wait_for_activation=wait_for_activation,
                    restart_backup=restart_backup, group_name=group, cluster_name=cluster_name,
                    check_for_live_server=check_live, initial_replication_sync_timeout_ms=sync_timeout,
                    vote_on_replication_failure=vote_fail, quorum_size=quorum, vote_retries=vote_retries,
                    vote_retry_wait_ms=vote_wait, quorum_vote_wait_s=vote_total,
                    max_saved_replicated_journals_size=saved, backup_fsync=backup_fsync, colocated=colocated,
                    scale_down=scale_down, scale_down_group_name=sd_group, scale_down_connectors=connectors,
                    manager=manager, coordination_id=coordination_id)


_COORDINATION_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def _manager(t: Table) -> ManagerConfig:
    """``[ha.manager]`` (Artemis ``<manager>`` with the Curator provider's properties)."""
    d = ManagerConfig()
    kind = t.choice("type", MANAGER_TYPES, d.type)
    connect = t.str("connect-string", None)
    if connect is None:
        raise t.error("connect-string", "is required: the ZooKeeper servers, 'host:port,host:port'")
    for part in connect.split(","):
        host, sep, port = part.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise t.error("connect-string", f"{connect!r}: {part.strip()!r} is not host:port")
    namespace = t.str("namespace", None)
    if namespace is not None and not re.match(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$", namespace.strip("/")):
        raise t.error("namespace", f"{namespace!r}: path segments of letters, digits, '.', '_' or '-'")
    m = ManagerConfig(type=kind, connect_string=connect, namespace=namespace,
                      session_ms=t.int("session-ms", d.session_ms, min=1),
                      session_percent=t.int("session-percent", d.session_percent, min=1, max=99),
                      connection_ms=t.int("connection-ms", d.connection_ms, min=1),
                      retries=t.int("retries", d.retries, min=0),
                      retries_ms=t.int("retries-ms", d.retries_ms, min=1))
    t.done()
    return m


def load_config(file: str | Path) -> BrokerConfig:
    """Read and validate a broker TOML file. Raises ConfigError naming file, key and value."""
    root = open_config(file)
    f = root.file

    node = root.table("node")
    name = node.str("name", "broker")
    data_dir = node.path_value("data-dir", "data")
    persistent = node.bool("persistent", True)
    expiry_scan = node.int("message-expiry-scan-period-ms", 30000, min=0)
    id_cache_size = node.int("id-cache-size", DEFAULT_ID_CACHE_SIZE, min=1)
    persist_id_cache = node.bool("persist-id-cache", True)
    id_cache_max_ids = node.int("id-cache-max-ids", DEFAULT_MAX_IDS, min=1)
    node.done()

    acceptors = []
    for aname, t in root.tables("acceptors").items():
        host = t.str("host", "127.0.0.1")
        port = t.int("port", 5672, min=0, max=65535)
        mechs = tuple(t.str_list("sasl-mechanisms", ["PLAIN"]))
        for i, m in enumerate(mechs):
            if m not in MECHANISMS:
                raise t.error(f"sasl-mechanisms[{i}]", f"{m!r} must be one of {', '.join(MECHANISMS)}")
        allow_no_sasl = t.bool("allow-no-sasl", False)
        max_conns = t.int("max-connections", 10000, min=0)
        limits = source_limits_from(t)
        proxy_from = _networks(t, "proxy-protocol-from")
        anycast_prefix = t.str("anycast-prefix", "")
        multicast_prefix = t.str("multicast-prefix", "")
        if anycast_prefix and anycast_prefix == multicast_prefix:
            raise t.error("multicast-prefix", f"{multicast_prefix!r} is also the anycast-prefix")
        tls = _tls(t.table("tls"))
        router = _not_empty(t, "router", t.str("router", None))
        t.done()
        if "EXTERNAL" in mechs and (tls is None or tls.ca_file is None):
            raise ConfigError(f, f"acceptors.{aname}.sasl-mechanisms", "EXTERNAL needs [tls] with ca-file")
        acceptors.append(AcceptorConfig(aname, host, port, tls, mechs, allow_no_sasl, max_conns, limits,
                                        proxy_from, anycast_prefix, multicast_prefix, router))
    if not acceptors:
        raise ConfigError(f, "acceptors", "missing: at least one [acceptors.<name>] table is required")

    mt = root.table("management")
    management = ManagementConfig(mt.bool("enabled", True), mt.str("host", "127.0.0.1"),
                                  mt.int("port", 8161, min=0, max=65535), mt.bool("metrics-auth", True),
                                  mt.int("metrics-cache-ms", 1000, min=0))
    mt.done()

    st = root.table("security")
    users_file = st.path_value("users-file", "users.toml")
    st.done()
    if not users_file.is_file():
        raise ConfigError(f, "security.users-file", f"{str(users_file)!r}: no such file")

    at = root.table("amqp")
    max_frame = at.int("max-frame-bytes", 65536, min=512)
    idle = at.float("idle-timeout-s", 60.0, min=0.0)
    window = at.int("producer-window", 1000, min=1)
    handshake = at.float("handshake-timeout-s", 10.0, min=0.1)
    max_sessions = at.int("max-sessions", 256, min=1, max=65535)
    max_links = at.int("max-links", 1000, min=1)
    link_stealing = at.bool("link-stealing", True)
    at.done()

    wt = root.table("wildcard-addresses")
    wildcards = WildcardSettings(wt.bool("routing-enabled", True), wt.str("delimiter", "."),
                                 wt.str("any-words", "#"), wt.str("single-word", "*"))
    for key, value in (("delimiter", wildcards.delimiter), ("any-words", wildcards.any_words),
                       ("single-word", wildcards.single_word)):
        if len(value) != 1:
            raise wt.error(key, f"{value!r} must be one character")
    if len({wildcards.delimiter, wildcards.any_words, wildcards.single_word}) != 3:
        raise wt.error("single-word", "delimiter, any-words and single-word must differ")
    wt.done()

    base_limits = _limits(root.table("resource-limit-defaults"), ResourceLimits())
    user_limits = tuple((user, _limits(t, base_limits)) for user, t in root.tables("resource-limits").items())
    limits = ResourceLimitSettings(base_limits, user_limits)

    journal = JournalConfig.from_table(root.table("journal"))

    lt = root.table("activity-log")
    activity = ActivityConfig(lt.bool("enabled", True), lt.path_value("path", None),
                              lt.float("flush-interval-s", 10.0, min=0.01))
    lt.done()

    default = _address_settings(root.table("address-defaults"), AddressSettings())
    rules = []
    for pattern, t in root.tables("address-settings").items():
        try:
            check_pattern(pattern)
        except ValueError as exc:
            raise ConfigError(root.file, f"address-settings.{pattern}", str(exc)) from None
        rules.append((pattern, _address_settings(t, default)))
    settings = SettingsResolver(default, tuple(rules))

    decls = []
    for aname, t in root.tables("addresses").items():
        rts = t.str_list("routing-types", [default.default_routing_type])
        for i, r in enumerate(rts):
            if r not in (ANYCAST, MULTICAST):
                raise t.error(f"routing-types[{i}]", f"{r!r} must be one of anycast, multicast")
        if not rts:
            raise t.error("routing-types", "[] must name at least one routing type")
        qfilter = t.str("filter", "") or None
        if qfilter is not None:
            if ANYCAST not in rts:
                raise t.error("filter", "a queue filter needs the anycast routing type (the address's queue)")
            try:
                compile_queue_filter(qfilter)
            except SelectorError as exc:
                raise t.error("filter", f"{qfilter!r}: {exc}") from None
        shared = t.bool("shared", False)
        if shared and ANYCAST not in rts:
            raise t.error("shared", "true needs the anycast routing type (a shared queue is the address's queue)")
        t.done()
        decls.append(AddressDecl(aname, tuple(rts), qfilter, shared))

    broadcast_groups = tuple(_broadcast_group(name, t) for name, t in root.tables("broadcast-groups").items())
    discovery_groups = {name: _discovery_group(name, t) for name, t in root.tables("discovery-groups").items()}
    cluster = _cluster(root.table("cluster"), discovery_groups, (id_cache_size, persist_id_cache)) \
        if root.has("cluster") else None
    ha = _ha(root.table("ha"), cluster)
    for d in decls:
        if d.shared and (cluster is None or not cluster.primaries):
            raise ConfigError(root.file, f"addresses.{d.name}.shared",
                              "true needs a cluster with a root ([cluster] primaries): a shared queue lives on the root")
    routers, routing_log = _routers(root, acceptors, cluster, data_dir)
    if ha.colocated is not None:
        names = {a.name for a in acceptors}
        for i, name in enumerate(ha.colocated.excludes):
            if name not in names:
                raise ConfigError(root.file, f"ha.colocated.excludes[{i}]",
                                  f"{name!r} is not an acceptor (acceptors: {', '.join(sorted(names))})")

    broker_connections = tuple(_broker_connection(cname, t) for cname, t in root.tables("broker-connections").items())

    lg = root.table("logging")
    level = lg.choice("level", ("DEBUG", "INFO", "WARNING", "ERROR"), "INFO")
    json_lines = lg.bool("json", False)
    lg.done()
    root.done()
    return BrokerConfig(f, name, data_dir, persistent, tuple(acceptors), management, users_file,
                        max_frame, idle, window, journal, activity, settings, tuple(decls),
                        level, json_lines, handshake, max_sessions, max_links, limits,
                        link_stealing=link_stealing, expiry_scan_period_ms=expiry_scan, wildcards=wildcards,
                        id_cache_size=id_cache_size, persist_id_cache=persist_id_cache,
                        id_cache_max_ids=id_cache_max_ids,
                        cluster=cluster, ha=ha, broadcast_groups=broadcast_groups,
                        discovery_groups=tuple(discovery_groups.values()), routers=routers,
                        routing_log=routing_log, broker_connections=broker_connections)


def _routers(root: Table, acceptors: list[AcceptorConfig], cluster: ClusterConfig | None,
             data_dir: Path) -> tuple[dict, "RoutingLogConfig | None"]:
    """``[routers.<name>]`` (the router's own schema, ``router.config``, in embedded mode) and
    ``[routing-log]``; every ``acceptors.<a>.router`` must name one of them."""

    routers = {}
    for rname, t in root.tables("routers").items():
        rc = parse_router_table(rname, t, embedded=True, cache_dir=data_dir)
        pc = rc.pool
        if pc is not None and pc.source == "broker-cluster":
            named = pc.source_options.get("cluster-connection")
            if cluster is None:
                raise ConfigError(root.file, f"routers.{rname}.pool.source",
                                  "'cluster' needs this broker to be in a cluster (a [cluster] table)")
            if named is not None and named != cluster.name:
                raise ConfigError(root.file, f"routers.{rname}.pool.cluster-connection",
                                  f"{named!r} is not this broker's cluster ({cluster.name!r})")
        routers[rname] = rc
    routing_log = parse_routing_log_table(root.table("routing-log")) if root.has("routing-log") else None
    for a in acceptors:
        if a.router is not None and a.router not in routers:
            raise ConfigError(root.file, f"acceptors.{a.name}.router",
                              f"{a.router!r} is not a router defined in [routers] "
                              f"(defined: {', '.join(routers) or 'none'})")
    max_field = routing_log.max_field_chars if routing_log is not None else 1024
    for rname, rc in routers.items():
        if rc.max_key_length > max_field:
            raise ConfigError(root.file, f"routers.{rname}.max-key-length",
                              f"{rc.max_key_length} must be <= routing-log.max-field-chars "
                              f"({max_field}), so accepted keys are logged whole")
    return routers, routing_log


def check_anonymous(cfg: BrokerConfig, anonymous_enabled: bool) -> None:
    """Acceptors may offer ANONYMOUS (or no SASL) only if the users file enables ``[anonymous]``."""
    if anonymous_enabled:
        return
    for a in cfg.acceptors:
        if "ANONYMOUS" in a.sasl_mechanisms or a.allow_no_sasl:
            key = "sasl-mechanisms" if "ANONYMOUS" in a.sasl_mechanisms else "allow-no-sasl"
            raise ConfigError(cfg.file, f"acceptors.{a.name}.{key}",
                              f"anonymous access is disabled in {cfg.users_file} ([anonymous] enabled = false)")


def apply_overrides(cfg: BrokerConfig, *, amqp_port: int | None = None, management_port: int | None = None,
                    data_dir: Path | None = None, name: str | None = None,
                    static_connectors: str | None = None) -> BrokerConfig:
    """Command-line overrides: the first plain acceptor's port, the management port, the data dir.

    Nothing in ``[cluster]`` is rewritten: a node on an OS-chosen port keeps its connector as
    written (port 0 allowed there), and the run-time code substitutes the port it listens on."""
    if amqp_port is not None:
        acc = list(cfg.acceptors)
        idx = next((i for i, a in enumerate(acc) if a.tls is None), 0)
        acc[idx] = replace(acc[idx], port=amqp_port)
        cfg = replace(cfg, acceptors=tuple(acc))
    if management_port is not None:
        cfg = replace(cfg, management=replace(cfg.management, port=management_port))
    if data_dir is not None:
        cfg = replace(cfg, data_dir=data_dir)
    if name is not None:
        cfg = replace(cfg, name=name)
    if static_connectors is not None:  # replaces [cluster] discovery-group / static-connectors
        if cfg.cluster is None:
            raise ConfigError("<command line>", "--static-connectors", f"{cfg.file}: no [cluster] table")
        urls = tuple(u.strip() for u in static_connectors.split(",") if u.strip())
        for u in urls:
            try:
                parse_connector(u)
            except ValueError as exc:
                raise ConfigError("<command line>", "--static-connectors", f"{u!r}: {exc}") from None
        cfg = replace(cfg, cluster=replace(cfg.cluster, static_connectors=urls, discovery_group=None))
    return cfg
