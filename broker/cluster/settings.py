"""The cluster's settings: ``[cluster]`` and the scale-down part of ``[ha]`` in the broker TOML.

Pure data (frozen dataclasses) with Artemis's defaults; :func:`broker.config.load_config` reads
and validates them (unknown keys and bad values name file, key and value). ``docs/cluster.md``
maps every name to Artemis's ``cluster-connection`` element and to OpenAMQ's cluster key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

__all__ = ["ClusterConfig", "HaConfig", "BroadcastGroupConfig", "DiscoveryGroupConfig", "DEFAULT_CLUSTER_PASSWORD", "SAMPLE_CLUSTER_PASSWORD", "LOAD_BALANCING_MODES", "PARTITIONS", "parse_address_filter",
           "address_clustered", "Connector", "parse_connector", "same_endpoint", "HA_POLICIES", "HA_ROLES", "ColocatedConfig"]

#: the cluster password Artemis ships (``CHANGE ME!!``); a node using it (or none) warns at every start
DEFAULT_CLUSTER_PASSWORD = "CHANGE ME!!"
#: the password of the sample configs in etc/ (published): warned about, accepted from loopback only
SAMPLE_CLUSTER_PASSWORD = "lodestone-sample-cluster-password"
LOAD_BALANCING_MODES = ("OFF", "STRICT", "ON_DEMAND", "OFF_WITH_REDISTRIBUTION")
#: OpenAMQ's partitions (docs/cluster.md "Primaries, secondaries and the root")
PARTITIONS = ("primary", "secondary")
#: Artemis's ha-policy kinds (docs/ha.md)
HA_POLICIES = ("live-only", "replication", "shared-store")


@dataclass(frozen=True)
class Connector:
    """Where another node (or this one) is reached: ``amqp://host:port`` or ``amqps://host:port``."""

    scheme: str
    host: str
    port: int

    @property
    def tls(self) -> bool:
        return self.scheme == "amqps"

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def parse_connector(url: str) -> Connector:
    """Parse a connector URL; a ValueError says what is wrong. The port is explicit (0 is
    accepted: a node started on an OS-chosen port). Credentials belong in ``user``/``password``,
    so a URL with a user, a path, a query or a fragment is refused."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"is not an amqp://host:port URL ({exc})") from None
    if parts.scheme not in ("amqp", "amqps"):
        raise ValueError("must be an amqp://host:port or amqps://host:port URL")
    if parts.username is not None or parts.password is not None:
        raise ValueError("must not carry credentials (use user and password)")
    if not parts.hostname:
        raise ValueError("has no host (amqp://host:port)")
    if port is None:
        raise ValueError("has no port (amqp://host:port)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError("must be just scheme, host and port (amqp://host:port)")
    return Connector(parts.scheme, parts.hostname, port)


def same_endpoint(a: str, b: str) -> bool:
    """Do two connector URLs name the same host and port (whatever the scheme)?"""
    pa, pb = urlsplit(a), urlsplit(b)
    return (pa.hostname, pa.port) == (pb.hostname, pb.port)


def parse_address_filter(text: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Artemis's cluster ``address``: a comma list of prefixes; ``!prefix`` excludes. Returns
    (includes, excludes); empty entries are ignored."""
    inc: list[str] = []
    exc: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if part.startswith("!"):
            if part[1:]:
                exc.append(part[1:])
        else:
            inc.append(part)
    return tuple(inc), tuple(exc)


def address_clustered(address: str, includes: tuple[str, ...], excludes: tuple[str, ...]) -> bool:
    """Is ``address`` clustered? An exclusion wins; no inclusion means every address (Artemis
    ``ClusterConnectionImpl``'s address match: ``!`` prefixes exclude, the rest include)."""
    for p in excludes:
        if address.startswith(p):
            return False
    if not includes:
        return True
    return any(address.startswith(p) for p in includes)


