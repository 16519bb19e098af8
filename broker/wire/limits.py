"""Per-source admission and login throttling: the pure decisions both programs share.

Theory of operation
-------------------
Two small state machines, advanced by ``now`` (monotonic seconds) passed in by the shell; no
clock, no I/O, no trio here (``broker.wire.io.login`` and the two edges are the shells).

:class:`SourceLimiter` — at accept time, per client *source* (an IP address; IPv6 sources are
grouped by their /64, since one host owns a whole /64 and could otherwise spread over it):

* at most ``max_connections_per_source`` open connections,
* at most ``max_unauthenticated_per_source`` connections that have not finished SASL yet (the
  slow-loris budget: silent sockets from one source cannot hold an acceptor's slots),
* at most ``max_connection_rate_per_source`` new connections per second (a token bucket whose
  burst is one second's worth).

``admit`` answers ``ADMIT``, ``REFUSE`` (the shell answers with a clear AMQP error, without
checking credentials, within a short deadline) or ``DROP`` (close at once: a source already has
``max_refusing_per_source`` refusals in flight, so refusing politely would itself be the flood).

:class:`LoginThrottle` — failed logins per source within ``failure_window_s``: the first
``throttle_after_failures`` are answered after the plain ``failure_delay_s``; each further one
doubles the delay up to ``max_failure_delay_s``, and the source gets one password check per
delay (its other attempts meanwhile are refused without a hash); from ``refuse_after_failures`` on, the source's
logins are refused without checking the password until its failures age out of the window
(logins already verified and cached stay accepted: a known good client behind the same address
is not locked out). :class:`FailureMemory` remembers failed (user, password digest) pairs for
the window so a repeated wrong password costs no second hash. Every table is bounded.
"""

from __future__ import annotations

import enum
import ipaddress
from collections import OrderedDict, deque
from dataclasses import dataclass

__all__ = [
    "SourceLimits", "SourceLimiter", "Admission", "LoginSettings", "LoginThrottle", "FailureMemory",
    "source_key", "parse_source_ip", "OncePer",
]


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_source_ip(source: str | None) -> IPAddress | None:
    """``127.0.0.1``, ``::1``, ``127.0.0.1:5672`` or ``[::1]:5672`` -> an address; None if it
    cannot be parsed. IPv4-mapped IPv6 becomes IPv4."""
    if not source:
        return None
    text = source.strip()
    if text.startswith("["):
        text = text[1:text.find("]")] if "]" in text else text[1:]
    elif text.count(":") == 1:
        text = text.split(":", 1)[0]
    text = text.split("%", 1)[0]   # drop an IPv6 zone id
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


_KEYS: dict[str, str] = {}      # source -> key: a connection's address is keyed several times
_KEYS_MAX = 4096                # a flood of addresses empties it (it never grows past this)


def source_key(source: str | None) -> str:
    """The throttling identity of a client address: ``127.0.0.1`` → ``127.0.0.1``; an IPv6
    address → its /64 (``2001:db8:1:2::/64``); IPv4-mapped IPv6 → the IPv4 address. Accepts
    what :func:`parse_source_ip` accepts. Anything unparsable is its own key (bounded length)."""
    if not source:
        return "?"
    key = _KEYS.get(source)
    if key is None:
        key = _source_key(source)
        if len(_KEYS) >= _KEYS_MAX:
            _KEYS.clear()
        _KEYS[source] = key
    return key


def _source_key(source: str) -> str:
    addr = parse_source_ip(source)
    if addr is None:
        return source.strip()[:64]
    if isinstance(addr, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((int(addr) >> 64 << 64, 64)))
    return str(addr)


# -- per-source connection limits ------------------------------------------------------------------

@dataclass(frozen=True)
class SourceLimits:
    """Per-source limits of one acceptor; 0 turns a limit off."""

    max_connections_per_source: int = 1000
    max_unauthenticated_per_source: int = 64
    max_connection_rate_per_source: float = 0.0      # new connections per second
    max_refusing_per_source: int = 8                 # polite refusals in flight per source


class Admission(enum.Enum):
    ADMIT = "admit"
    REFUSE = "refuse"      # answer with an AMQP error (no credentials checked), then close
    DROP = "drop"          # close at once


@dataclass
class _Source:
    connections: int = 0
    unauthenticated: int = 0
    refusing: int = 0
    tokens: float = 0.0
    stamp: float = 0.0


