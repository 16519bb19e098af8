"""Running a member of a replicated pair (``[ha] policy = "replication"``; docs/ha.md).

Theory of operation
-------------------
**A primary** serves at once (its own data directory) and accepts one backup
(``broker.ha.replication.ReplicationSource``). With ``vote-on-replication-failure``, losing an
in-sync backup makes it ask the cluster whether it is still in the majority; if not it stops
serving and exits with status 3 (an isolated primary must not keep a node id another side may
take over).

**A backup** (its own data directory) answers its management API at once (``active: false``)
and looks for a primary among the cluster's connectors (``[cluster] static-connectors``, tried
in turn): it dials each as the cluster user and says hello; a primary of another
``group-name``, or one that already has a backup, refuses, and the backup tries the next one
(spare backups keep looking, every ``retry-interval-ms``). Once accepted it copies the primary's
journal (``ReplicationSink``) and follows it. When the connection to an in-sync primary is lost
the backup **votes** (``broker.ha.vote``: the other primaries it learned from the primary's
topology, over their management APIs); if the vote is won it activates — on its own copy of the
journal, with the primary's node id — and serves (and may take a backup of its own); if lost it
looks for the primary again, as Artemis's backup restarts as a backup.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from broker.core.departures import Target, target_from_connector
from broker.ha.protocol import ACKS_ADDRESS, FAILBACK, HELLO, RECORDS_ADDRESS, SYNCED, Hello, encode
from broker.ha.replication import ReplicationSink, ReplicationSource
from broker.ha.shared_store import HaStatus
from broker.ha.vote import ask_backup_vote, ask_primary_vote, vote_with_retries
from broker.wire.io.trioutil import Wakeup
from broker.wire.discovery import DiscoveryGroup
from broker.wire.io.udp import listen
from broker.wire.frames import CLUSTER_MEMBERS
from broker.wire.io.http import serve_http
from broker.wire.io.logsetup import print_listening
from broker.node import Node
from broker.server import SHUTDOWN_GRACE_S, ManagementSlot, hostport, serve_active
from broker.store.datadir import open_data_dir
from broker.amqp.peer import PeerConnected, PeerConnection, PeerDisconnected, RetrySettings
from broker.ha.colocated import ColocatedHost, request_backups

if TYPE_CHECKING:  # pragma: no cover
    from broker.config import BrokerConfig

log = logging.getLogger("lodestone.broker.ha")

__all__ = ["run_replicated", "ISOLATED_EXIT"]

ISOLATED_EXIT = 3


def _write_node_id(path: Path, node_id: str) -> None:
    tmp = path / "node.id.tmp"
    with tmp.open("w", encoding="ascii") as fh:
        fh.write(node_id + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(tmp, path / "node.id")


async def _when_active(status: HaStatus, cfg, task) -> None:
    """Run ``task(node, cfg)`` once this member's node is active (``attach_source`` records it)."""
    while getattr(status, "node", None) is None or not status.node.active:
        await trio.sleep(0.05)
    await task(status.node, cfg)


def attach_source(cfg: "BrokerConfig", status: HaStatus, isolated: trio.Event,
                  failback: trio.Event | None = None, colocated_host=None):
    """``on_node`` for an active member: it takes a backup, and reports replication; an
    activated backup with allow-failback hands over when the node id's primary asks
    (``failback`` is set)."""
    def on_node(node) -> None:
        node.ha = status
        status.node = node
        node.colocated = colocated_host
        src = ReplicationSource(node)
        node.replication = src
        status.replication_view = src.describe
        if cfg.ha.vote_on_replication_failure:
            src.quorum_check = lambda: primary_quorum_check(node, cfg)
        src.on_isolated = isolated.set
        if failback is not None:
            src.on_failback = failback.set
    return on_node


DISCOVERY_LISTEN_S = 2.5   # how long a member looking for its pair listens to the discovery group


