"""Key resolution: from what the edge learned about a connection to the routing key (spec §3).

The key types are Artemis's: CLIENT_ID (AMQP container-id), SNI_HOST, SOURCE_IP, USER_NAME and
ROLE_NAME. A missing value becomes the literal ``NULL``; a key-filter keeps the whole ``find()``
match or yields ``NULL``. ROLE_NAME is special: the filter *selects* the first role (in the
order the roles are listed) it finds a match in and returns that match, skipping the generic step.

Two deliberate choices, both named in ``KeyResolver``:
* ``SNI_HOST`` is lower-cased (Artemis's Netty SNI handler lower-cases before the resolver);
  ``sni_lowercase=False`` gives the bare resolver the vectors were taken from.
* ``SOURCE_IP``: in Lodestone mode the port is stripped and an IPv6 address is given without
  brackets in compressed form (``::1``). In Artemis mode (``artemis_keys=True``) the exact
  Artemis string rule runs (strip a leading ``/``, cut at the last ``:``), and a bracketed IPv6
  literal is printed as Java prints it (``[0:0:0:0:0:0:0:1]``), so hashes agree with a real
  Artemis broker.
"""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass

from .filters import Filter
from .policies.base import NULL_KEY

ARTEMIS_INTERNAL_CLIENT_PREFIX = "$.artemis.internal.router.client."
"""Client ids Artemis routes straight to the local target (its own probe connections)."""


@dataclass(frozen=True, slots=True)
class ConnectionInfo:
    """What the edge learned about one client connection (the contract in docs/architecture.md)."""

    source: str                      # peer address "host:port", IPv6 as "[addr]:port"
    sni_host: str | None = None
    container_id: str | None = None  # AMQP Open container-id (the CLIENT_ID key)
    user: str | None = None          # authenticated user, None if anonymous
    roles: tuple[str, ...] = ()      # the user's roles in users-file order
    acceptor: str = ""


class KeyType(enum.Enum):
    """Artemis ``KeyType``."""

    CLIENT_ID = "CLIENT_ID"
    SNI_HOST = "SNI_HOST"
    SOURCE_IP = "SOURCE_IP"
    USER_NAME = "USER_NAME"
    ROLE_NAME = "ROLE_NAME"

    @classmethod
    def parse(cls, value: str) -> "KeyType":
        """Parse a key type name (exact, upper-case, as Artemis); ValueError lists the valid ones."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"must be one of {', '.join(k.value for k in cls)}") from None


def java_inet6_text(addr: ipaddress.IPv6Address, scope: str | None) -> str:
    """``Inet6Address.getHostAddress()``: 8 groups, lower-case hex, no zero compression."""
    packed = addr.packed
    text = ":".join(format((packed[i] << 8) | packed[i + 1], "x") for i in range(0, 16, 2))
    return f"{text}%{scope}" if scope else text


def artemis_source_key(source: str, java_ipv6: bool = True) -> str:
    """Artemis's SOURCE_IP rule: strip a leading ``/``, then cut at the last ``:`` if it is > 0."""
    has_prefix = source.startswith("/")
    d = source.rfind(":")
    if has_prefix or d > 0:
        source = source[1 if has_prefix else 0: d if d > 0 else len(source)]
    if java_ipv6 and len(source) > 2 and source[0] == "[" and source[-1] == "]":
        inner = source[1:-1]
        addr, _, scope = inner.partition("%")
        try:
            ip = ipaddress.IPv6Address(addr)
        except ValueError:
            return source
        return f"[{java_inet6_text(ip, scope or None)}]"
    return source


def lodestone_source_key(source: str) -> str:
    """Host part of ``host:port`` / ``[v6]:port``; an IPv6 address compressed, without brackets."""
    if source.startswith("["):
        end = source.find("]")
        host = source[1:end] if end > 0 else source[1:]
    else:
        host = source
        try:  # a bare address without port (IPv4 or unbracketed IPv6)
            ipaddress.ip_address(source.partition("%")[0])
        except ValueError:
            head, sep, _port = source.rpartition(":")
            if sep:
                host = head
    addr, pct, scope = host.partition("%")
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)  # ::ffff:10.0.0.1 from a dual-stack socket is an IPv4 client
    return f"{ip}%{scope}" if pct else str(ip)


class KeyResolver:
    """Resolve the routing key of a connection (Artemis ``KeyResolver``).

    ``resolve(conn) -> (raw, key)``: ``raw`` is the value before the key filter (``None`` when
    the connection has none), ``key`` the filtered key (``NULL`` when missing or unmatched).
    """

    __slots__ = ("key_type", "key_type_name", "key_filter", "artemis_keys", "sni_lowercase",
                 "_get")

    def __init__(self, key_type: KeyType = KeyType.SOURCE_IP, key_filter: Filter | None = None, *,
                 artemis_keys: bool = False, sni_lowercase: bool = True) -> None:
        self.key_type = key_type
        self.key_type_name = key_type.value  # read per decision; Enum.value is a descriptor
        self.key_filter = key_filter
        self.artemis_keys = artemis_keys
        self.sni_lowercase = sni_lowercase
        self._get = {
            KeyType.CLIENT_ID: self._client_id,
            KeyType.SNI_HOST: self._sni,
            KeyType.SOURCE_IP: self._source,
            KeyType.USER_NAME: self._user,
            KeyType.ROLE_NAME: None,
        }[key_type]

    @staticmethod
    def _client_id(conn: ConnectionInfo) -> str | None:
        return conn.container_id

    @staticmethod
    def _user(conn: ConnectionInfo) -> str | None:
        return conn.user

    def _sni(self, conn: ConnectionInfo) -> str | None:
        sni = conn.sni_host
        if sni is not None and self.sni_lowercase:
            return sni.lower()
        return sni

    def _source(self, conn: ConnectionInfo) -> str | None:
        src = conn.source
        if src is None:
            return None
        if self.artemis_keys:
            return artemis_source_key(src)
        return lodestone_source_key(src) if src else src

    def resolve(self, conn: ConnectionInfo) -> tuple[str | None, str]:
        """Return ``(raw value or None, filtered key)``."""
        flt = self.key_filter
        if self._get is None:  # ROLE_NAME
            roles = conn.roles
            if not roles:
                return None, NULL_KEY
            if flt is None:
                return roles[0], roles[0]
            for role in roles:
                found = flt.find(role)
                if found is not None:
                    return role, found
            return roles[0], NULL_KEY
        raw = self._get(conn)
        if raw is None:
            return None, NULL_KEY
        if flt is None:
            return raw, raw
        found = flt.find(raw)
        return raw, (NULL_KEY if found is None else found)
