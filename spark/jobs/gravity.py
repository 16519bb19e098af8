"""``lodestone-gravity``: data gravity from routing and broker activity logs (docs/gravity.md).

    lodestone-gravity <log files or dirs>... --out DIR [--router-config etc/router.toml]
        [--router NAME] [--max-skew 0.10] [--master URL] [--bad-lines DIR]
        [--since TIME] [--until TIME] [--broker NODE_ID]...
    spark-submit --master spark://host:7077 spark/jobs/gravity.py <logs>... --out DIR

Read → transform → write: the logs are read once (``spark.read.text``), parsed with the declared
schema (``spark/schemas.py``) and reduced by the pure DataFrame functions of
``spark/transforms.py`` to small tables (per key, address and broker), which the driver collects;
the recommendation is the pure heuristic of ``spark/placement.py``; ``spark/report.py`` writes
``summary.json``, ``pins.jsonl``, ``filters.json`` and ``report.html`` with its PNG plots.

Bad command-line input exits 2 with one line naming the problem, before Spark starts.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a file (spark-submit spark/jobs/gravity.py): the repo on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from spark import report  # noqa: E402
from spark.errors import UsageError  # noqa: E402
from spark.placement import KeyLoad, address_cross, recommend, skew  # noqa: E402
from broker.wire.io.tomlconfig import ConfigError
from router.config import load_router_config
from router.errors import RouterError

__all__ = ["main", "parse_args", "run", "spark_session", "check_runtime", "Options", "UsageError", "MissingDependency"]

PROG = "lodestone-gravity"
#: file names read from a directory: routing logs (routing.log, rotated routing.log.1 …, a worker's
#: routing-w1.log), activity logs (activity.jsonl), gzip-compressed copies of either; other files
#: (a process's stderr log, the journal) are left alone — name a differently named log explicitly
LOG_NAME = re.compile(r"^(routing|activity)[^/]*\.(log|jsonl)(\.\d+)?(\.gz)?$")


@dataclass
class Options:
    inputs: list[str]
    out: Path
    max_skew: float = 0.10
    master: str | None = None
    router: str | None = None
    router_config: Path | None = None
    bad_lines: Path | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    shuffle_partitions: int = 8
    driver_memory: str = "2g"
    quiet: bool = False
    key_type: str | None = None                    # from --router-config
    target_node_ids: dict[str, str] = field(default_factory=dict)  # target name → node id (static pool)
    files: list[str] = field(default_factory=list)
    extra_brokers: list[str] = field(default_factory=list)       # --broker


# -- command line ------------------------------------------------------------------------------
def _time(text: str, flag: str) -> dt.datetime:
    try:
        t = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise UsageError(f"{flag} {text!r}: not an ISO 8601 time (e.g. 2026-01-02T03:04:05Z)") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.timezone.utc)
    return t.astimezone(dt.timezone.utc).replace(tzinfo=None)  # Spark's session time zone is UTC


def expand_inputs(inputs: Sequence[str]) -> list[str]:
    """Files as given; directories walked for routing and activity logs (``LOG_NAME``).

    A directory without logs is skipped with a warning when another input has some (an HA backup's
    data directory before it ever served has no ``activity.jsonl``); with none at all it is an error.
    """
    files: list[str] = []
    empty: list[str] = []
    for i in inputs:
        p = Path(i)
        if p.is_dir():
            found = sorted(str(f) for f in p.rglob("*") if f.is_file() and LOG_NAME.match(f.name))
            if not found:
                empty.append(i)
            files.extend(found)
        elif p.is_file():
            files.append(str(p))
        elif p.exists():
            raise UsageError(f"{i}: not a file or directory")
        else:
            raise UsageError(f"{i}: no such file or directory")
    if empty and not files:
        raise UsageError(f"{empty[0]}: no log files in this directory (names like routing.log, routing.log.1, "
                         f"activity.jsonl)")
    for i in empty:
        print(f"lodestone-gravity: {i}: no log files in this directory, skipped", file=sys.stderr)
    return list(dict.fromkeys(os.path.abspath(f) for f in files))


def parse_args(argv: Sequence[str] | None = None) -> Options:
    class _Parser(argparse.ArgumentParser):
        def error(self, message: str):  # one line, exit 2 (argparse would print the usage too)
            raise UsageError(message)

    ap = _Parser(prog=PROG, description="Data gravity: where each key's data lives, and recommended pins.")
    ap.add_argument("inputs", nargs="+", metavar="LOG", help="routing logs, activity logs, or directories of them")
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--router-config", help="the router's TOML (key type, static targets' node ids)")
    ap.add_argument("--router", help="which router's decisions (default: the only one in the logs)")
    ap.add_argument("--max-skew", default="0.10", help="balance bound: max load / mean load - 1 (default 0.10)")
    ap.add_argument("--master", help="Spark master URL (default local[*]; spark-submit's own when run by it)")
    ap.add_argument("--bad-lines", help="write the lines set aside here (JSON lines: file, reason, line)")
    ap.add_argument("--since", help="only decisions / activity windows ending at or after this time (ISO 8601)")
    ap.add_argument("--until", help="only decisions / activity windows ending before this time (ISO 8601)")
    ap.add_argument("--shuffle-partitions", default="8", help="spark.sql.shuffle.partitions (default 8)")
    ap.add_argument("--driver-memory", default="2g", help="spark.driver.memory for a job started here (default 2g)")
    ap.add_argument("--broker", action="append", default=[], metavar="NODE_ID",
                    help="a broker the recommendation may use although the logs do not show it (repeatable)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    a = ap.parse_args(argv)
    try:
        max_skew = float(a.max_skew)
    except ValueError:
        raise UsageError(f"--max-skew {a.max_skew!r}: not a number") from None
    if not (max_skew >= 0) or max_skew == float("inf"):
        raise UsageError(f"--max-skew {a.max_skew}: must be a finite number >= 0")
    try:
        parts = int(a.shuffle_partitions)
    except ValueError:
        parts = 0
    if parts < 1:
        raise UsageError(f"--shuffle-partitions {a.shuffle_partitions!r}: must be an integer >= 1")
    if a.master is not None and not re.match(r"^(local(\[(\*|\d+)(,\d+)?\])?|spark://\S+|yarn|k8s://\S+|mesos://\S+)$",
                                              a.master):
        raise UsageError(f"--master {a.master!r}: not a Spark master URL (local[*], local[2], spark://host:port, …)")
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {a.out}: exists and is not a directory")
    opts = Options(inputs=list(a.inputs), out=out, max_skew=max_skew, master=a.master, router=a.router,
                   bad_lines=Path(a.bad_lines) if a.bad_lines else None,
                   since=_time(a.since, "--since") if a.since else None,
                   until=_time(a.until, "--until") if a.until else None,
                   shuffle_partitions=parts, driver_memory=a.driver_memory, quiet=a.quiet,
                   extra_brokers=[b for b in a.broker if b])
    if opts.since and opts.until and opts.since >= opts.until:
        raise UsageError(f"--since {a.since} is not before --until {a.until}")
    if a.router_config:
        _read_router_config(opts, Path(a.router_config))
    opts.files = expand_inputs(opts.inputs)
    return opts


def _read_router_config(opts: Options, path: Path) -> None:
    """Key type and static targets' node ids of the chosen router, from the router's own loader."""

    if not path.is_file():
        raise UsageError(f"--router-config {path}: no such file")
    try:
        cfg = load_router_config(path)
    except (ConfigError, RouterError, ValueError, OSError) as exc:
        raise UsageError(f"--router-config: {exc}") from None
    names = sorted(cfg.routers)
    if opts.router is None:
        if len(names) != 1:
            raise UsageError(f"--router-config {path} has routers {', '.join(names) or '(none)'}: choose one with --router")
        opts.router = names[0]
    elif opts.router not in cfg.routers:
        raise UsageError(f"--router {opts.router!r}: not in {path} (routers: {', '.join(names)})")
    rc = cfg.routers[opts.router]
    opts.router_config = path
    opts.key_type = rc.key_type.value if hasattr(rc.key_type, "value") else str(rc.key_type)
    if rc.pool is not None:
        opts.target_node_ids = {t.name: t.node_id for t in rc.pool.targets if t.node_id}
        opts.extra_brokers += [t.node_id or t.name for t in rc.pool.targets]


# -- progress ------------------------------------------------------------------------------------
class Progress:
    """``gravity: [i/n] what … 1.2 s`` lines on stderr, so a long run shows where it is."""

    def __init__(self, steps: int, quiet: bool = False):
        self.steps, self.i, self.quiet = steps, 0, quiet
        self.t0 = self.t = time.monotonic()

    def step(self, what: str) -> None:
        now = time.monotonic()
        self.i += 1
        if not self.quiet:
            print(f"gravity: [{self.i}/{self.steps}] {what} (at {now - self.t0:.1f} s)", file=sys.stderr, flush=True)
        self.t = now

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


# -- Spark -------------------------------------------------------------------------------------
class MissingDependency(Exception):
    """PySpark or Java is not there: one line saying what to install, exit status 1."""


def check_runtime(env: dict[str, str] | None = None) -> None:
    """PySpark importable and a Java the driver can start, before Spark is asked to start one (its
    own failure is a Java gateway traceback). Under spark-submit the gateway is already up."""
    env = os.environ if env is None else env
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise MissingDependency(f"PySpark is not installed in {sys.executable}: "
                                f"bash etc/bootstrap.sh gravity (docs/gravity.md)") from None
    if "PYSPARK_GATEWAY_PORT" in env:
        return
    java_home = env.get("JAVA_HOME")
    if java_home:  # PySpark's spark-class runs $JAVA_HOME/bin/java when JAVA_HOME is set
        java = Path(java_home) / "bin" / "java"
        if not (java.is_file() and os.access(java, os.X_OK)):
            raise MissingDependency(f"JAVA_HOME={java_home}: no {java}; point JAVA_HOME at a Java 17 "
                                    f"install or unset it to use java from PATH")
    elif shutil.which("java", path=env.get("PATH", os.defpath)) is None:
        raise MissingDependency("Java not found (no java on PATH, JAVA_HOME unset): PySpark's driver needs "
                                "Java 17, e.g. Debian's default-jre-headless (bash etc/bootstrap.sh gravity "
                                "installs it)")


def spark_session(master: str | None = None, driver_memory: str = "2g"):
    """A session on ``master`` (default local[*]); under spark-submit, spark-submit's master
    unless one is given."""
    from pyspark.sql import SparkSession

    b = SparkSession.builder.appName(PROG)
    under_submit = "PYSPARK_GATEWAY_PORT" in os.environ
    if master or not under_submit:
        b = b.master(master or "local[*]")
    if not under_submit:
        b = b.config("spark.driver.memory", driver_memory)
    b = (b.config("spark.sql.session.timeZone", "UTC")
         .config("spark.ui.showConsoleProgress", "true")
         .config("spark.ui.enabled", "false")
         .config("spark.driver.host", os.environ.get("SPARK_LOCAL_IP", "127.0.0.1"))
         .config("spark.pyspark.python", sys.executable))
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


# -- the job -----------------------------------------------------------------------------------
def run(spark, opts: Options) -> dict[str, Any]:
    """Run the job on a session; write the outputs into ``opts.out``; return the summary."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    from spark import transforms as T  # optional: spark.transforms needs pyspark

    prog = Progress(8, opts.quiet)
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    spark.conf.set("spark.sql.shuffle.partitions", str(opts.shuffle_partitions))
    prog.step(f"reading {len(opts.files)} file(s)")
    path = F.url_decode(F.regexp_replace(F.col("_metadata.file_path"), "^file:(//)?", ""))
    raw = spark.read.text(opts.files).select(path.alias("file"), "value")
    slim = ["file", "kind", "reason", "unknown_version", "value", "time_t", "connection_id", "router",
            "key_type", "key_transformed", "container_id", "user", "client_address", "target_node_id",
            "target_name", "outcome", "action", "node_id", "node", "source", "address", "direction", "messages", "bytes",
            "ws", "we", "peer_node_id"]
    parsed = T.parse_lines(raw).select(*slim).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        return _run(spark, opts, prog, parsed, T, report)
    finally:
        parsed.unpersist()