async def cluster_connectors(cfg: "BrokerConfig") -> list[str]:
    """Where an HA member looks for its pair: ``[cluster] static-connectors``, or the members
    heard on the cluster's discovery group within ``min(initial-wait-timeout-ms,
    DISCOVERY_LISTEN_S)`` (its own node id included: a backup serving it announces it too)."""

    ccfg = cfg.cluster
    urls = list(ccfg.static_connectors)
    d = next((g for g in cfg.discovery_groups if g.name == ccfg.discovery_group), None) \
        if ccfg.discovery_group else None
    if d is not None:
        group = DiscoveryGroup(None, d.refresh_timeout_ms / 1000.0, cluster=ccfg.name, key=ccfg.key)
        try:
            with trio.move_on_after(min(d.initial_wait_timeout_ms / 1000.0, DISCOVERY_LISTEN_S)):
                await listen(d.group_address, d.group_port, group, lambda kind, entry: None,
                             bind_address=d.local_bind_address)
        except OSError as exc:
            log.warning("ha: cannot listen to discovery group %s: %s", d.name, exc)
        scheme = ccfg.connector.split("://", 1)[0]
        for e in group.entries.values():
            cs = e.announcement.connectors
            urls.append(next((c for c in cs if c.startswith(scheme + "://")), cs[0]))
    own = ccfg.connector
    return [u for u in dict.fromkeys(urls) if u != own]


async def find_live_self(cfg: "BrokerConfig", host, node_id: str, stop: trio.Event) -> str | None:
    """check-for-live-server: is another node serving ``node_id`` (a backup that took over while
    we were down)? Each of the cluster's connectors (:func:`cluster_connectors`) is asked once:
    the Open of a cluster node
    names its node id and the live members (``lodestone:cluster-members``). Returns the
    connector serving it, or None."""

    ccfg = cfg.cluster
    for url in await cluster_connectors(cfg):
        if stop.is_set():
            break
        seen: dict = {}
        peer = None

        def on_event(ev) -> None:
            if isinstance(ev, PeerConnected) and peer is not None and peer.engine is not None:
                seen["props"] = peer.engine.remote_properties or {}
                peer.engine.close_with("amqp:connection:forced", "checked for a live server")
                peer._wake()

        peer = PeerConnection(host, url, credentials=(ccfg.user, ccfg.password),
                              retry=RetrySettings(initial_connect_attempts=1, reconnect_attempts=0),
                              ca_file=ccfg.ca_file, name=f"check-live-{cfg.name}", on_event=on_event)
        with trio.move_on_after(max(2.0, ccfg.call_timeout_ms / 1000.0)):
            await peer.run()
        props = seen.get("props")
        if not isinstance(props, dict):
            continue
        if props.get("node-id") == node_id:
            return url
        for m in props.get(CLUSTER_MEMBERS) or ():
            if isinstance(m, dict) and m.get("node-id") == node_id and isinstance(m.get("connector"), str):
                return m["connector"]
    return None


def failback_redirect(node, cfg: "BrokerConfig") -> Target | None:
    """Where an activated backup handing its node id back sends clients that follow redirects:
    the failing-back primary's connector (its hello), with this node as its failover when it
    stays the pair's backup (``restart-backup``)."""
    s = node.replication.failback_session if node.replication is not None else None
    if s is None or s.hello is None:
        return None
    own = node.cluster.connector if node.cluster is not None and cfg.ha.restart_backup else None
    return target_from_connector(s.hello.connector, [own] if own else [])


