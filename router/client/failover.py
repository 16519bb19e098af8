"""A blocking connection that survives a broker failover (python-qpid-proton; docs/clients.md,
"Failover"; docs/ha.md).

    conn = FailoverConnection("amqp://app:secret@router.example:5672")       # or a URL list
    snd = conn.sender("orders")
    snd.send(Message(body="..."))          # retried across a failover, stored once
    rcv = conn.receiver("orders")
    m = rcv.receive(timeout=10); rcv.accept()
    conn.close()

Theory of operation
-------------------
A :class:`FailoverConnection` holds one ``BlockingConnection`` (opened with
:func:`router.client.connect_following_redirects`, so a router's redirect is followed too) and
the URLs it may reach the same broker at: the ones it was given, then every backup a broker named
in its Open's ``failover-server-list`` (Artemis's property, docs/ha.md). When a call fails
because the connection or a link was lost, it reconnects — the URL that worked last first, then
the others in order, waiting ``retry_interval_s`` (doubling up to ``max_retry_interval_s``)
between rounds, for at most ``reconnect_timeout_s`` — re-creates every link it had, and retries
the call. ``failovers`` counts the reconnections.

**Once and only once.** Every message a :class:`FailoverSender` sends carries Artemis's
duplicate-id application property ``_AMQ_DUPL_ID`` (a UUID, unless the application set one).
A send whose outcome was lost with the connection is sent again, with the same id, after the
reconnection: if the broker had stored it (the acknowledgement was what got lost), its duplicate
detection drops the copy and accepts the send; if not, it is stored now. Either way the message
is stored once, and ``send`` returns only when it is.

**Receivers** are at least once: a message received but not yet accepted when the connection
was lost is delivered again after the failover (``accept`` of a message from the lost link
raises :class:`FailoverError`; the redelivery comes on the new link). Applications that must not
process a message twice keep the ids they processed (the chaos test does: it counts them).

A call that cannot complete within ``reconnect_timeout_s`` raises :class:`FailoverError`, naming
the failover, the URLs tried and the last error.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from proton import ConnectionException, LinkException, Message, TransportException
from proton.utils import ConnectionClosed, LinkDetached, SendException

from router.client.topology import parse_urls

__all__ = ["FailoverConnection", "FailoverSender", "FailoverReceiver", "FailoverError", "DeliveryLost",
           "DUPLICATE_ID"]

DUPLICATE_ID = "_AMQ_DUPL_ID"
_LOST = (ConnectionException, ConnectionClosed, LinkDetached, LinkException, TransportException, OSError)


class FailoverError(ConnectionError):
    """A blocking call could not complete across a failover."""

    def __init__(self, what: str, tried: list[str], last: BaseException | None, elapsed_s: float):
        super().__init__(f"{what}: the connection was lost and no broker could be reached again within "
                         f"{elapsed_s:.1f} s (failover; tried {', '.join(tried) or 'nothing'}; last error: "
                         f"{last!r})")
        self.tried = tried
        self.last = last


class DeliveryLost(FailoverError):
    """``accept`` of a message that came on a link lost in a failover: the broker delivers it
    again on the new link."""

    def __init__(self, address: str, cause: BaseException | None = None):
        ConnectionError.__init__(self, f"accept on {address!r}: the message came on a connection lost in a "
                                       "failover; the broker delivers it again")
        self.tried = []
        self.last = cause


def _learned_urls(conn, template: str) -> list[str]:
    """``failover-server-list`` of the broker's Open → URLs (credentials of ``template``)."""
    props = getattr(conn.conn, "remote_properties", None) or {}
    fsl = props.get("failover-server-list") if isinstance(props, dict) else None
    out = []
    for m in fsl or ():
        try:
            m = dict(m)
            host, port = str(m["network-host"]), int(m["port"])
            scheme = str(m.get("scheme") or "amqp")
        except (KeyError, TypeError, ValueError):
            continue
        userinfo = template.split("://", 1)[1].rpartition("@")[0]
        out.append(f"{scheme}://{userinfo + '@' if userinfo else ''}{host}:{port}")
    return out


