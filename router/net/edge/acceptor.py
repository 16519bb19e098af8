"""``Acceptor``: one configured acceptor; ``handle`` is the whole life of one connection and
the one place that owns its deadlines (see ``router.net.edge`` for the phases)."""

from __future__ import annotations

import functools
import logging
import socket

import trio

from broker.wire.limits import Admission, SourceLimiter, source_key
from router.net import fastio
from router.net import proxy as proxy_mod
from router.net.edge import handshake as handshake_mod
from router.net.edge import limits as limits_mod
from router.net.edge import redirect as redirect_mod
from router.net.edge import route as route_mod
from router.net.edge.context import (
    PH_CONNECT,
    PH_HANDSHAKE,
    PH_LINGER,
    PH_PROXY,
    PH_REPLAY,
    PH_ROUTE,
    PH_TLS,
    AcceptorSettings,
    ConnState,
    EdgeContext,
    close,
    close_now,
    reset_on_close,
)
from router.core.decide import Decision, Outcome
from router.net.edge.errors import EdgeError, UpstreamError, reply_frames
from router.net.edge.pump import END_COUNTER, run_pump
from router.net.edge.tls import accept_tls
from router.drain import end_proxied
from router.net.edge.upstream import Upstream, timeout_error
from router.net.stats import COUNTER_NAMES
from router.routelog import close_line, route_line

log = logging.getLogger("router.connection")

_INF = float("inf")