async def primary_quorum_check(node, cfg: "BrokerConfig") -> bool:
    """After losing an in-sync backup: may this primary keep serving? (vote-on-replication-failure)"""
    ha, ccfg = cfg.ha, cfg.cluster
    cluster = node.cluster
    voters = [(nid, mgmt) for nid, _c, mgmt in (cluster.live_members() if cluster is not None else ()) if mgmt]
    # the members it knows, connected or not: the quorum is over the cluster, not over who answers
    known = len(cluster.members) + 1 if cluster is not None else 1
    node.replication.max_cluster_size = max(node.replication.max_cluster_size, known)
    n = ha.quorum_size if ha.quorum_size > 0 else node.replication.max_cluster_size
    all_voters = [(nid, m.management_url) for nid, m in (cluster.members.items() if cluster is not None else ())
                  if m.management_url]
    creds = (ccfg.user, ccfg.password)
    result = await vote_with_retries(lambda: ask_primary_vote(node.node_id, all_voters or voters, n, creds),
                                     ha.vote_retries, ha.vote_retry_wait_ms / 1000.0, ha.quorum_vote_wait_s)
    status = getattr(node, "ha", None)
    if status is not None:
        status.votes["won" if result.won else "lost"] += 1
    log.warning("ha: quorum check after losing the backup: %s (%d of %d needed votes; %s)",
                "still in the majority" if result.won else "ISOLATED", result.votes, result.needed,
                ", ".join(result.detail) or "no voter")
    return result.won


async def run_replicated(cfg: "BrokerConfig", security, *, stop: trio.Event | None = None, label: str | None = None,
                         on_status=None, task_status=trio.TASK_STATUS_IGNORED) -> int:
    """Run one member of a replicated pair until SIGTERM/SIGINT; returns the exit status.
    ``stop``/``label``/``on_status``: a colocated backup inside another node's process
    (``broker.ha.colocated``) — stopped with its host, listeners printed as ``<label>-<what>``,
    its status handed to the host."""

    ha = cfg.ha
    backup = ha.role == "backup"
    datadir = open_data_dir(cfg.data_dir)
    status = HaStatus(ha.policy, ha.role, str(cfg.data_dir), node_id=None if backup else datadir.node_id)
    status.replication_view = None
    if on_status is not None:
        on_status(status)
    slot = ManagementSlot()
    exit_code = 0
    mgmt_label = f"{label}-management" if label else "management"

    def passive_node() -> Node:
        node = Node(cfg, security, status.node_id or "", None)
        node.ha = status
        slot.serve(node)
        return node

    try:
        with (trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) if stop is None
              else contextlib.nullcontext(None)) as signals:
            stop = stop if stop is not None else trio.Event()
            async with trio.open_nursery() as nursery:
                async def on_signal() -> None:
                    async for sig in signals:
                        log.info("signal %s: shutting down", signal.Signals(sig).name)
                        stop.set()
                        return
                if signals is not None:
                    nursery.start_soon(on_signal)
                colocated_host = None
                co = cfg.ha.colocated
                if co is not None and co.max_backups > 0:
                    colocated_host = ColocatedHost(cfg, security, nursery, stop, datadir.node_id, run_replicated)
                    status.colocated = colocated_host
                host = passive_node()
                if (backup or cfg.ha.check_for_live_server) and cfg.management.enabled:
                    # a passive member answers at once (active: false); a plain primary opens
                    # its management API when it serves
                    h, p = await nursery.start(serve_http, slot, cfg.management.host, cfg.management.port)
                    slot.url = f"http://{hostport(h, p)}"
                    print_listening(mgmt_label, slot.url)
                role_backup = backup
                while not stop.is_set():
                    failback = False
                    if role_backup:
                        outcome = await _follow_primaries(cfg, datadir, status, slot, stop, host, passive_node)
                        if not outcome:
                            break
                    elif cfg.ha.check_for_live_server:
                        status.change("checking-for-live-server", "is another node serving our node id?")
                        url = await find_live_self(cfg, host, datadir.node_id, stop)
                        if url is not None:
                            log.warning("ha: node %s is served at %s: failing back (copy its journal, then ask "
                                        "for the node id back)", datadir.node_id, url)
                            failback = True
                            outcome = await _follow_primaries(cfg, datadir, status, slot, stop, host, passive_node,
                                                              candidates=[url], failback=True)
                            if not outcome:
                                break
                    if role_backup and cfg.ha.scale_down:
                        # Artemis's backup scale-down: move the node id's messages to another live
                        # node instead of serving them, then stop
                        status.change("scaling-down", "took over to move the messages to another node")
                        await serve_active(cfg, security, datadir, stop, management=slot if slot.url else None,
                                           on_node=lambda node: setattr(node, "ha", status), scale_down_only=True,
                                           task_status=task_status)
                        status.change("stopping", "scaled down", active=False)
                        break
                    isolated = trio.Event()
                    handing_over = trio.Event()
                    status.activations += 1
                    if role_backup:
                        status.failovers += 1
                    status.change("active", "took over the node id" if role_backup else
                                  ("the node id was handed back" if failback else "primary started"), active=True)
                    deactivate = trio.Event()

                    async def watch(ev: trio.Event, code: int, deactivate=deactivate) -> None:
                        nonlocal exit_code
                        await ev.wait()
                        if code:
                            exit_code = code
                        deactivate.set()

                    async with trio.open_nursery() as wn:
                        wn.start_soon(watch, isolated, ISOLATED_EXIT)
                        wn.start_soon(watch, handing_over, 0)
                        on_node = attach_source(cfg, status, isolated,
                                                handing_over if role_backup and cfg.ha.allow_failback else None,
                                                colocated_host)
                        if co is not None and co.request_backup:
                            wn.start_soon(_when_active, status, cfg, request_backups)

                        async def on_deactivate(node) -> None:
                            if handing_over.is_set() and node.replication is not None:
                                # clients first (no send may land after the last record handed
                                # over): those that follow redirects to the primary, the rest
                                # ended without a Close; then the hand-over itself
                                await node.depart_all(failback_redirect(node, cfg), "failing back to the primary",
                                                      SHUTDOWN_GRACE_S)
                                await node.replication.hand_over(cfg.cluster.call_timeout_ms / 1000.0)

                        reason = await serve_active(cfg, security, datadir, stop, deactivate=deactivate,
                                                    management=slot if slot.url else None, on_node=on_node,
                                                    on_deactivate=on_deactivate, label=label,
                                                    task_status=task_status)
                        wn.cancel_scope.cancel()
                    if reason == "deactivate" and handing_over.is_set():
                        status.failbacks += 1
                        status.change("stopping", "handed the node id back to its primary", active=False)
                        passive_node()
                        if cfg.ha.restart_backup:
                            continue      # a backup again, of the primary that just took over
                        break
                    status.change("stopping", "isolated from the cluster's majority" if reason == "deactivate"
                                  else "stopped", active=False)
                    break
                nursery.cancel_scope.cancel()
    finally:
        datadir.close()
    return exit_code