def _run(spark, opts: Options, prog: Progress, parsed, T, report) -> dict[str, Any]:
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    counts = [r.asDict() for r in T.file_counts(parsed).collect()]
    lines_read = sum(c["lines"] for c in counts)
    malformed = sum(c["malformed"] for c in counts)
    prog.step(f"parsed {lines_read} line(s), {malformed} set aside")
    if opts.bad_lines is not None:
        (T.bad_lines(parsed).coalesce(1).write.mode("overwrite").json(str(opts.bad_lines)))

    routes_all = T.routes(parsed, opts.since, opts.until)
    seen = [r.asDict() for r in T.routers_seen(routes_all).collect()]
    router, key_type = _choose_router(opts, seen)
    routes_df = routes_all.where(F.col("router") == router) if router is not None else routes_all
    if opts.target_node_ids:
        m = F.create_map(*[F.lit(x) for kv in opts.target_node_ids.items() for x in kv])
        routes_df = routes_df.withColumn("node", F.coalesce(m[F.col("node")], F.col("node")))
    routes_df = routes_df.persist(StorageLevel.MEMORY_AND_DISK)
    act = T.activity(parsed, opts.since, opts.until).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        prog.step(f"joining decisions to broker activity (router {router}, key type {key_type})")
        usage_df = T.key_usage(T.attribute(routes_df, act, key_type)).persist(StorageLevel.MEMORY_AND_DISK)
        usage = [r.asDict() for r in usage_df.collect()]
        prog.step("per key: decisions, moves, gravity")
        kroutes = {r["key"]: r.asDict() for r in T.key_routes(routes_df).collect()}
        null_conns = {r["node"]: r["n"] for r in routes_df.where(F.col("ok") & (F.col("key") == "NULL"))
                      .groupBy("node").agg(F.count(F.lit(1)).alias("n")).collect()}
        addr_nodes_df = T.address_nodes(act)
        homes_df = T.homes(addr_nodes_df)
        grav = {r["key"]: r.asDict() for r in T.gravity(usage_df, homes_df).collect()}
        prog.step("per address and broker: homes, bytes moved, load")
        addr_nodes = [r.asDict() for r in addr_nodes_df.collect()]
        homes = {r["address"]: r["home_node_id"] for r in homes_df.collect()}
        matrix = [r.asDict() for r in T.moved_matrix(act).collect()]
        conns = {r["node"]: r["connections"] for r in T.broker_connections(routes_df).collect()}
        nbytes = {r["node"]: r["bytes"] for r in T.broker_bytes(act).collect()}
        brokers = sorted({r["node"] for r in T.brokers(routes_df, act).collect() if r["node"] is not None}
                         | set(opts.extra_brokers))
        names, served_by = report.node_names([r.asDict() for r in T.node_names(parsed).collect()])
        usage_df.unpersist()
    finally:
        routes_df.unpersist()
        act.unpersist()

    prog.step(f"recommending an assignment of {len(kroutes)} key(s) to {len(brokers)} broker(s) "
              f"(max skew {opts.max_skew:g})")
    keys, key_rows = _key_loads(kroutes, grav, usage, null_conns)
    placement = recommend(brokers, keys, opts.max_skew)
    summary = _summary(opts, counts, router, key_type, brokers, names, key_rows, placement, homes, addr_nodes,
                       matrix, conns, nbytes)
    summary["broker_served_by"] = {b: served_by[b] for b in brokers if b in served_by}
    prog.step(f"writing {opts.out}")
    report.write_outputs(opts.out, summary, placement)
    summary["elapsed_s"] = round(prog.elapsed(), 3)
    report.write_summary(opts.out, summary)
    prog.step(f"done: {lines_read} lines in {prog.elapsed():.1f} s "
              f"({lines_read / max(prog.elapsed(), 1e-9):,.0f} lines/s)")
    return summary