class Acceptor:
    """One configured acceptor: ``handle`` is called for each accepted TCP socket."""

    def __init__(self, settings: AcceptorSettings, service, edge: EdgeContext):
        self.settings = settings
        self.service = service
        self.edge = edge
        self._counters = edge.stats.counters
        self._keys = {name: (settings.name, name) for name in COUNTER_NAMES}
        self.limiter = SourceLimiter(settings.limits)
        self._refusing = 0          # refusals in flight for the acceptor-wide limit
        self._handshake = handshake_mod.Handshake(settings, edge, self.limiter, self._inc)
        self._upstream = Upstream(settings)

    def reconfigure(self, settings: AcceptorSettings, service) -> None:
        """A reloaded ``[[acceptors]]`` entry (same name and address): new connections use the new
        settings, router and certificate; connections under way keep what they started with. The
        per-source counts carry over under the new limits."""
        self.settings = settings
        self.service = service
        self.limiter.limits = settings.limits
        self._handshake = handshake_mod.Handshake(settings, self.edge, self.limiter, self._inc)
        self._upstream = Upstream(settings)

    def _inc(self, name: str, n: int = 1) -> None:
        self._counters[self._keys[name]] += n

    def _count_decision(self, decision) -> None:
        self._counters[self._keys[route_mod.ROUTE_COUNTER[decision.outcome]]] += 1
        cached = route_mod.CACHE_COUNTER.get(decision.explanation.cache)
        if cached is not None:
            self._counters[self._keys[cached]] += 1

    def _new_conn(self, host: str, port: int, now: float) -> ConnState:
        c = ConnState(self.edge.next_connection_id(), f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
                      host, port, now)
        c.service = self.service
        return c

    # -- the one place that owns every deadline ------------------------------------------------
    async def handle(self, sock: socket.socket, peer) -> None:
        """Serve one accepted client socket to the end (``peer``: its address from ``accept``).
        Owns and closes the socket; never raises for peer behaviour.

        One cancel scope carries each phase's deadline in turn (``c.phase`` says which), so a
        timeout is told apart after the scope by the phase it hit."""
        s = self.settings
        active = self.edge.stats.active
        active[s.name] += 1
        self._counters[self._keys["accepted"]] += 1
        host, port = peer[0], peer[1]
        now = trio.current_time()
        c = self._new_conn(host, port, now)
        key = source_key(host)
        verdict, reason = self.limiter.admit(key, now)
        if verdict is not Admission.ADMIT:
            self._inc(f"refused_{reason}")
            c.refusal = limits_mod.source_refusal_text(reason, s.router, key, s.limits)
            if self.edge.log_once(f"{s.name}/{key}/{reason}", now):
                log.warning("%s: %s; refusing (logged once per source per interval)", s.name, c.refusal)
            if verdict is Admission.DROP:
                self._inc("refused_dropped")
                active[s.name] -= 1
                sock.close()
                return
        relay = None
        try:
            with _Contained(self, c):
                with trio.CancelScope() as scope:
                    proxy = await self._serve(sock, c, scope)
                if scope.cancelled_caught:
                    await self._timed_out(c)
                elif proxy:
                    self._log_decision(c, "proxied")
                    self._inc("proxied")
                    # held for the connection's life: only its target (close line) and its
                    # assignment (connection_closed) are needed from here on, not the explanation
                    d = c.decision
                    c.decision = Decision(d.outcome, d.target, d.local, None, d.hold)
                    if d.target is not None:     # a drain of its target can end it (router.drain)
                        c.service.proxy_started(d.target.group, c.id, functools.partial(end_proxied, c))
                    result = proxy_mod.PumpStats()
                    relay = self._relay(c, key, result)
                    if relay is not None:
                        return relay      # it owns the connection now (and this task ends)
                    await run_pump(s, c, self._proxy_closed, result=result)
        finally:
            if relay is None:
                self._release(c, key)
                if c.upstream is not None and not close_now(c.upstream):
                    await close(c.upstream)
                if c.client is None:
                    sock.close()
                elif not close_now(c.client):
                    await close(c.client)

    def _release(self, c: ConnState, key: str) -> None:
        """What every ending connection gives back (but its streams)."""
        self.edge.stats.active[self.settings.name] -= 1
        if c.decision is not None:
            c.service.connection_closed(c.decision)   # LOAD_FACTOR: a live assignment ends
            if c.decision.target is not None and c.phase == PH_PROXY:
                c.service.proxy_ended(c.decision.target.group, c.id)
        if c.refusal is not None:
            self.limiter.release_refusal(key)
        else:
            self.limiter.release(key, authenticated=c.authenticated)

    # -- a plain proxied connection without a task (router.net.proxy.Relay) ----------------------
    def _relay(self, c: ConnState, key: str, result: "proxy_mod.PumpStats"):
        """Hand a plain ↔ plain connection to a ``Relay`` (the broker's first bytes written
        here); None when it stays with this task (TLS, no shared poller, or the client's socket
        did not take those bytes at once: what it took is counted in ``result``)."""
        poller = proxy_mod.active_poller()
        client, upstream = c.client, c.upstream
        if poller is None or type(client) is not fastio.FastSocketStream \
                or type(upstream) is not fastio.FastSocketStream:
            return None
        csock = client.socket
        if c.leftover:
            try:
                n = csock.send(c.leftover)
            except OSError:
                return None              # the pump's own send finds out and ends it
            result.bytes_down += n
            c.leftover = c.leftover[n:]
            if c.leftover:
                return None
        keeper = poller.keeper
        if keeper.nursery is None or not keeper.relays:
            keeper.nursery = trio.lowlevel.current_task().parent_nursery   # the handlers nursery
        relay = proxy_mod.Relay(poller, keeper, csock, upstream.socket, result, self.settings.idle_timeout_s,
                                lambda stats: self._relay_ended(c, key, relay, stats),
                                lambda state: self._relay_resumed(c, key, relay, state))
        try:
            relay.start()
        except Exception:           # e.g. epoll refused a socket: the pump in this task serves it
            relay.abandon()
            log.exception("%s: connection %s: the shared poller refused it", self.settings.name, c.id)
            return None
        return relay

    def _relay_ended(self, c: ConnState, key: str, relay, stats) -> None:
        """Called by the relay (from the dispatcher or the keeper: shared by every relay), so it
        never raises: a failure here is this connection's bug, counted and logged."""
        try:
            if stats.error == proxy_mod.INTERNAL_ERROR:
                self._inc("internal_error")
            self._proxy_closed(c, stats)
        except Exception:
            self._inc("internal_error")
            log.exception("%s: connection %s: ending it failed", self.settings.name, c.id)
        finally:
            self._finish_relayed(c, key, relay)

    async def _relay_resumed(self, c: ConnState, key: str, relay, state) -> None:
        """The two-task pump takes over a relay's connection (a task in the handlers nursery)."""
        try:
            with _Contained(self, c):
                await run_pump(self.settings, c, self._proxy_closed, result=relay.stats, state=state)
        finally:
            self._finish_relayed(c, key, relay)

    def _finish_relayed(self, c: ConnState, key: str, relay) -> None:
        """Give everything back, each step whatever the others did (never raises)."""
        steps = [lambda: self._release(c, key), c.upstream.close, c.client.close, *relay.after]
        for step in steps:
            try:
                step()
            except Exception:
                self._inc("internal_error")
                log.exception("%s: connection %s: releasing it failed", self.settings.name, c.id)

    async def refuse_over_limit(self, sock: socket.socket, peer) -> None:
        """The acceptor is at ``max-connections`` (counted by the listener as
        ``connection_limit_rejected``): answer ``amqp:resource-limit-exceeded`` without checking
        credentials, within 0.25 s — or close at once when the client's address already has
        ``max-refusing-per-source`` refusals in flight, or the acceptor ``MAX_REFUSING``."""
        s = self.settings
        host, port = peer[0], peer[1]
        key = source_key(host)
        if self._refusing >= limits_mod.MAX_REFUSING or \
                self.limiter.refuse(key, trio.current_time()) is Admission.DROP:
            self._inc("refused_dropped")
            sock.close()
            return
        self._refusing += 1
        c = self._new_conn(host, port, trio.current_time())
        c.refusal = limits_mod.acceptor_refusal_text(s.router, s.name, s.max_connections)
        # at capacity: hold nothing for long — a client that is not already speaking is closed
        c.refusal_timeout_s = limits_mod.OVER_LIMIT_REFUSAL_S
        try:
            with trio.CancelScope() as scope:
                await self._serve(sock, c, scope)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:
            self._inc("internal_error")
            log.exception("%s: refusing connection %s failed", s.name, c.id)
        finally:
            self._refusing -= 1
            self.limiter.release_refusal(key)
            if c.client is None:
                sock.close()
            elif not close_now(c.client):
                await close(c.client)

    async def _serve(self, sock: socket.socket, c: ConnState, scope: trio.CancelScope) -> bool:
        """Phases 1-4 under ``scope``, each with its deadline. True when the connection is ready
        to be pumped (``c.client``/``c.upstream`` set); every refusal ends here (``_answer``)."""
        s = self.settings
        try:
            fastio.prepare_socket(sock, s.tcp_user_timeout_ms)
        except OSError:
            self._inc("handshake_eof")  # the client is already gone
            return False
        refusing = c.refusal is not None
        # 1. TLS
        if s.ssl_context is not None:
            scope.deadline = trio.current_time() + (c.refusal_timeout_s if refusing
                                                    else s.tls_handshake_timeout_s)
            client = await accept_tls(sock, s.ssl_context, c, self._inc)
            if client is None:
                return False
        else:
            client = c.client = fastio.FastSocketStream(sock)

        # 2. SASL + Open
        c.phase = PH_HANDSHAKE
        scope.deadline = trio.current_time() + (c.refusal_timeout_s if refusing
                                                else s.handshake_timeout_s)
        detected = await self._handshake.run(client, c)
        if detected.__class__ is bytes:  # ended (counted): the handshake's last reply, if any
            if detected:
                await self._send_quietly(client, detected)
            return False
        try:
            if refusing:
                raise limits_mod.refusal(c.refusal)

            # 3. Route (the service bounds its own quorum wait)
            c.phase = PH_ROUTE
            scope.deadline = _INF
            decision = await route_mod.decide(c.service, s, c)
            self._count_decision(decision)
            action = route_mod.action_for(s, decision, detected)
            if action is route_mod.REDIRECT:
                self._log_decision(c, "redirected")
                self._inc("redirected")  # before the linger, whose deadline may end this scope
                await self._answer(c, redirect_mod.redirect_reply(s.router, decision.target), scope)
                return False

            # 4. Proxy: connect, then replay the handshake (a deadline each). A broker that fails
            # before the client has seen a byte of it is out of rotation at once and the key is
            # routed again, up to connect-retries times (HAProxy's retries + redispatch)
            retries = s.connect_retries
            tried: set[str] = set()
            while True:
                try:
                    await self._connect_and_replay(c, detected)
                    break
                except UpstreamError as err:
                    if retries <= 0 or not err.target_down:
                        raise
                    retries -= 1
                    tried.add(c.decision.target.slot)
                    await self._route_again(c, err, tried)
        except EdgeError as err:
            await self._refuse(c, err, scope)
            return False
        c.phase = PH_PROXY  # the pump runs after this scope, with its own idle deadline
        return True

    async def _connect_and_replay(self, c: ConnState, detected) -> None:
        """Connect to ``c.decision.target`` and replay the handshake, each within
        ``connect-timeout-ms``; raises an ``UpstreamError`` with nothing left open."""
        s = self.settings
        target = c.decision.target
        timeout = s.upstream_connect_timeout_s
        # one scope for both steps (a scope costs more than moving its deadline), so the
        # replay's deadline is set when it starts
        with trio.CancelScope(deadline=trio.current_time() + timeout) as attempt:
            c.phase = PH_CONNECT
            await self._upstream.connect(c, target)
            c.phase = PH_REPLAY
            attempt.deadline = trio.current_time() + timeout
            await self._upstream.replay(c, detected)
        if attempt.cancelled_caught:
            if c.upstream is not None:
                c.upstream.close()
                c.upstream = None
            raise timeout_error(s.router, target, c.phase == PH_REPLAY)

    async def _route_again(self, c: ConnState, err: UpstreamError, tried: set[str]) -> None:
        """``err`` ended an attempt before the client saw a byte of that broker: take the broker
        out of rotation and route the key again (a pool below quorum, or a pair failing over,
        waits up to quorum-timeout, as any new client would). A target not ``tried`` yet: the
        failed attempt is counted and logged (action ``upstream_retried``) and ``c.decision`` is
        the new one. None, or one that failed this client already (its probe may find it ready
        again: a broker that accepts TCP and answers nothing): ``err`` itself is raised, about
        the broker that failed (already out of rotation)."""
        failed, failed_us = c.decision, c.decision_us
        c.service.upstream_failed(failed.target.slot, err.description)
        err.target_down = False          # reported: _refuse must not report it again
        c.phase = PH_ROUTE
        decision = await route_mod.decide(c.service, self.settings, c)
        decision_us = c.decision_us
        if decision.outcome is not Outcome.OK or decision.target is None or decision.target.slot in tried:
            c.decision, c.decision_us = failed, failed_us
            raise err
        c.decision, c.decision_us = failed, failed_us
        if err.counter is not None:
            self._inc(err.counter)
        self._inc("upstream_retried")
        self._log_decision(c, "upstream_retried")
        c.decision, c.decision_us = decision, decision_us
        self._count_decision(decision)
        log.info("%s: %s; the client goes to %s instead", self.settings.name, err.description,
                 decision.target.name)

    async def _timed_out(self, c: ConnState) -> None:
        """The connection's cancel scope fired: count the phase's timeout, answer the client."""
        ph = c.phase
        if ph == PH_TLS:
            self._inc("tls_handshake_timeout")
        elif ph == PH_HANDSHAKE:
            self._inc("handshake_timeout")
        elif ph in (PH_CONNECT, PH_REPLAY):
            if c.upstream is not None:
                c.upstream.close()
                c.upstream = None
            await self._refuse(c, timeout_error(self.settings.router, c.decision.target, ph == PH_REPLAY))
        elif ph == PH_LINGER:  # the client did not close within close_linger_s: nothing to count
            reset_on_close(c.client)

    # -- the one place an EdgeError becomes the wire reply --------------------------------------
    async def _refuse(self, c: ConnState, err: EdgeError, scope: trio.CancelScope | None = None) -> None:
        """Count ``err``, log its routing-log line (once a decision exists), then write its Close
        (``reply_frames``) and linger."""
        if err.counter is not None:
            self._inc(err.counter)
        if err.action is not None and c.decision is not None:
            self._log_decision(c, err.action)
        if getattr(err, "target_down", False) and c.decision is not None \
                and c.decision.target is not None:
            # not ready at once, probed again now: the next clients (and a pair's waiting keys)
            # do not wait a whole check-period to learn it
            c.service.upstream_failed(c.decision.target.slot, err.description)
        await self._answer(c, reply_frames(err), scope)

    async def _send_quietly(self, client, data: bytes) -> None:
        """A handshake's last reply (SASL outcome, protocol header, Close): written if the client
        still reads it within ``close_linger_s``, then the connection closes."""
        try:
            with trio.move_on_after(self.settings.close_linger_s):
                await client.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def _answer(self, c: ConnState, data: bytes, scope: trio.CancelScope | None) -> None:
        """Write our last frames, half-close, and give the client ``close_linger_s`` to answer
        with its Close and EOF (closing at once could reset the connection before it read them).
        Inside the connection's scope the linger is that scope's deadline (phase LINGER); after
        it (``scope`` None: a timed-out connection) it gets a scope of its own."""
        client = c.client
        linger = self.settings.close_linger_s
        try:
            await redirect_mod.send_last(client, data)
            if scope is not None:
                c.phase = PH_LINGER
                scope.deadline = trio.current_time() + linger
                await redirect_mod.read_until_eof(client)
            else:
                with trio.move_on_after(linger) as lingered:
                    await redirect_mod.read_until_eof(client)
                if lingered.cancelled_caught:
                    reset_on_close(client)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    # -- routing log (schema: router.routelog, docs/router.md) ---------------------------------
    def _log_decision(self, c: ConnState, action: str) -> None:
        routelog = self.edge.routelog
        s = self.settings
        now = self.edge.clock()
        self.edge.recent.append((now, s.router, s.name, s.mode, c.id, c.host, c.user, c.container_id,
                                 c.decision, c.decision_us, action))   # the dashboard's last decisions
        if routelog.path is None:
            return
        routelog.write_line(route_line(now, self.edge.worker, s.router, s.name, s.mode, c,
                                       c.decision, c.decision_us, action, routelog.max_field_chars))

    def _proxy_closed(self, c: ConnState, result) -> None:
        s = self.settings
        stats = self.edge.stats
        stats.bytes_up[s.name] += result.bytes_up
        stats.bytes_down[s.name] += result.bytes_down
        self._inc(END_COUNTER[result.reason])
        if c.drained:
            self._inc("proxy_drained")
        routelog = self.edge.routelog
        if routelog.path is None:
            return
        routelog.write_line(close_line(self.edge.clock(), self.edge.worker, s.router, s.name, s.mode, c,
                                       c.decision, result, round((trio.current_time() - c.started) * 1000, 3),
                                       routelog.max_field_chars))


