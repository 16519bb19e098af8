"""Users, authentication and permissions: the users file shared by the broker and the router.

The users file (``etc/users.toml``) — every key below is checked; unknown keys are errors::

    # passwords are scrypt hashes made by `lodestone-broker hash-password`
    [users.admin]
    password = "scrypt$n=16384,r=8,p=1$<salt b64>$<hash b64>"   # required
    roles = ["admin", "amq"]          # default []; order is kept (Principal.roles)
    sample = true                     # default false: a sample account whose password is
                                      # published: accepted from loopback sources only, and
                                      # warned about at start (SecurityConfig.warnings())
    sources = ["127.0.0.0/8", "::1/128"]   # optional allow-list of client networks

    [anonymous]                       # SASL ANONYMOUS
    enabled = false                   # default false
    user = "anonymous"                # the principal's name
    roles = ["guest"]

    [login]                           # login flood protection (broker.wire.limits)
    failure-delay-ms = 250            # every refused login is answered this long after its
                                      # request, whatever the reason
    throttle-after-failures = 5       # failures per source within the window before the
                                      # delay starts doubling
    max-failure-delay-ms = 5000       # the doubling stops here
    refuse-after-failures = 20        # then the source is refused without a password check
                                      # (logins verified before stay accepted)
    failure-window-s = 60             # how long a failure counts
    max-concurrent-verifications = 0  # password hashes at once; 0 = half the cores (>= 1)
    max-pending-verifications = 128   # waiting hashes; the most-failing source's are dropped
    log-interval-s = 60               # throttling is logged once per source per interval
    max-tracked-sources = 10000       # bounded memory for the tables above
    remembered-failures = 4096        # failed (user, password) pairs refused without a hash

    [[permissions]]                   # Artemis security-settings
    match = "#"                       # address pattern, Artemis wildcards (below)
    send = ["admin", "app"]           # roles allowed; each list defaults to []
    consume = ["admin", "app"]
    create-address = ["admin", "app"]
    delete-address = ["admin"]
    manage = ["admin"]

Password hashes: ``scrypt$n=N,r=R,p=P$<salt>$<hash>`` with standard base64 (with padding);
N a power of two in [2, 2**20], R in [1, 32], P in [1, 16], a salt of at least 8 bytes and a
hash of at least 16 bytes. ``hash_password`` makes them (16-byte salt, 32-byte hash).

Sources: ``source_ip`` arguments accept a bare address (``127.0.0.1``, ``::1``) or the
``host:port`` / ``[v6]:port`` form of ``ConnectionInfo.source``; IPv4-mapped IPv6 addresses are
treated as IPv4. An unknown source (``None``) never satisfies a sample or ``sources`` rule.

Address wildcards (Artemis syntax): words are separated by ``.``; ``#`` matches zero or more
words, ``*`` exactly one word; ``#`` and ``*`` must be whole words. ``orders.#`` matches
``orders``, ``orders.eu`` and ``orders.eu.paris``; ``orders.*`` matches only ``orders.eu``.

Which ``[[permissions]]`` entry applies: of the entries whose ``match`` matches the address, the
most specific one, and only it (permissions are not merged). Specificity compares the patterns
word by word from the left: a literal word beats ``*``, which beats ``#``; the first differing
word decides; where one pattern has ended, the ended one ranks below a literal or ``*`` (longer
beats shorter) but above ``#`` (a trailing ``#`` that matches nothing adds no specificity).
Two entries with the same pattern: the first in the file wins. No matching entry: denied.
E.g. for address ``orders.eu``: ``orders.eu`` > ``orders.*`` > ``orders.#`` > ``*.eu`` > ``#``;
for ``orders``: ``orders`` > ``orders.#`` > ``#``; for ``x.eu``: ``#.eu`` > ``#``.

Authentication cost: scrypt takes ~50 ms on purpose. ``authenticate`` caches successful
verifications in memory (an LRU of 1024 entries keyed by user and sha256 of the password), so a
client reconnecting with the same credentials costs one hash lookup. A cache miss blocks for the
scrypt time. The trio shells (broker and router) do not call it directly: ``broker.wire.io.login.LoginGate``
asks ``cached`` on the event loop and on a miss runs :meth:`SecurityConfig.verify` on its own
bounded limiter, fairly across sources, with the throttling of the ``[login]`` table.
:meth:`SecurityConfig.verify` costs the same whatever the answer: an unknown user, or a source
the user may not connect from, holds the verification slot for as long as a real hash takes
(measured) without computing one, so timing does not reveal which users exist or where they
may connect from.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import os
import re
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from broker.wire.limits import IPAddress, LoginSettings, parse_source_ip
from broker.wire.wildcards import check_pattern, match_specificity, wildcard_match
from broker.wire.io.tomlconfig import ConfigError, Table, open_config

__all__ = [
    "Principal", "User", "Permission", "SecurityConfig", "PERMISSIONS", "MANAGEMENT_ADDRESS",
    "load_users", "hash_password", "verify_password", "wildcard_match", "match_specificity",
    "parse_source_ip",
]

#: the permission names ``SecurityConfig.check`` accepts
PERMISSIONS = ("send", "consume", "createAddress", "deleteAddress", "manage", "mirror")
_TOML_KEYS = {"send": "send", "consume": "consume", "createAddress": "create-address", "mirror": "mirror",
              "deleteAddress": "delete-address", "manage": "manage"}
_ALIASES = {**{p: p for p in PERMISSIONS}, **{v: k for k, v in _TOML_KEYS.items()}}

#: the address management access is checked against (Artemis' default management address)
MANAGEMENT_ADDRESS = "activemq.management"

_LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
_HASH_RE = re.compile(r"^scrypt\$n=(\d+),r=(\d+),p=(\d+)\$([A-Za-z0-9+/=]+)\$([A-Za-z0-9+/=]+)$")
_CACHE_SIZE = 1024


# -- passwords ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _ScryptHash:
    n: int
    r: int
    p: int
    salt: bytes
    digest: bytes


def _parse_hash(text: str) -> _ScryptHash:
    """Parse ``scrypt$n=..,r=..,p=..$salt$hash``; ValueError says what is wrong."""
    m = _HASH_RE.match(text)
    if not m:
        raise ValueError("not a scrypt hash (expected scrypt$n=N,r=R,p=P$<salt b64>$<hash b64>; "
                         "make one with `lodestone-broker hash-password`)")
    n, r, p = int(m.group(1)), int(m.group(2)), int(m.group(3))
    if n < 2 or n > 1 << 20 or n & (n - 1):
        raise ValueError(f"scrypt n={n} must be a power of two between 2 and 1048576")
    if not 1 <= r <= 32 or not 1 <= p <= 16:
        raise ValueError(f"scrypt r={r}, p={p} out of range (r 1..32, p 1..16)")
    try:
        salt = base64.b64decode(m.group(4), validate=True)
        digest = base64.b64decode(m.group(5), validate=True)
    except ValueError:
        raise ValueError("salt or hash is not valid base64") from None
    if len(salt) < 8 or len(digest) < 16:
        raise ValueError("salt must be >= 8 bytes and hash >= 16 bytes")
    return _ScryptHash(n, r, p, salt, digest)


def _scrypt(h: _ScryptHash, password: str) -> bytes:
    kdf = Scrypt(salt=h.salt, length=len(h.digest), n=h.n, r=h.r, p=h.p)
    return kdf.derive(password.encode("utf-8"))


def hash_password(password: str, *, n: int = 16384, r: int = 8, p: int = 1,
                  salt: bytes | None = None) -> str:
    """Hash a password for the users file: ``scrypt$n=16384,r=8,p=1$<salt b64>$<hash b64>``."""
    salt = os.urandom(16) if salt is None else salt
    h = _parse_hash(f"scrypt$n={n},r={r},p={p}${base64.b64encode(salt).decode()}"
                    f"${base64.b64encode(bytes(32)).decode()}")     # validates the parameters
    digest = _scrypt(h, password)
    return (f"scrypt$n={n},r={r},p={p}${base64.b64encode(salt).decode()}"
            f"${base64.b64encode(digest).decode()}")


def verify_password(stored: str, password: str) -> bool:
    """True if ``password`` matches the ``stored`` hash (constant-time comparison)."""
    h = _parse_hash(stored)
    return hmac.compare_digest(_scrypt(h, password), h.digest)


# -- sources --------------------------------------------------------------------------------------

def _in_networks(addr: IPAddress | None, networks: Sequence) -> bool:
    return addr is not None and any(addr.version == net.version and addr in net for net in networks)


# -- the model ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Principal:
    """An authenticated identity: user name and roles (users-file order)."""

    user: str
    roles: tuple[str, ...]


@dataclass(frozen=True)
class User:
    name: str
    password: str                      # the scrypt hash text
    roles: tuple[str, ...]
    sample: bool = False
    sources: tuple = ()                # ip_network objects; empty = any source


@dataclass(frozen=True)
class Permission:
    """One ``[[permissions]]`` entry: for each permission name, the roles that have it."""

    match: str
    roles: dict = field(default_factory=dict)   # permission name -> frozenset of roles

    def allows(self, permission: str, roles: Sequence[str]) -> bool:
        allowed = self.roles.get(permission, frozenset())
        return any(r in allowed for r in roles)


class SecurityConfig:
    """The loaded users file. Thread-safe; build it with :func:`load_users`."""

    def __init__(self, users: dict[str, User], permissions: list[Permission], *,
                 anonymous_enabled: bool = False, anonymous_user: str = "anonymous",
                 anonymous_roles: tuple[str, ...] = (), file: str = "users.toml",
                 login: LoginSettings | None = None):
        self.users = users
        self.permissions = permissions
        self.anonymous_enabled = anonymous_enabled
        self.anonymous_user = anonymous_user
        self.anonymous_roles = anonymous_roles
        self.file = file
        # most specific first; sorted() is stable, so among equal patterns the first in file wins
        self._ordered = sorted(permissions, key=lambda p: match_specificity(p.match), reverse=True)
        self._cache: OrderedDict[tuple[str, bytes], Principal] = OrderedDict()
        self._cache_lock = threading.Lock()
        #: (mark, cache key) of each login verified or adopted, newest last (``verified_logins``)
        self._verified: deque[tuple[int, tuple[str, bytes]]] = deque(maxlen=_CACHE_SIZE)
        self._verified_mark = 0
        self.logins_adopted = 0        # logins another node verified, cached here (``adopt_logins``)
        self._dummy = _ScryptHash(16384, 8, 1, b"\0" * 16, b"\0" * 32)   # for unknown users
        self.scrypt_calls = 0          # for tests and metrics: cache misses that ran scrypt
        self.login = login or LoginSettings()
        self._scrypt_s: float | None = None   # measured time of one hash (EWMA), for verify()

    # -- authentication -------------------------------------------------------------------------
    def _source_ok(self, user: User, source_ip: str | None) -> bool:
        addr = parse_source_ip(source_ip)
        if user.sample and not _in_networks(addr, _LOOPBACK):
            return False
        if user.sources and not _in_networks(addr, user.sources):
            return False
        return True

    def cached(self, user: str, password: str, source_ip: str | None) -> Principal | None:
        """Non-blocking fast path for event loops: the Principal when this exact login was verified
        before and the source is allowed; None means "not known without scrypt" — then call
        :meth:`authenticate` (in a thread) for the answer."""
        u = self.users.get(user)
        if u is None or not self._source_ok(u, source_ip):
            return None
        key = (user, hashlib.sha256(password.encode("utf-8")).digest())
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def authenticate(self, user: str, password: str, source_ip: str | None) -> Principal | None:
        """SASL PLAIN / HTTP Basic: the Principal, or None (wrong password, unknown user, or a
        source the user may not connect from). Blocks ~50 ms on a cache miss (:meth:`verify`),
        whatever the answer. The shells use ``broker.wire.io.login.LoginGate`` instead (throttled)."""
        hit = self.cached(user, password, source_ip)
        if hit is not None:
            return hit
        return self.verify(user, password, source_ip)

    def digest(self, password: str) -> bytes:
        """The key the login caches use for a password (sha256; the password is never kept)."""
        return hashlib.sha256(password.encode("utf-8")).digest()

    def verify(self, user: str, password: str, source_ip: str | None) -> Principal | None:
        """Blocking password check (run it in a thread) whose duration does not depend on the
        answer: an unknown user or a source the user may not connect from waits as long as a
        real hash takes instead of computing one, so refusals cannot be told apart by time and
        cost no CPU. Caches a success like :meth:`authenticate`."""
        u = self.users.get(user)
        if u is None or not self._source_ok(u, source_ip):
            est = self._scrypt_s
            if est is None:           # nothing measured yet: measure once on a dummy hash
                self._timed_scrypt(self._dummy, password)
            else:
                time.sleep(est)
            return None
        h = _parse_hash(u.password)
        if not hmac.compare_digest(self._timed_scrypt(h, password), h.digest):
            return None
        principal = Principal(u.name, u.roles)
        self._remember((user, self.digest(password)), principal)
        return principal

    def _remember(self, key: tuple[str, bytes], principal: Principal) -> None:
        with self._cache_lock:
            self._cache[key] = principal
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            self._verified_mark += 1
            self._verified.append((self._verified_mark, key))

    # -- verified logins shared with an HA backup ------------------------------------------------
    def _fingerprint(self, u: User) -> bytes:
        """What ties a verified login to the stored hash it was verified against: a node adopts
        it only if its own users file has the same hash for that user."""
        return hashlib.sha256(u.password.encode()).digest()[:16]

    def verified_logins(self, since: int = 0) -> tuple[int, list[tuple[str, bytes, bytes]]]:
        """The logins verified (or adopted) here after mark ``since`` and still cached:
        ``(mark now, [(user, password digest, stored-hash fingerprint)])``, oldest first. A
        replication primary sends them to its backup (``broker.ha.replication``), so the clients
        that fail over to it log in without a password hash each (a reconnect storm costs one
        scrypt per client otherwise, ~50 ms of CPU each, a few at a time)."""
        out = []
        with self._cache_lock:
            mark = self._verified_mark
            for m, key in reversed(self._verified):
                if m <= since:
                    break
                u = self.users.get(key[0])
                if key in self._cache and u is not None:
                    out.append((key[0], key[1], self._fingerprint(u)))
        out.reverse()
        return mark, out

    def adopt_logins(self, entries) -> int:
        """Cache logins another node verified (``verified_logins``' entries) for the users whose
        stored hash here is the one there; returns how many were adopted. A user whose password
        differs here, or who is not here, is skipped: its next login is checked in full."""
        n = 0
        for user, digest, fingerprint in entries:
            u = self.users.get(user)
            if u is None or not hmac.compare_digest(self._fingerprint(u), fingerprint):
                continue
            self._remember((user, digest), Principal(u.name, u.roles))
            n += 1
        self.logins_adopted += n
        return n

    def _timed_scrypt(self, h: _ScryptHash, password: str) -> bytes:
        self.scrypt_calls += 1
        t0 = time.perf_counter()
        out = _scrypt(h, password)
        took = time.perf_counter() - t0
        if h.n == self._dummy.n and h.r == self._dummy.r and h.p == self._dummy.p:
            prev = self._scrypt_s
            self._scrypt_s = took if prev is None else prev * 0.8 + took * 0.2
        return out

    def principal_for_certificate(self, cn: str, source_ip: str | None) -> Principal | None:
        """SASL EXTERNAL: the client certificate's CN must name a known user (no password is
        checked; source rules apply as for passwords)."""
        u = self.users.get(cn)
        if u is None or not self._source_ok(u, source_ip):
            return None
        return Principal(u.name, u.roles)

    def anonymous_principal(self) -> Principal | None:
        """SASL ANONYMOUS: the configured principal, or None when anonymous access is disabled."""
        if not self.anonymous_enabled:
            return None
        return Principal(self.anonymous_user, self.anonymous_roles)

    def warnings(self) -> list[str]:
        """One line per sample account, for the start-up log."""
        name = Path(self.file).name
        return [f"{name}: user {u.name!r} has sample credentials; accepted from loopback only"
                for u in self.users.values() if u.sample]

    # -- authorisation --------------------------------------------------------------------------
    def permission_for(self, address: str) -> Permission | None:
        """The ``[[permissions]]`` entry that governs ``address`` (most specific match)."""
        for perm in self._ordered:
            if wildcard_match(perm.match, address):
                return perm
        return None

    def check(self, principal: Principal | None, permission: str, address: str) -> bool:
        """May ``principal`` do ``permission`` (send, consume, createAddress, deleteAddress,
        manage; the TOML spellings are accepted too) on ``address``? None is never allowed."""
        name = _ALIASES.get(permission)
        if name is None:
            raise ValueError(f"unknown permission {permission!r}; expected one of {', '.join(PERMISSIONS)}")
        if principal is None:
            return False
        perm = self.permission_for(address)
        return perm is not None and perm.allows(name, principal.roles)


# -- loading --------------------------------------------------------------------------------------

def load_users(path: str | Path) -> SecurityConfig:
    """Read a users file; ``ConfigError`` naming file, key and value if anything is wrong."""
    root = open_config(path)
    users: dict[str, User] = {}
    for name, t in root.tables("users").items():
        if not name:
            raise t.error("", "user name must not be empty")
        password = t.str("password")
        try:
            _parse_hash(password)
        except ValueError as exc:
            raise t.error("password", f"{_shorten(password)!r}: {exc}") from None
        roles = tuple(t.str_list("roles", []))
        sample = t.bool("sample", False)
        sources = tuple(_network(t, "sources", i, s) for i, s in enumerate(t.str_list("sources", [])))
        t.done()
        users[name] = User(name, password, roles, sample, sources)
    anon = root.table("anonymous")
    enabled = anon.bool("enabled", False)
    anon_user = anon.str("user", "anonymous")
    anon_roles = tuple(anon.str_list("roles", []))
    anon.done()
    login = _login_settings(root.table("login"))
    perms: list[Permission] = []
    for t in root.array_of_tables("permissions"):
        match = t.str("match")
        try:
            check_pattern(match)
        except ValueError as exc:
            raise t.error("match", str(exc)) from None
        roles = {p: frozenset(t.str_list(key, [])) for p, key in _TOML_KEYS.items()}
        t.done()
        perms.append(Permission(match, roles))
    root.done()
    return SecurityConfig(users, perms, anonymous_enabled=enabled, anonymous_user=anon_user,
                          anonymous_roles=anon_roles, file=str(path), login=login)


def _login_settings(t: Table) -> LoginSettings:
    """The ``[login]`` table; every value checked (ConfigError names file, key and value)."""
    d = LoginSettings()

    def num(key: str, default, *, minimum: float = 0, integer: bool = True):
        v = t.int(key, default) if integer else t.float(key, default)
        if v < minimum:
            raise t.error(key, f"{v} must be >= {minimum:g}")
        return v

    s = LoginSettings(
        failure_delay_s=num("failure-delay-ms", int(d.failure_delay_s * 1000)) / 1000,
        max_failure_delay_s=num("max-failure-delay-ms", int(d.max_failure_delay_s * 1000)) / 1000,
        throttle_after_failures=num("throttle-after-failures", d.throttle_after_failures, minimum=1),
        refuse_after_failures=num("refuse-after-failures", d.refuse_after_failures),
        failure_window_s=num("failure-window-s", d.failure_window_s, minimum=1, integer=False),
        max_concurrent_verifications=num("max-concurrent-verifications", d.max_concurrent_verifications),
        max_pending_verifications=num("max-pending-verifications", d.max_pending_verifications, minimum=1),
        log_interval_s=num("log-interval-s", d.log_interval_s, integer=False),
        max_tracked_sources=num("max-tracked-sources", d.max_tracked_sources, minimum=16),
        remembered_failures=num("remembered-failures", d.remembered_failures),
    )
    t.done()
    if s.max_failure_delay_s < s.failure_delay_s:
        raise t.error("max-failure-delay-ms", f"{int(s.max_failure_delay_s * 1000)} must be >= "
                                              f"failure-delay-ms ({int(s.failure_delay_s * 1000)})")
    if s.refuse_after_failures and s.refuse_after_failures <= s.throttle_after_failures:
        raise t.error("refuse-after-failures", f"{s.refuse_after_failures} must be 0 (never) or > "
                                               f"throttle-after-failures ({s.throttle_after_failures})")
    return s


def _network(t: Table, key: str, i: int, text: str):
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise ConfigError(t.file, f"{t.key_path(key)}[{i}]",
                          f"{text!r} is not a network (e.g. 10.0.0.0/8 or ::1/128)") from None


def _shorten(s: str) -> str:
    return s if len(s) <= 40 else s[:37] + "..."
