"""Pure decisions of the redirect-following clients: what to do with the router's Close.

Theory of operation. A Lodestone router in ``redirect`` mode (like an Artemis connection router)
answers a client's Open with an Open carrying ``amqp:connection-establishment-failed = true``,
then a Close (AMQP 1.0 §2.7.9, §2.8.16):

* ``amqp:connection:redirect`` with info ``{network-host, port}`` (plus ``hostname``, the
  virtual host, when the router names one): connect there instead (a *hop*);
* ``amqp:connection:forced``, "Connection router <r> is not ready (…)": the pool is below its
  quorum or has no target; Artemis documents this as transient (REFUSED_UNAVAILABLE), so try the
  front door again after a back-off (or ask the management API, :mod:`router.client.lookup`);
* ``amqp:connection:forced``, "Connection router <r> rejected this connection": the router will
  never take this client (REFUSED_USE_ANOTHER): give up at once.

:class:`HopPlan` holds one connection attempt's journey (front door, hops so far, refusals) and
turns each Close into a :class:`Follow`, :class:`Retry` or :class:`GiveUp` decision. It does no
I/O and reads no clock: the Python helpers (blocking and event-driven) share it, and the rhea
module (``clients/node/lodestone-redirect.js``) implements the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import quote, unquote, urlsplit

from router.client.errors import RedirectError, RedirectLoop, RouterRefused, TooManyRedirects

REDIRECT = "amqp:connection:redirect"
FORCED = "amqp:connection:forced"
ESTABLISHMENT_FAILED = "amqp:connection-establishment-failed"

#: Back-off before each retry of the front door after a "not ready" refusal (seconds).
DEFAULT_REFUSAL_BACKOFF_S = (0.25, 0.5, 1.0)


@dataclass(frozen=True)
class Follow:
    """Connect to ``url`` now (``virtual_host`` for the Open hostname / SNI, or None)."""

    url: str
    virtual_host: str | None


@dataclass(frozen=True)
class Retry:
    """Connect to the front door ``url`` again after ``delay_s``."""

    url: str
    delay_s: float


@dataclass(frozen=True)
class GiveUp:
    """Stop; ``error`` says why (the application sees it)."""

    error: Exception


def is_failed_open(properties) -> bool:
    """True if an Open's properties carry ``amqp:connection-establishment-failed = true``
    (§2.7.1: the peer will follow it with a Close; the connection is not usable)."""
    if not properties:
        return False
    try:
        return bool(properties.get(ESTABLISHMENT_FAILED))
    except AttributeError:
        return False


@dataclass
class HopPlan:
    """One journey through the front door. ``hops`` lists the URLs visited, in order."""

    front_door: str
    max_hops: int = 5
    refusal_backoff_s: tuple[float, ...] = DEFAULT_REFUSAL_BACKOFF_S
    virtual_host: str | None = None
    hops: list[str] = field(default_factory=list)
    refusals: int = 0

    def __post_init__(self) -> None:
        parts = urlsplit(self.front_door)
        self._scheme = parts.scheme or "amqp"
        userinfo = ""
        if parts.username is not None:
            userinfo = quote(unquote(parts.username), safe="")
            if parts.password is not None:
                userinfo += ":" + quote(unquote(parts.password), safe="")
            userinfo += "@"
        self._userinfo = userinfo
        self._path = parts.path
        self._front_key = (parts.hostname, parts.port, self.virtual_host)
        self.restart()

    def restart(self) -> None:
        """Back at the front door (new journey: hops and loop memory cleared, refusals kept)."""
        self.hops = [self.front_door]
        self._visited = {self._front_key}
        self._current_vhost = self.virtual_host

    def established(self) -> None:
        """The current hop opened for real: forget refusals (the next journey starts afresh)."""
        self.refusals = 0

    def on_close(self, condition: str | None, description: str | None, info) -> Follow | Retry | GiveUp | None:
        """Decide what the Close that followed a failed-establishment Open means. ``None``:
        not ours to handle (the caller reports the peer's error as it is)."""
        if condition == REDIRECT:
            return self._redirect(description, dict(info or {}))
        if condition == FORCED:
            self.refusals += 1
            what = description or FORCED
            if "rejected this connection" in what:
                return GiveUp(RouterRefused(what, self.refusals, list(self.hops), transient=False))
            if self.refusals > len(self.refusal_backoff_s):
                return GiveUp(RouterRefused(what, self.refusals, list(self.hops), transient=True))
            delay = self.refusal_backoff_s[self.refusals - 1]
            self.restart()
            return Retry(self.front_door, delay)
        return None

    def _redirect(self, description, info: dict) -> Follow | GiveUp:
        info = {str(k): v for k, v in info.items()}
        host, port = info.get("network-host"), info.get("port")
        if not isinstance(host, str) or not host or port is None:
            return GiveUp(RedirectError(f"redirect without network-host/port: {description!r} {info!r}", self.hops))
        try:
            port = int(port)
        except (TypeError, ValueError):
            return GiveUp(RedirectError(f"redirect with a bad port {port!r}", self.hops))
        target = f"{host}:{port}"
        if len(self.hops) > self.max_hops:
            return GiveUp(TooManyRedirects(f"more than {self.max_hops} redirects, the next to {target}", self.hops))
        vhost = info.get("hostname") or self._current_vhost
        key = (host, port, vhost)
        if key in self._visited:
            return GiveUp(RedirectLoop(f"redirect loop back to {target}", self.hops + [self.url_for(host, port)]))
        self._visited.add(key)
        self._current_vhost = vhost
        url = self.url_for(host, port)
        self.hops.append(url)
        return Follow(url, str(vhost) if vhost else None)

    def url_for(self, host: str, port: int, scheme: str | None = None) -> str:
        """The front door's scheme, credentials and path on another host and port."""
        netloc_host = f"[{host}]" if ":" in host else host
        return f"{scheme or self._scheme}://{self._userinfo}{netloc_host}:{int(port)}{self._path}"
