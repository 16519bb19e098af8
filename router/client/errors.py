"""Errors of the redirect-following client helpers.

All are Remote errors in the STYLE sense (the router or the network did something the helper
cannot get past); each names the condition it stands for (``condition``) and the URLs visited
(``hops``), so an application can log one line that says what happened.
"""

from __future__ import annotations


class RedirectError(ConnectionError):
    """Following redirects failed (too many hops, a loop, or a malformed redirect)."""

    condition = "amqp:connection:redirect"

    def __init__(self, message: str, hops: list[str]):
        super().__init__(f"{message} (hops: {' -> '.join(hops)})")
        self.hops = hops


class TooManyRedirects(RedirectError):
    """More than ``max_hops`` redirects."""


class RedirectLoop(RedirectError):
    """A redirect pointed back to an address already visited."""


class RouterRefused(ConnectionError):
    """The router refused the connection (``amqp:connection:forced``) and the helper gave up:
    at once for "rejected this connection" (``transient`` false, Artemis REFUSED_USE_ANOTHER),
    after its bounded retries for "is not ready" (``transient`` true, REFUSED_UNAVAILABLE)."""

    condition = "amqp:connection:forced"

    def __init__(self, description: str, attempts: int, hops: list[str], *, transient: bool):
        how = f"gave up after {attempts} attempts" if transient else "not retried: the router will not take this client"
        super().__init__(f"{description} ({how}; last: {' -> '.join(hops)})")
        self.description = description
        self.attempts = attempts
        self.hops = hops
        self.transient = transient


class NoBrokerReachable(ConnectionError):
    """The topology-aware connector (:class:`router.client.balanced.ClusterConnector`) tried every
    member it knows and every starting URL, and none took the connection. ``attempts`` lists
    ``(url, exception)`` in the order tried."""

    def __init__(self, attempts: list[tuple[str, Exception]]):
        tried = "; ".join(f"{url}: {exc}" for url, exc in attempts)
        super().__init__(f"no broker took the connection ({tried})")
        self.attempts = attempts
        self.urls = [url for url, _ in attempts]