class SourceLimiter:
    """Connection counts and rates per source for one acceptor (or one process)."""

    def __init__(self, limits: SourceLimits, *, max_tracked: int = 65536):
        self.limits = limits
        self.max_tracked = max_tracked
        self._sources: OrderedDict[str, _Source] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sources)

    def _get(self, key: str, now: float) -> _Source:
        s = self._sources.get(key)
        if s is None:
            rate = self.limits.max_connection_rate_per_source
            s = self._sources[key] = _Source(tokens=max(rate, 1.0), stamp=now)
            if len(self._sources) > self.max_tracked:
                self._prune(now)
        else:
            self._sources.move_to_end(key)
        return s

    def _prune(self, now: float) -> None:
        """Forget idle sources, oldest first, down to three quarters of the bound (a source with
        open connections is never forgotten; a forgotten one restarts with a full bucket)."""
        target = self.max_tracked * 3 // 4
        for key in list(self._sources):
            if len(self._sources) <= target:
                break
            s = self._sources[key]
            if s.connections == 0 and s.refusing == 0:
                del self._sources[key]

    def admit(self, key: str, now: float) -> tuple[Admission, str]:
        """Decide for a new connection from ``key`` (see :func:`source_key`). Returns the
        admission and, unless admitted, the reason (a counter name: ``source_connections``,
        ``source_unauthenticated``, ``source_rate``). An admitted connection is counted as open
        and unauthenticated until :meth:`authenticated` / :meth:`release`; a refused one as
        refusing until :meth:`release_refusal`."""
        lim = self.limits
        s = self._get(key, now)
        reason = ""
        if lim.max_connection_rate_per_source > 0:
            rate = lim.max_connection_rate_per_source
            s.tokens = min(max(rate, 1.0), s.tokens + (now - s.stamp) * rate)
            s.stamp = now
            if s.tokens < 1.0:
                reason = "source_rate"
            else:
                s.tokens -= 1.0
        if not reason and lim.max_connections_per_source and s.connections >= lim.max_connections_per_source:
            reason = "source_connections"
        if not reason and lim.max_unauthenticated_per_source and \
                s.unauthenticated >= lim.max_unauthenticated_per_source:
            reason = "source_unauthenticated"
        if not reason:
            s.connections += 1
            s.unauthenticated += 1
            return Admission.ADMIT, ""
        if s.refusing >= lim.max_refusing_per_source:
            return Admission.DROP, reason
        s.refusing += 1
        return Admission.REFUSE, reason

    def refuse(self, key: str, now: float) -> Admission:
        """Refuse a connection from ``key`` for a reason outside this table (an acceptor-wide
        limit): ``REFUSE`` (counted as refusing) or ``DROP`` when the source already has
        ``max_refusing_per_source`` refusals in flight."""
        s = self._get(key, now)
        if s.refusing >= self.limits.max_refusing_per_source:
            return Admission.DROP
        s.refusing += 1
        return Admission.REFUSE

    def authenticated(self, key: str) -> None:
        """An admitted connection finished SASL (it no longer counts as unauthenticated)."""
        s = self._sources.get(key)
        if s is not None and s.unauthenticated > 0:
            s.unauthenticated -= 1

    def release(self, key: str, *, authenticated: bool) -> None:
        """An admitted connection ended (``authenticated``: :meth:`authenticated` was called)."""
        s = self._sources.get(key)
        if s is None:
            return
        s.connections = max(0, s.connections - 1)
        if not authenticated and s.unauthenticated > 0:
            s.unauthenticated -= 1

    def release_refusal(self, key: str) -> None:
        s = self._sources.get(key)
        if s is not None and s.refusing > 0:
            s.refusing -= 1

    def snapshot(self, key: str) -> dict:
        s = self._sources.get(key)
        if s is None:
            return {"connections": 0, "unauthenticated": 0, "refusing": 0}
        return {"connections": s.connections, "unauthenticated": s.unauthenticated, "refusing": s.refusing}


# -- login throttling ------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoginSettings:
    """The users file's ``[login]`` table (see ``broker.wire.io.users``)."""

    failure_delay_s: float = 0.25
    max_failure_delay_s: float = 5.0
    throttle_after_failures: int = 5
    refuse_after_failures: int = 20
    failure_window_s: float = 60.0
    max_concurrent_verifications: int = 0          # 0 = half the cores (at least 1)
    max_pending_verifications: int = 128
    log_interval_s: float = 60.0
    max_tracked_sources: int = 10000
    remembered_failures: int = 4096