def _choose_router(opts: Options, seen: list[dict]) -> tuple[str | None, str]:
    routers = sorted({r["router"] for r in seen})
    if opts.router is not None:
        router = opts.router
        if seen and router not in routers:
            raise UsageError(f"--router {router!r}: no decision of that router in the logs "
                             f"(routers: {', '.join(routers)})")
    elif len(routers) > 1:
        raise UsageError(f"the logs hold decisions of routers {', '.join(routers)}: choose one with --router")
    else:
        router = routers[0] if routers else None
    types = sorted({r["key_type"] for r in seen if r["router"] == router})
    if len(types) > 1:
        raise UsageError(f"router {router!r} logged several key types ({', '.join(types)}): "
                         f"split the logs at the change or use --since/--until")
    key_type = types[0] if types else (opts.key_type or "CLIENT_ID")
    if opts.key_type and types and opts.key_type != key_type:
        print(f"{PROG}: warning: {opts.router_config} says key-type {opts.key_type}, the logs {key_type}; "
              f"using the logs'", file=sys.stderr)
    return router, key_type


def _key_loads(kroutes: dict, grav: dict, usage: list[dict], null_conns: dict) -> tuple[list[KeyLoad], list[dict]]:
    """KeyLoads for the heuristic, and the per-key rows of the summary.

    Traffic that no pin can move stays where it was, as immovable loads: the ``NULL`` key (no
    key: pins apply to keys) and activity with no decision (clients that did not come through
    this router)."""
    per_key: dict[str, dict[str, list[int]]] = {}
    fixed: dict[tuple[str, str], dict[str, list[int]]] = {}
    for u in usage:
        key = u["key"]
        if key is None or key == "NULL":
            slot = fixed.setdefault((key or "", u["node"]), {})
        else:
            slot = per_key.setdefault(key, {})
        acc = slot.setdefault(u["address"], [0, 0])
        acc[0] += int(u["produce_bytes"] or 0)
        acc[1] += int(u["consume_bytes"] or 0)
    keys: list[KeyLoad] = []
    rows: list[dict] = []
    for key in sorted(set(kroutes) | set(per_key)):
        if key == "NULL":
            continue
        kr = kroutes.get(key, {})
        us = {a: (v[0], v[1]) for a, v in per_key.get(key, {}).items()}
        keys.append(KeyLoad(key, int(kr.get("connections") or 0), us, kr.get("current_node_id")))
        g = grav.get(key, {})
        decisions = int(kr.get("connections") or 0)
        moves = int(kr.get("moves") or 0)
        rows.append({"key": key, "current_node_id": kr.get("current_node_id"), "recommended_node_id": None,
                     "gravity_score": None if g.get("gravity_score") is None else round(g["gravity_score"], 6),
                     "bytes": int(g.get("bytes") or 0), "produce_bytes": int(g.get("produce_bytes") or 0),
                     "consume_bytes": int(g.get("consume_bytes") or 0), "connections": decisions,
                     "moves": moves, "stickiness": round(1 - moves / (decisions - 1), 6) if decisions > 1 else 1.0,
                     "addresses": list(g.get("addresses") or [])})
    for (key, node), us in sorted(fixed.items()):
        label = "(no key)" if key == "NULL" else "(not routed)"
        conns = null_conns.get(node, 0) if key == "NULL" else 0
        keys.append(KeyLoad(f"{label} on {node}", conns, {a: (v[0], v[1]) for a, v in us.items()}, node,
                            movable=False))
    for node, n in sorted(null_conns.items()):
        if ("NULL", node) not in fixed:
            keys.append(KeyLoad(f"(no key) on {node}", n, {}, node, movable=False))
    return keys, rows


