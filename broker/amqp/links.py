"""The engine's public link API: links a broker service owns, on accepted or dialled connections.

A broker service (the cluster bridge, replication, and next the mirrors and the broker
connections' senders and receivers) does not read proton: it owns links through this API.

* **On an accepted connection**, a client attaching to a ``$lodestone.`` address reaches the
  :class:`LinkService` registered for that address prefix in the host's
  :class:`InternalServices` (``EngineHost.services``). The service's ``attach(engine, link)``
  answers with a :class:`LinkHandler` (the link is ours), a refusal ``(condition, description)``,
  or None (not found).
* **On a dialled connection** (client mode, :mod:`broker.amqp.peer`),
  ``engine.open_link(handler, name=, sender=, address=, credit=)`` attaches a link of ours.

Either way the engine calls the handler with an :class:`OwnedLink` and, for what arrives,
bytes plus a settle handle:

* ``on_attached(link)`` once the peer answered the attach; ``on_detached(link, condition)`` when
  the link or its connection ended (``condition``: the peer's error, or None);
* a **receiving** link: ``on_message(link, data, delivery)`` for each complete transfer — ``data``
  is the encoded message, ``delivery`` an :class:`Incoming` the handler settles (``accept``,
  ``accept_when_synced``: after the journal's next fsync, ``release``, ``reject``). The engine
  keeps the link's credit topped up to the ``credit`` it was given;
* a **sending** link: ``on_credit(link)`` when the peer granted credit; ``link.send(data, token)``
  writes a message (``token=None``: pre-settled), and ``on_outcome(link, token, outcome)`` reports
  the peer's settlement of an unsettled one (``accepted``, ``rejected``, ``released``, ``modified``).

The handler methods a link does not use may be left out of a handler class; the engine calls
only those of the link's direction.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, Protocol

from proton import Delivery, Link

from broker.amqp.pn import (from_buffer, pn_delivery, pn_delivery_settle, pn_delivery_settled, pn_delivery_update,
                            pn_link_advance, pn_link_credit, pn_link_flow, pn_link_send)

if TYPE_CHECKING:  # pragma: no cover
    from broker.amqp.engine import AmqpEngine

__all__ = ["OwnedLink", "Incoming", "LinkHandler", "LinkService", "InternalServices", "OUTCOMES"]

#: a remote delivery state (proton's numbers) → the outcome name a handler gets
OUTCOMES = {Delivery.ACCEPTED: "accepted", Delivery.REJECTED: "rejected", Delivery.RELEASED: "released",
            Delivery.MODIFIED: "modified"}


class OwnedLink:
    """One link a broker service owns: its direction, address, credit, and ``send``."""

    __slots__ = ("engine", "raw", "name", "address", "is_sender", "credit_window", "handler", "inflight",
                 "_tags", "capabilities", "properties")

    def __init__(self, engine: "AmqpEngine", raw, *, name: str, address: str, is_sender: bool,
                 credit_window: int = 0) -> None:
        self.engine = engine
        self.raw = raw                  # the pn_link_t* (cffi pointer)
        self.name = name
        self.address = address
        self.is_sender = is_sender      # True: we send on it (the peer receives)
        self.credit_window = credit_window   # a receiving link: credit kept topped up to this
        self.handler: Any = None
        self.inflight: dict = {}        # raw pn_delivery_t* -> token (unsettled sends)
        self._tags = itertools.count(1)
        #: what our attach carries: capabilities (on the target terminus) and link properties —
        #: set before the attach is sent (answering: in ``LinkService.attach``)
        self.capabilities: tuple[str, ...] = ()
        self.properties: dict[str, Any] = {}

    @property
    def is_receiver(self) -> bool:
        return not self.is_sender

    @property
    def credit(self) -> int:
        return pn_link_credit(self.raw)

    def send(self, data: bytes, token: Any = None) -> None:
        """Write one encoded message. ``token=None``: pre-settled (nothing comes back); else the
        peer's settlement comes back as ``on_outcome(link, token, outcome)``."""
        fb = from_buffer
        tag = b"%x" % next(self._tags)
        d = pn_delivery(self.raw, (len(tag), fb(tag)))
        pn_link_send(self.raw, fb(data), len(data))
        pn_link_advance(self.raw)
        if token is None:
            pn_delivery_settle(d)
        else:
            self.inflight[d] = token  # cffi pointers hash by address

    def flow(self, n: int) -> None:
        """Grant the peer ``n`` more credit (a receiving link)."""
        pn_link_flow(self.raw, n)

    def wake(self) -> None:
        """Say the connection has output (after sends made outside the engine's event handling)."""
        self.engine.wake()

    @property
    def remote_capabilities(self) -> tuple[str, ...]:
        """The capabilities of the peer's target terminus (where ``capabilities`` go, see the
        engine's ``_attach_extras``)."""
        data = self.proton.remote_target.capabilities
        data.rewind()
        try:
            caps = data.get_object() if data.next() is not None else None
        except Exception:   # not a type proton maps to Python: no capabilities we know
            return ()
        caps = getattr(caps, "elements", caps)    # an AMQP array comes as proton's Array
        if isinstance(caps, (list, tuple)):
            return tuple(str(c) for c in caps)
        return (str(caps),) if caps else ()

    @property
    def remote_properties(self) -> dict[str, Any]:
        """The properties of the peer's attach (keys as strings)."""
        props = self.proton.remote_properties
        return {str(k): v for k, v in props.items()} if props else {}

    @property
    def proton(self) -> Link:
        """The proton ``Link`` (for what this API does not cover: a test, a terminus)."""
        return Link.wrap(self.raw)


