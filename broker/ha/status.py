"""An HA member's status: what ``GET /api/v1/ha`` and ``/metrics`` report (docs/ha.md).

One :class:`HaStatus` per member, across its activations; the member's role
(``broker.ha.replicated.Replicated``, ``broker.ha.shared_store.SharedStoreMember``) changes it
and adds what only it knows (the pair's shared state, the replication stream, hosted backups)
when it describes itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger("lodestone.broker.ha")

__all__ = ["HaStatus"]


@dataclass
class HaStatus:
    """What ``GET /api/v1/ha`` and ``/metrics`` report (one per process, across activations)."""

    policy: str
    role: str
    store: str
    node_id: str | None = None
    active: bool = False
    phase: str = "starting"   # starting | waiting-for-backup-lock | waiting-for-live-lock | active | stopping | ...
    activations: int = 0      # times this process became active
    failovers: int = 0        # activations of a backup (the live node had failed)
    failbacks: int = 0        # times this active backup handed over to a returning primary
    votes: dict = field(default_factory=lambda: {"won": 0, "lost": 0})   # quorum votes this member asked for
    since: float = field(default_factory=time.time)
    last_change: str | None = None

    def change(self, phase: str, why: str, *, active: bool | None = None) -> None:
        """A role/phase change: one log line each."""
        old = self.phase
        self.phase = phase
        if active is not None:
            self.active = active
        self.since = time.time()
        self.last_change = why
        level = logging.WARNING if phase in ("active", "stopping") else logging.INFO
        log.log(level, "ha: %s -> %s (%s)", old, phase, why, extra={"fields": {
            "policy": self.policy, "role": self.role, "node_id": self.node_id, "active": self.active}})

    def describe(self, *, pair_state: str | None = None, replication: dict | None = None,
                 colocated: list | None = None) -> dict:
        """``GET /api/v1/ha``; the role adds the shared store's state (``pair.state``), the
        replication stream's view and the colocated backups it hosts."""
        return {"policy": self.policy, "role": self.role, "active": self.active, "node_id": self.node_id,
                "phase": self.phase, "since": self.since, "last_change": self.last_change,
                "pair": {"store": self.store, "state": pair_state,
                         "activations": self.activations, "failovers": self.failovers,
                         "failbacks": self.failbacks, "votes": dict(self.votes)},
                "replication": replication, "colocated": colocated}