def _summary(opts: Options, counts, router, key_type, brokers, names, key_rows, placement, homes, addr_nodes,
             matrix, conns, nbytes) -> dict[str, Any]:
    for r in key_rows:
        r["recommended_node_id"] = placement.assignment.get(r["key"])
        r["moved"] = r["recommended_node_id"] is not None and r["recommended_node_id"] != r["current_node_id"]
    # addresses: observed bytes per node, home, and the model's cross bytes for the observed placement
    by_addr: dict[str, dict[str, dict]] = {}
    for r in addr_nodes:
        by_addr.setdefault(r["address"], {})[r["node"]] = r
    addresses, modelled = [], 0.0
    for a in sorted(by_addr):
        nodes = by_addr[a]
        prod = [int(nodes.get(b, {}).get("produce") or 0) for b in brokers]
        cons = [int(nodes.get(b, {}).get("consume") or 0) for b in brokers]
        cross = address_cross(prod, cons)
        modelled += cross
        addresses.append({"address": a, "home_node_id": homes.get(a), "produced_bytes": sum(prod),
                          "consumed_bytes": sum(cons),
                          "forwarded_bytes": sum(int(n.get("forward") or 0) for n in nodes.values()),
                          "redistributed_bytes": sum(int(n.get("redistribute") or 0) for n in nodes.values()),
                          "modelled_cross_bytes": round(cross, 3)})
    idx = {b: i for i, b in enumerate(brokers)}
    grid = [[0] * len(brokers) for _ in brokers]
    for m in matrix:
        if m["from"] in idx and m["to"] in idx:
            grid[idx[m["from"]]][idx[m["to"]]] += int(m["bytes"] or 0)
    cross = sum(int(m["bytes"] or 0) for m in matrix)
    load_c = [int(conns.get(b, 0)) for b in brokers]
    load_b = [int(nbytes.get(b, 0)) for b in brokers]
    moves = sum(r["moves"] for r in key_rows)
    pairs = sum(max(r["connections"] - 1, 0) for r in key_rows)
    scores = [r["gravity_score"] for r in key_rows if r["gravity_score"] is not None]
    weighted = sum(r["gravity_score"] * r["bytes"] for r in key_rows if r["gravity_score"] is not None)
    keyed_bytes = sum(r["bytes"] for r in key_rows if r["gravity_score"] is not None)
    return {
        "lines_read": sum(c["lines"] for c in counts),
        "lines_malformed": sum(c["malformed"] for c in counts),
        "lines_unknown_version": sum(c["unknown_version"] for c in counts),
        "files": counts,
        "router": router, "key_type": key_type,
        "since": opts.since.isoformat() + "Z" if opts.since else None,
        "until": opts.until.isoformat() + "Z" if opts.until else None,
        "keys": len(key_rows),
        "keys_scored": len(scores),
        "brokers": brokers,
        "broker_names": {b: names.get(b) for b in brokers},
        "cross_broker_bytes": cross,
        "modelled_cross_broker_bytes": round(modelled, 3),
        "recommended_cross_broker_bytes": round(placement.cross_bytes, 3),
        "skew": {"connections": round(skew(load_c), 6), "bytes": round(skew(load_b), 6)},
        "recommended_skew": {"connections": round(placement.skew_connections, 6),
                             "bytes": round(placement.skew_bytes, 6)},
        "max_skew": opts.max_skew,
        "recommended_within_bound": placement.within_bound,
        "method": placement.method,
        "keys_moved": sum(1 for r in key_rows if r["moved"]),
        "gravity_score_mean": round(sum(scores) / len(scores), 6) if scores else None,
        "gravity_score_bytes_weighted": round(weighted / keyed_bytes, 6) if keyed_bytes else None,
        "stickiness": round(1 - moves / pairs, 6) if pairs else 1.0,
        "key_moves": moves,
        "bytes_moved_matrix": {"brokers": brokers, "bytes": grid},
        "bytes_moved": sorted(matrix, key=lambda m: (m["from"], m["to"])),
        "per_broker": [{"node_id": b, "name": names.get(b), "connections": load_c[i], "bytes": load_b[i],
                        "recommended_connections": int(placement.connections.get(b, 0)),
                        "recommended_bytes": int(placement.bytes.get(b, 0))} for i, b in enumerate(brokers)],
        "addresses": addresses,
        "per_key": key_rows,
    }


def main(argv: Sequence[str] | None = None) -> int:
    try:
        opts = parse_args(argv)
    except UsageError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    try:
        check_runtime()
    except MissingDependency as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    opts.out.mkdir(parents=True, exist_ok=True)
    spark = spark_session(opts.master, opts.driver_memory)
    try:
        summary = run(spark, opts)
    except UsageError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    finally:
        spark.stop()
    print(report.headline(summary))
    return 0

if __name__ == "__main__":
    sys.exit(main())