class Incoming:
    """The settle handle of one received message: settle it exactly once."""

    __slots__ = ("engine", "raw")

    def __init__(self, engine: "AmqpEngine", raw) -> None:
        self.engine = engine
        self.raw = raw  # the pn_delivery_t*

    def accept(self) -> None:
        self.engine.accept(self.raw)

    def accept_when_synced(self) -> None:
        """Accept once what was journaled so far is durable (the host's group commit)."""
        self.engine.accept_when_synced(self.raw)

    def release(self) -> None:
        self._settle_as(Delivery.RELEASED)

    def reject(self, condition: str, description: str) -> None:
        self.engine.reject(self.raw, condition, description)

    def settle(self, outcome: str) -> None:
        """``accept``, ``release`` or ``reject`` (the latter without an error) by name."""
        if outcome == "released":
            self._settle_as(Delivery.RELEASED)
        elif outcome == "rejected":
            self._settle_as(Delivery.REJECTED)
        else:
            self.accept()

    def _settle_as(self, state) -> None:
        d = self.raw
        if not pn_delivery_settled(d):
            pn_delivery_update(d, state)
        pn_delivery_settle(d)
        self.engine.wake()


class LinkHandler(Protocol):
    """What the engine calls on a link a service owns (see the module docstring)."""

    def on_attached(self, link: OwnedLink) -> None: ...

    def on_detached(self, link: OwnedLink, condition: Any) -> None: ...

    def on_credit(self, link: OwnedLink) -> None: ...           # sending links

    def on_outcome(self, link: OwnedLink, token: Any, outcome: str) -> None: ...   # sending links

    def on_message(self, link: OwnedLink, data: bytes, delivery: Incoming) -> None: ...   # receiving links


class LinkService(Protocol):
    """A broker service that serves attaches to its internal addresses."""

    def attach(self, engine: "AmqpEngine", link: OwnedLink) -> "LinkHandler | tuple[str, str] | None":
        """A client attached ``link`` (its ``address``, ``is_sender`` say which): a handler to own
        it, a refusal ``(condition, description)``, or None (no such address)."""


class InternalServices:
    """The host's registry of internal services by address prefix (the longest prefix wins)."""

    def __init__(self) -> None:
        self._by_prefix: dict[str, LinkService] = {}

    def register(self, prefix: str, service: LinkService) -> None:
        if prefix in self._by_prefix:
            raise ValueError(f"an internal service is registered for {prefix!r} already")
        self._by_prefix[prefix] = service

    def unregister(self, prefix: str) -> None:
        self._by_prefix.pop(prefix, None)

    def find(self, address: str) -> LinkService | None:
        best = None
        for prefix, service in self._by_prefix.items():
            if address.startswith(prefix) and (best is None or len(prefix) > len(best[0])):
                best = (prefix, service)
        return best[1] if best else None

    def prefixes(self) -> list[str]:
        return sorted(self._by_prefix)
