"""File-descriptor budget of a router process (shell helpers; used at start and by ``check``).

Every client connection costs descriptors: 1 on a redirect acceptor, 2 on a proxy acceptor
(client + broker socket; plus 2 pipe descriptors per direction while that direction splices
bulk data), besides a fixed overhead (listeners, the event loop, the routing log, the cache
file, management and health-probe sockets). A process that runs out gets EMFILE on ``accept``,
on the broker connect and on file opens; the router survives that (new clients are refused and
counted, see docs/router.md), but ``max-connections`` can then never be reached. So at start the
soft ``RLIMIT_NOFILE`` is raised to the hard limit, and ``max-connections`` is checked against
what the limit allows: a warning at ``run`` and ``check`` (not an error: the limit where the
router will run — systemd ``LimitNOFILE``, a container — may differ from where it is checked).
"""

from __future__ import annotations

import os
import resource

#: descriptors per connection, by acceptor mode (proxy: client + broker socket)
FDS_PER_CONNECTION = {"redirect": 1, "proxy": 2, "auto": 2}
#: listeners, event loop, log and cache files, management and probe sockets, thread wakeups
FIXED_OVERHEAD_FDS = 64


def raise_nofile_limit() -> tuple[int, int, int] | None:
    """Raise the soft RLIMIT_NOFILE to the hard limit. Returns (soft before, soft now, hard),
    or None where there is no such limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if target == resource.RLIM_INFINITY:
        target = 1 << 20  # Linux: the kernel's nr_open default
    if soft != resource.RLIM_INFINITY and soft < target:
        for candidate in (target, 1 << 20, 1 << 16):
            if candidate <= soft:
                break
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (candidate, hard))
                break
            except (ValueError, OSError):
                continue
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft, now, hard


def needed_descriptors(acceptors) -> int | None:
    """Descriptors the acceptors need at their ``max-connections`` (None: one is unlimited)."""
    total = FIXED_OVERHEAD_FDS
    for acc in acceptors:
        if not acc.max_connections:
            return None
        total += acc.max_connections * FDS_PER_CONNECTION.get(acc.mode, 2)
    return total


def budget_warning(acceptors, limit: int) -> str | None:
    """A one-line warning when ``max-connections`` cannot be reached under ``limit``."""
    need = needed_descriptors(acceptors)
    if need is None or need <= limit:
        return None
    parts = ", ".join(f"{a.name} {a.max_connections} x {FDS_PER_CONNECTION.get(a.mode, 2)}"
                      for a in acceptors)
    fits = max(0, limit - FIXED_OVERHEAD_FDS)
    return (f"max-connections needs about {need} file descriptors ({parts} + "
            f"{FIXED_OVERHEAD_FDS} overhead) but the open-files limit is {limit}: only about "
            f"{fits} descriptors are left for connections; beyond that new clients are refused "
            f"(counted as fd_limit_rejected / upstream_fd_exhausted). Raise the hard limit "
            f"(ulimit -n, systemd LimitNOFILE) or lower max-connections")


def open_fd_count() -> int | None:
    """Descriptors this process has open (Linux /proc), or None."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # minus the one listdir holds
    except OSError:
        return None


def fd_limit() -> int | None:
    try:
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return None
