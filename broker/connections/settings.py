"""The broker connections' settings: ``[broker-connections.<name>]`` in the broker TOML (pure).

Artemis's ``<broker-connections><amqp-connection>`` (seed 002; docs/broker-connections.md): a
connection this broker dials to another AMQP 1.0 endpoint, with the senders and receivers that
move messages over it. Names and defaults are Artemis's, units in the names.

The URI is Artemis's: ``amqp://host:port`` (``amqps://`` for TLS; the seed's ``tcp://`` is read
as ``amqp://``), with alternate hosts after ``#``, comma-separated, each a full URI or a bare
``host:port`` (which takes the first URI's scheme): ``amqp://a:5672#amqp://b:5672,c:5672``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BrokerConnectionConfig", "LinkElement", "MirrorConfig", "AddressFilter", "parse_uri", "DEFAULT_PORTS"]

DEFAULT_PORTS = {"amqp": 5672, "amqps": 5671}
_SCHEMES = {"amqp": "amqp", "tcp": "amqp", "amqps": "amqps"}


def _endpoint(text: str, default_scheme: str | None) -> str:
    """One endpoint as ``scheme://host:port`` (IPv6 hosts in brackets)."""
    text = text.strip()
    if not text:
        raise ValueError("an empty host")
    if "://" in text:
        scheme, rest = text.split("://", 1)
        scheme = scheme.lower()
        if scheme not in _SCHEMES:
            raise ValueError(f"{scheme}:// is not one of amqp://, amqps://, tcp://")
        scheme = _SCHEMES[scheme]
    elif default_scheme is None:
        raise ValueError(f"{text!r} needs a scheme (amqp://, amqps:// or tcp://)")
    else:
        scheme, rest = default_scheme, text
    rest = rest.split("?", 1)[0].rstrip("/")
    if "/" in rest or "@" in rest:
        raise ValueError(f"{text!r}: only scheme://host:port (no path, no user)")
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        port_text = tail[1:] if tail.startswith(":") else ""
        if tail and not tail.startswith(":"):
            raise ValueError(f"{text!r}: a bracketed IPv6 host must be followed by :port")
    else:
        host, sep, port_text = rest.rpartition(":")
        if not sep:
            host, port_text = rest, ""
        if ":" in host:
            raise ValueError(f"{text!r}: write an IPv6 host in brackets")
    if not host:
        raise ValueError(f"{text!r} has no host")
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"{text!r}: port {port_text!r} must be 1-65535")
        port = int(port_text)
    else:
        port = DEFAULT_PORTS[scheme]
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}:{port}"


def parse_uri(text: str) -> tuple[str, ...]:
    """The endpoints of a broker connection's ``uri``, first the primary, then the alternates
    (see the module doc). Raises ValueError saying what is wrong."""
    primary, sep, rest = text.partition("#")
    first = _endpoint(primary, None)
    out = [first]
    if sep:
        scheme = first.split("://", 1)[0]
        for part in rest.split(","):
            out.append(_endpoint(part, scheme))
    if len(set(out)) != len(out):
        raise ValueError("an endpoint is listed twice")
    return tuple(out)


@dataclass(frozen=True)
class LinkElement:
    """One ``[[senders]]`` or ``[[receivers]]`` entry: which local queues (``queue_name``) or
    addresses (``address_match``, a wildcard expression) it serves, and the peer's name for the
    destination when it differs (``remote_address``: RabbitMQ's ``/amq/queue/<q>``)."""

    kind: str                          # "sender" | "receiver"
    address_match: str | None = None
    queue_name: str | None = None
    remote_address: str | None = None

    @property
    def destination(self) -> str:
        return f"queue-name {self.queue_name!r}" if self.queue_name is not None \
            else f"address-match {self.address_match!r}"


@dataclass(frozen=True)
class AddressFilter:
    """Artemis's mirror ``address-filter``: a comma list of address prefixes; ``!prefix``
    excludes. An address is mirrored when no exclusion matches it and, if there are inclusions,
    one of them does (an exclusion wins). Empty: every address."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "AddressFilter":
        inc, exc = [], []
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if part.startswith("!"):
                if not part[1:]:
                    raise ValueError("'!' needs a prefix after it")
                exc.append(part[1:])
            else:
                inc.append(part)
        return cls(tuple(inc), tuple(exc))

    def allows(self, address: str) -> bool:
        if any(address.startswith(p) for p in self.exclude):
            return False
        return not self.include or any(address.startswith(p) for p in self.include)


@dataclass(frozen=True)
class MirrorConfig:
    """``[broker-connections.<name>.mirror]`` (Artemis ``<mirror>``)."""

    message_acknowledgements: bool = True
    queue_creation: bool = True
    queue_removal: bool = True
    address_filter: AddressFilter = AddressFilter()
    durable: bool = True                # the store-and-forward queue is journaled
    sync: bool = False                  # a send or commit is answered once the target has its events
    initial_sync: bool = False          # the messages present at the mirror's first start are copied


@dataclass(frozen=True)
class BrokerConnectionConfig:
    """``[broker-connections.<name>]`` (Artemis ``<amqp-connection>``)."""

    name: str
    uris: tuple[str, ...]              # the primary endpoint, then the alternates
    user: str | None = None            # None: SASL ANONYMOUS
    password: str | None = None
    retry_interval_ms: int = 5000
    reconnect_attempts: int = -1       # -1: forever
    auto_start: bool = True
    senders: tuple[LinkElement, ...] = ()
    receivers: tuple[LinkElement, ...] = ()
    ca_file: str | None = None         # verifies an amqps:// peer
    mirror: MirrorConfig | None = None

    @property
    def uri(self) -> str:
        """As Artemis writes it: the primary, then ``#`` and the alternates."""
        return self.uris[0] + ("#" + ",".join(self.uris[1:]) if len(self.uris) > 1 else "")

    @property
    def credentials(self) -> tuple[str, str] | None:
        return (self.user, self.password or "") if self.user is not None else None