class FailoverConnection:
    """See the module doc. ``urls``: one URL, a list, or ``(url,url,...)``; ``kwargs`` go to
    ``BlockingConnection`` (``user``, ``password``, ``allowed_mechs``, ``timeout``, …)."""

    def __init__(self, urls, *, reconnect_timeout_s: float = 30.0, retry_interval_s: float = 0.1,
                 max_retry_interval_s: float = 2.0, **kwargs: Any) -> None:
        self.urls = parse_urls(urls)
        self.learned: list[str] = []
        self.reconnect_timeout_s = reconnect_timeout_s
        self.retry_interval_s = retry_interval_s
        self.max_retry_interval_s = max_retry_interval_s
        self.kwargs = kwargs
        self.links: list = []
        self.failovers = 0
        self.current: str | None = None
        self.conn = None
        self._open(first=True)

    # -- connecting ------------------------------------------------------------------------------
    def _candidates(self) -> list[str]:
        order = ([self.current] if self.current else []) + self.urls + self.learned
        return list(dict.fromkeys(order))

    def _open(self, first: bool = False, why: BaseException | None = None) -> None:
        from router.client.blocking import connect_following_redirects

        start = time.monotonic()
        wait = self.retry_interval_s
        tried: list[str] = []
        last = why
        while True:
            for url in self._candidates():
                if url not in tried:
                    tried.append(url)
                try:
                    conn = connect_following_redirects(url, **self.kwargs)
                except Exception as exc:   # refused, reset, redirect trouble: the next one
                    last = exc
                    continue
                self.conn = conn
                self.current = url
                for u in _learned_urls(conn, url):
                    if u not in self.learned and u not in self.urls:
                        self.learned.append(u)
                return
            elapsed = time.monotonic() - start
            if elapsed + wait > self.reconnect_timeout_s:
                raise FailoverError("connect" if first else "reconnect", tried, last, elapsed)
            time.sleep(wait)
            wait = min(wait * 2, self.max_retry_interval_s)

    def reconnect(self, why: BaseException | None = None) -> None:
        """Open a new connection (see the module doc) and re-create every link on it."""
        old = self.conn
        self.conn = None
        if old is not None:
            try:
                old.close()
            except Exception:
                pass
        self._open(why=why)
        self.failovers += 1
        for link in self.links:
            link._attach()

    # -- links -----------------------------------------------------------------------------------
    def sender(self, address: str) -> "FailoverSender":
        s = FailoverSender(self, address)
        self.links.append(s)
        return s

    def receiver(self, address: str, credit: int = 100) -> "FailoverReceiver":
        r = FailoverReceiver(self, address, credit)
        self.links.append(r)
        return r

    def _retrying(self, what: str, call):
        """Run ``call()``; when the connection or a link is lost, reconnect and run it again,
        until ``reconnect_timeout_s`` has passed since the first loss."""
        start = None
        while True:
            try:
                return call()
            except _LOST as exc:
                if start is None:
                    start = time.monotonic()
                elapsed = time.monotonic() - start
                if elapsed > self.reconnect_timeout_s:
                    raise FailoverError(what, self._candidates(), exc, elapsed) from exc
                try:
                    self.reconnect(exc)
                except FailoverError as fe:
                    raise FailoverError(what, fe.tried, fe.last, time.monotonic() - start) from exc

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.close()
            finally:
                self.conn = None


class FailoverSender:
    """A sender whose ``send`` is retried across a failover with the message's duplicate id."""

    def __init__(self, owner: FailoverConnection, address: str) -> None:
        self.owner = owner
        self.address = address
        self.link = None
        self.resent = 0
        self._attach()

    def _attach(self) -> None:
        self.link = self.owner.conn.create_sender(self.address)

    def send(self, msg: Message, timeout: float | None = None) -> None:
        """Send ``msg`` (stamped with ``_AMQ_DUPL_ID`` if it has none) and return once a broker
        accepted it; raises :class:`FailoverError` if no broker can be reached again in time,
        proton's ``SendException`` if the broker refused the message."""
        if msg.properties is None:
            msg.properties = {}
        msg.properties.setdefault(DUPLICATE_ID, str(uuid.uuid4()))
        attempts = 0

        def call():
            nonlocal attempts
            attempts += 1
            if attempts > 1:
                self.resent += 1
            try:
                self.link.send(msg, timeout=timeout)
            except SendException as exc:   # released (the broker went away meanwhile): send again
                if getattr(exc, "state", None) is not None and "RELEASED" in str(exc.state).upper():
                    raise ConnectionException("released") from exc
                raise

        self.owner._retrying(f"send to {self.address!r}", call)


class FailoverReceiver:
    """A receiver re-created after a failover (at least once: see the module doc)."""

    def __init__(self, owner: FailoverConnection, address: str, credit: int) -> None:
        self.owner = owner
        self.address = address
        self.credit = credit
        self.link = None
        self.generation = 0
        self._last_generation = -1
        self._attach()

    def _attach(self) -> None:
        self.link = self.owner.conn.create_receiver(self.address, credit=self.credit)
        self.generation += 1

    def receive(self, timeout: float | None = None) -> Message:
        """The next message; proton's ``Timeout`` if none within ``timeout``."""
        def call():
            m = self.link.receive(timeout=timeout)
            self._last_generation = self.generation
            return m
        return self.owner._retrying(f"receive from {self.address!r}", call)

    def accept(self) -> None:
        """Accept the last message received; raises :class:`FailoverError` when it came on a link
        lost since (the broker delivers it again)."""
        if self._last_generation != self.generation:
            raise DeliveryLost(self.address)
        try:
            self.link.accept()
        except _LOST as exc:
            raise DeliveryLost(self.address, exc) from exc