class _Contained:
    """What goes wrong in one connection stays there: a client that vanished in the middle of
    one of our writes is nothing to tell anybody; an error group from the pump's nursery (trio's
    strict groups) lets its cancellation (drain deadline, shutdown) go on up; anything else is a
    bug in this connection only — counted ``internal_error`` and logged, never allowed to reach
    the handlers nursery."""

    __slots__ = ("acceptor", "c")

    def __init__(self, acceptor: Acceptor, c: ConnState) -> None:
        self.acceptor = acceptor
        self.c = c

    def __enter__(self) -> None:
        return None

    def __exit__(self, etype, exc, tb) -> bool:
        if etype is None or issubclass(etype, (trio.BrokenResourceError, trio.ClosedResourceError)):
            return etype is not None
        name = self.acceptor.settings.name
        if issubclass(etype, BaseExceptionGroup):
            cancelled, rest = exc.split(trio.Cancelled)
            if rest is not None:
                self.acceptor._inc("internal_error")
                log.error("%s: connection %s failed", name, self.c.id, exc_info=rest)
            if cancelled is not None:
                raise cancelled
            return True
        if issubclass(etype, Exception):
            self.acceptor._inc("internal_error")
            log.error("%s: connection %s failed", name, self.c.id, exc_info=(etype, exc, tb))
            return True
        return False
