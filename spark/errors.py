"""Errors of the data-gravity job, split as the other packages split theirs: Local (the command
line or the inputs asked for something the job cannot do) vs Remote (Spark or the cluster failed).
"""

from __future__ import annotations


class GravityError(Exception):
    """Base class of the job's own errors."""


class UsageError(GravityError, ValueError):
    """Bad command-line input, or logs that need a choice the command line did not make (several
    routers, several key types). The CLI prints it as one line and exits 2."""