class LoginThrottle:
    """Failed logins per source, and what they cost the source's next login."""

    def __init__(self, settings: LoginSettings):
        self.settings = settings
        # source -> (failure timestamps, newest last; at most refuse_after + 1 kept), last log time
        self._failures: OrderedDict[str, deque] = OrderedDict()
        self.should_log = OncePer(settings.log_interval_s, settings.max_tracked_sources)
        """True at most once per ``log_interval_s`` per source (throttling is logged, not every
        attempt)."""
        self._next_verify: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._failures)

    def failures(self, key: str, now: float) -> int:
        """Failures of ``key`` within the window (ending at ``now``)."""
        q = self._failures.get(key)
        if q is None:
            return 0
        horizon = now - self.settings.failure_window_s
        while q and q[0] <= horizon:
            q.popleft()
        if not q:
            del self._failures[key]
            return 0
        return len(q)

    def may_verify(self, key: str, now: float) -> bool:
        """Whether a login of ``key`` may be verified (hashed) now. A source past
        ``throttle_after_failures`` gets one verification per its current delay; its other
        attempts in between are refused without a hash (a flood's hashes are rate-limited, not
        only its answers)."""
        f = self.failures(key, now)
        if f < self.settings.throttle_after_failures:
            return True
        due = self._next_verify.get(key, 0.0)
        if now < due:
            return False
        self._next_verify[key] = now + self.delay(f + 1)
        self._next_verify.move_to_end(key)
        while len(self._next_verify) > self.settings.max_tracked_sources:
            self._next_verify.popitem(last=False)
        return True

    def refusing(self, key: str, now: float) -> bool:
        """True when ``key``'s logins are refused without checking the password."""
        n = self.settings.refuse_after_failures
        return n > 0 and self.failures(key, now) >= n

    def record_failure(self, key: str, now: float) -> int:
        """Count one failed login of ``key``; returns its failures within the window."""
        st = self.settings
        q = self._failures.get(key)
        if q is None:
            q = self._failures[key] = deque(maxlen=max(st.refuse_after_failures, st.throttle_after_failures) + 1)
            while len(self._failures) > st.max_tracked_sources:
                self._failures.popitem(last=False)
        else:
            self._failures.move_to_end(key)
        q.append(now)
        return self.failures(key, now)

    def delay(self, failures: int) -> float:
        """How long after its request a refusal is answered, for a source with ``failures``
        failures in the window (this one included): constant for the first
        ``throttle_after_failures``, then doubling up to ``max_failure_delay_s``."""
        st = self.settings
        if failures <= st.throttle_after_failures:
            return st.failure_delay_s
        extra = failures - st.throttle_after_failures
        return min(st.max_failure_delay_s, st.failure_delay_s * (2.0 ** min(extra, 30)))


class FailureMemory:
    """Recently failed (user, password digest) pairs: a repeated wrong password is refused
    without hashing it again. Bounded (LRU), entries expire after ``ttl_s``."""

    def __init__(self, max_entries: int, ttl_s: float):
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[tuple[str, bytes], float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, user: str, digest: bytes, now: float) -> None:
        if self.max_entries <= 0:
            return
        key = (user, digest)
        self._entries[key] = now + self.ttl_s
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __contains__(self, item) -> bool:  # pragma: no cover - use seen()
        raise TypeError("use seen(user, digest, now)")

    def seen(self, user: str, digest: bytes, now: float) -> bool:
        key = (user, digest)
        expiry = self._entries.get(key)
        if expiry is None:
            return False
        if expiry <= now:
            del self._entries[key]
            return False
        return True


def source_limits_from(t, default: SourceLimits = SourceLimits()) -> SourceLimits:
    """Read the per-source keys of one acceptor table (``broker.wire.io.tomlconfig.Table``; the same
    keys in the broker's ``[acceptors.<name>]`` and the router's ``[[acceptors]]``)."""
    return SourceLimits(
        max_connections_per_source=t.int("max-connections-per-source", default.max_connections_per_source, min=0),
        max_unauthenticated_per_source=t.int("max-unauthenticated-per-source",
                                             default.max_unauthenticated_per_source, min=0),
        max_connection_rate_per_source=float(t.float("max-connection-rate-per-source",
                                                     default.max_connection_rate_per_source, min=0.0)),
        max_refusing_per_source=t.int("max-refusing-per-source", default.max_refusing_per_source, min=0),
    )


class OncePer:
    """At most one ``True`` per key per ``interval_s`` (for log lines about a source); bounded."""

    def __init__(self, interval_s: float, max_keys: int = 10000):
        self.interval_s = interval_s
        self.max_keys = max_keys
        self._last: OrderedDict[str, float] = OrderedDict()

    def __call__(self, key: str, now: float) -> bool:
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            return False
        self._last[key] = now
        self._last.move_to_end(key)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
        return True