@dataclass(frozen=True)
class ClusterConfig:
    """``[cluster]`` (Artemis ``cluster-connection``; see docs/cluster.md for the name mapping)."""

    name: str = "my-cluster"
    connector: str = ""                       # amqp://host:port the others reach this node at
    static_connectors: tuple[str, ...] = ()
    discovery_group: str | None = None        # the discovery issue; static connectors until then
    user: str = "ACTIVEMQ.CLUSTER.ADMIN.USER"  # Artemis's cluster-user default
    password: str = DEFAULT_CLUSTER_PASSWORD
    password_set: bool = False                # the file named a password (else the default warns)
    message_load_balancing: str = "ON_DEMAND"
    max_hops: int = 1
    address: str = ""                         # comma list of prefixes, !prefix excludes
    retry_interval_ms: int = 500
    retry_interval_multiplier: float = 1.0
    max_retry_interval_ms: int = 2000
    initial_connect_attempts: int = -1
    reconnect_attempts: int = -1
    check_period_ms: int = 30000
    connection_ttl_ms: int = 60000
    call_timeout_ms: int = 30000
    notification_interval_ms: int = 1000
    notification_attempts: int = 2
    confirmation_window_bytes: int = 1048576
    duplicate_detection: bool = True
    id_cache_size: int = 20000
    persist_id_cache: bool = True
    allow_direct_connections_only: bool = False
    key: str | None = None                    # OpenAMQ cluster key (None: no key)
    require_client_key: bool = False          # clients must present the key too
    ca_file: str | None = None                # verifies amqps:// connectors
    max_state_bytes: int = 1048576            # cap on the replicated cluster state (OpenAMQ)
    partition: str = "primary"                # OpenAMQ's partition: "primary" (votes) or "secondary"
    primaries: tuple[str, ...] = ()           # the defined primaries' connectors; empty: no root election

    @property
    def elects_root(self) -> bool:
        """OpenAMQ's model: a root is elected among the defined primaries (``primaries`` set)."""
        return bool(self.primaries)

    @property
    def secondary(self) -> bool:
        return self.partition == "secondary"

    @property
    def address_filter(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return parse_address_filter(self.address)

    def clusters(self, address: str) -> bool:
        inc, exc = self.address_filter
        return address_clustered(address, inc, exc)

    @property
    def weak_password(self) -> bool:
        """Warn at start: no password given, or Artemis's sample one."""
        return not self.password_set or self.password in (DEFAULT_CLUSTER_PASSWORD, SAMPLE_CLUSTER_PASSWORD)


@dataclass(frozen=True)
class BroadcastGroupConfig:
    """``[broadcast-groups.<name>]`` (Artemis ``broadcast-group``): announce this node over UDP."""

    name: str
    group_address: str
    group_port: int
    local_bind_address: str = "0.0.0.0"
    local_bind_port: int = -1               # -1: any
    broadcast_period_ms: int = 2000
    connectors: tuple[str, ...] = ()        # empty: the cluster's connector (or the first acceptor)


@dataclass(frozen=True)
class DiscoveryGroupConfig:
    """``[discovery-groups.<name>]`` (Artemis ``discovery-group``): listen for announcements."""

    name: str
    group_address: str
    group_port: int
    local_bind_address: str = "0.0.0.0"
    refresh_timeout_ms: int = 10000
    initial_wait_timeout_ms: int = 10000


HA_ROLES = ("primary", "backup")


@dataclass(frozen=True)
class ColocatedConfig:
    """``[ha.colocated]`` (Artemis ``<colocated>``): this primary asks the cluster's other nodes to
    host a backup for it (``request-backup``), and hosts up to ``max-backups`` for others, on
    ports offset by ``backup-port-offset`` (acceptors named in ``excludes`` keep theirs)."""

    request_backup: bool = False
    max_backups: int = 1
    backup_request_retries: int = -1
    backup_request_retry_interval_ms: int = 5000
    backup_port_offset: int = 100
    excludes: tuple[str, ...] = ()


MANAGER_TYPES = ("zookeeper",)


@dataclass(frozen=True)
class ManagerConfig:
    """``[ha.manager]`` (Artemis ``<manager>``, the Apache Curator provider's properties): the
    coordination service that decides which member of a replicated pair serves
    (``broker.ha.quorum``)."""

    type: str = "zookeeper"
    connect_string: str = ""
    namespace: str | None = None
    session_ms: int = 18000
    session_percent: int = 33
    connection_ms: int = 8000
    retries: int = 1
    retries_ms: int = 1000


@dataclass(frozen=True)
class HaConfig:
    """``[ha]`` (Artemis ``<ha-policy>``, Artemis 2.x role names; docs/ha.md): ``live-only``
    (with scale-down) or ``shared-store`` (a primary and its backups on one data directory)."""

    policy: str = "live-only"
    role: str = "primary"
    allow_failback: bool = True          # backup: stop serving when the primary comes back
    failover_on_shutdown: bool = False   # a clean stop lets the backup take over
    wait_for_activation: bool = True     # primary: management API only once active
    restart_backup: bool = True          # backup: after failing back, wait again as a backup
    # replication (Artemis <replication>; docs/ha.md "Replication")
    group_name: str | None = None        # a backup replicates only a primary of the same group
    cluster_name: str | None = None      # the cluster connection to use (must be [cluster] name)
    check_for_live_server: bool = False  # primary: at start, fail back from a backup serving our id
    initial_replication_sync_timeout_ms: int = 30000
    vote_on_replication_failure: bool = False
    quorum_size: int = -1                # -1: the largest cluster size seen
    vote_retries: int = 12
    vote_retry_wait_ms: int = 5000
    quorum_vote_wait_s: int = 30
    max_saved_replicated_journals_size: int = 2
    backup_fsync: bool = True            # the backup fsyncs a batch before confirming it
    colocated: ColocatedConfig | None = None   # [ha.colocated]
    manager: ManagerConfig | None = None       # [ha.manager]: a coordination service instead of the vote
    coordination_id: str | None = None         # the lock's name (default: the pair's node id)
    scale_down: bool = False
    scale_down_group_name: str | None = None
    scale_down_connectors: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)

    @property
    def shared_store(self) -> bool:
        return self.policy == "shared-store"

    @property
    def replication(self) -> bool:
        return self.policy == "replication"