async def _follow_primaries(cfg: "BrokerConfig", datadir, status: HaStatus, slot, stop: trio.Event, host,
                            passive_node, *, candidates: list[str] | None = None, failback: bool = False):
    """The backup's loop: find a primary, copy and follow it. Returns ``"vote"`` once a won
    vote lets it activate, ``"handover"`` once the node handed its id over (a failback), False
    when stopped. ``candidates``: the connectors to try (default: the cluster's); ``failback``:
    ask the node for our node id back once in sync (the original primary, check-for-live-server)."""

    ha, ccfg = cfg.ha, cfg.cluster
    own = {ccfg.connector}
    tokens = itertools.count(1)
    while not stop.is_set():
        urls = candidates if candidates is not None else [u for u in await cluster_connectors(cfg) if u not in own]
        status.change("looking-for-primary", f"trying {len(urls)} connector(s)", active=False)
        for url in urls:
            if stop.is_set():
                return False
            lost_in_sync = False
            ended: dict = {}

            def set_node_id(node_id: str) -> None:
                _write_node_id(datadir.path, node_id)
                datadir.node_id = node_id
                status.node_id = node_id
                passive_node()

            sink = ReplicationSink(datadir, cfg.journal, keep_saved=ha.max_saved_replicated_journals_size,
                                   fsync=ha.backup_fsync, on_node_id=set_node_id)
            status.replication_view = lambda: {"state": "in-sync" if sink.in_sync else "syncing",
                                               "primary": url, "applied_seq": sink.applied_seq,
                                               "synced_seq": sink.synced_seq,
                                               "records": sink.records_received, "lag_records": None}

            def on_event(ev) -> None:
                if isinstance(ev, PeerDisconnected):
                    ended["condition"], ended["description"] = ev.condition, ev.description

            peer = PeerConnection(host, url, credentials=(ccfg.user, ccfg.password),
                                  retry=RetrySettings(initial_connect_attempts=1, reconnect_attempts=0),
                                  ca_file=ccfg.ca_file, name=f"replica-{cfg.name}", on_event=on_event,
                                  idle_timeout_s=ccfg.connection_ttl_ms / 1000.0 if ccfg.connection_ttl_ms > 0 else None)
            acks = peer.sender(ACKS_ADDRESS, lambda token, state: None)
            got = Wakeup()

            def on_message(body: bytes) -> str:
                state = sink.on_message(body)
                got.set()
                return state

            peer.receiver(RECORDS_ADDRESS, on_message, credit=64)
            acks.send(encode(HELLO, Hello(ha.group_name, cfg.name, ccfg.connector, slot.url or None)), next(tokens))
            status.change("syncing", f"replicating from {url}")
            announced = False
            async with trio.open_nursery() as pn:
                async def run_peer() -> None:
                    await peer.run()
                    pn.cancel_scope.cancel()

                async def confirm() -> None:
                    nonlocal announced
                    while True:
                        await got.wait()
                        if sink.error is not None:
                            log.error("ha: replication from %s: %s; starting over", url, sink.error)
                            if peer.engine is not None:
                                peer.engine.close_with("amqp:decode-error", sink.error[:200])
                                peer._wake()
                            return
                        if sink.pending_flush:
                            sink.pending_flush = False
                            seq = await trio.to_thread.run_sync(sink.flush)
                            acks.send(encode(SYNCED, seq), next(tokens))
                            if sink.in_sync and not announced:
                                announced = True
                                status.change("in-sync", f"a copy of {url} (node {status.node_id})")
                                if failback:
                                    acks.send(encode(FAILBACK, None), next(tokens))

                async def on_stop() -> None:
                    await stop.wait()
                    if peer.engine is not None:
                        peer.engine.close_with("amqp:connection:forced", "backup stopping")
                        peer._wake()
                    pn.cancel_scope.cancel()

                pn.start_soon(run_peer)
                pn.start_soon(confirm)
                pn.start_soon(on_stop)
            lost_in_sync = sink.in_sync and sink.error is None
            handed = sink.handover_seq is not None and sink.synced_seq >= sink.handover_seq
            sink.close()
            if handed and not stop.is_set():
                log.warning("ha: node %s handed its id over through seq %d", status.node_id, sink.handover_seq)
                return "handover"
            if stop.is_set():
                return False
            cond = ended.get("condition")
            if not lost_in_sync:
                if cond is not None:
                    log.info("ha: %s did not take this backup: %s %s", url, cond, ended.get("description"))
                continue
            # the in-sync primary is gone (or unreachable): vote
            primary_id = status.node_id
            topo = sink.topology
            voters = [(nid, mgmt) for nid, mgmt in (topo.members if topo else ()) if nid != primary_id and mgmt]
            n = ha.quorum_size if ha.quorum_size > 0 else sink.max_cluster_size
            status.change("voting", f"lost the primary at {url} ({cond or 'connection lost'})")
            result = await vote_with_retries(
                lambda: ask_backup_vote(primary_id, voters, n, (ccfg.user, ccfg.password)),
                ha.vote_retries, ha.vote_retry_wait_ms / 1000.0, ha.quorum_vote_wait_s)
            status.votes["won" if result.won else "lost"] += 1
            log.warning("ha: vote to take over node %s: %s (%d of %d needed votes from %d primaries; %s)",
                        primary_id, "WON" if result.won else "lost", result.votes, result.needed, result.asked,
                        ", ".join(result.detail) or "no other primary")
            if result.won:
                return "vote"
        with trio.move_on_after(ccfg.retry_interval_ms / 1000.0):
            await stop.wait()
    return False
