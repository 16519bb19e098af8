"""Pure DataFrame transforms of the data-gravity job: DataFrames in, DataFrames out.

No reading, writing, collecting or printing here (``spark/jobs/gravity.py`` does that), and no
Python UDFs: everything runs in the JVM, so executors need nothing of ours installed.

The steps, in the order the job applies them::

    raw lines (file, value)
      → parse_lines      one typed row per line, its kind (route | close | activity) and, for a
                         line set aside, the reason (invalid JSON, unknown version, missing field)
      → routes / activity            the good lines of each kind, times parsed
      → attribute        each client activity record gets the key of the latest decision for
                         the same key field value (container-id for CLIENT_ID, user for
                         USER_NAME / ROLE_NAME, client address for SOURCE_IP) at or before its
                         window start (else the first one after: clocks of two hosts differ);
                         a field value with one key in the whole log is an equi-join after summing
      → key_usage, key_routes, address_nodes, homes, gravity, moved_matrix, broker_load
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from .schemas import (ACTIVITY_LOG_VERSION, CLIENT_DIRECTIONS, CLUSTER_DIRECTIONS, CORRUPT, DIRECTIONS,
                      LINE, ROUTE_EVENTS, ROUTING_LOG_VERSION)

#: the activity field each key type joins on, and the routing-log field holding the same value
JOIN_FIELDS = {
    "CLIENT_ID": ("container_id", "container_id"),
    "USER_NAME": ("user", "user"),
    "ROLE_NAME": ("user", "user"),          # roles are the user's (users file): join on the user
    "SOURCE_IP": ("client_host", "client_address"),
    "SNI_HOST": ("container_id", "container_id"),  # the activity log has no SNI: the connection's container-id
}


def _ts(c: Column) -> Column:
    return F.try_to_timestamp(c)


#: the parsed-time columns, by the field they come from (for the reasons a line is set aside)
_FIELD_OF = {"time_t": "time", "ws": "window_start", "we": "window_end"}


def _missing(*names: str) -> Column:
    """The first of ``names`` that is null, as a reason text (null when none is)."""
    out = F.lit(None).cast("string")
    for n in reversed(names):
        out = F.when(F.col(n).isNull(), F.lit(f"missing or mistyped {_FIELD_OF.get(n, n)}")).otherwise(out)
    return out


def parse_lines(raw: DataFrame) -> DataFrame:
    """``raw`` (file, value) → the declared line schema's columns plus ``file``, ``kind``,
    ``reason`` (null for a good line), ``unknown_version`` and ``value`` (kept for bad lines only).

    Blank lines are dropped (neither read nor malformed)."""
    parsed = (raw.where(F.trim("value") != "")
              .select("file", "value", F.from_json("value", LINE, {"mode": "PERMISSIVE",
                                                                    "columnNameOfCorruptRecord": CORRUPT})
                      .alias("j"))
              .select("file", "value", "j.*"))
    kind = (F.when(F.col("event").isin(*ROUTE_EVENTS), F.col("event"))
            .when(F.col("direction").isNotNull(), F.lit("activity")))
    route_missing = _missing("v", "time_t", "connection_id", "router", "key_type", "key_transformed", "outcome")
    close_missing = _missing("v", "time_t", "connection_id", "router")
    act_missing = _missing("node_id", "connection_id", "address", "messages", "bytes", "ws", "we")
    version_bad = (F.col("v").isNotNull() & (F.col("v") != ROUTING_LOG_VERSION))
    act_version_bad = (F.col("v").isNotNull() & (F.col("v") != ACTIVITY_LOG_VERSION))
    reason = (
        F.when(F.col(CORRUPT).isNotNull(), F.lit("invalid JSON or a mistyped field"))
        .when(F.col("kind").isNull(), F.lit("neither a routing-log line nor an activity record"))
        .when((F.col("kind") != "activity") & version_bad,
              F.concat(F.lit("unknown routing-log version v="), F.col("v").cast("string")))
        .when((F.col("kind") == "activity") & act_version_bad,
              F.concat(F.lit("unknown activity-log version v="), F.col("v").cast("string")))
        .when((F.col("kind") == "route") & route_missing.isNotNull(), route_missing)
        .when((F.col("kind") == "route") & ~F.col("key_type").isin(*JOIN_FIELDS),
              F.concat(F.lit("unknown key_type "), F.col("key_type")))
        .when(F.col("kind") == "route", F.lit(None).cast("string"))
        .when(F.col("kind") == "close", close_missing)
        .when(~F.col("direction").isin(*DIRECTIONS), F.concat(F.lit("unknown direction "), F.col("direction")))
        .when(act_missing.isNotNull(), act_missing)
        .when((F.col("bytes") < 0) | (F.col("messages") < 0), F.lit("negative bytes or messages"))
        .when(F.col("direction").isin(*CLUSTER_DIRECTIONS) & F.col("peer_node_id").isNull(),
              F.lit("missing or mistyped peer_node_id"))
    )
    out = (parsed.withColumn("kind", kind)
           .withColumn("time_t", _ts(F.col("time")))
           .withColumn("ws", _ts(F.col("window_start")))
           .withColumn("we", _ts(F.col("window_end")))
           .withColumn("reason", reason))
    unknown = (F.col(CORRUPT).isNull() & (((F.col("kind") != "activity") & version_bad)
                                         | ((F.col("kind") == "activity") & act_version_bad)))
    return (out.withColumn("unknown_version", F.coalesce(unknown, F.lit(False)))
            .withColumn("value", F.when(F.col("reason").isNotNull(), F.col("value"))))


def bad_lines(parsed: DataFrame) -> DataFrame:
    """Lines set aside: (file, reason, line)."""
    return parsed.where(F.col("reason").isNotNull()).select("file", "reason", F.col("value").alias("line"))


def file_counts(parsed: DataFrame) -> DataFrame:
    """Per input file: lines read, malformed (every line set aside) and of an unknown version."""
    return (parsed.groupBy("file")
            .agg(F.count(F.lit(1)).alias("lines"),
                 F.sum(F.col("reason").isNotNull().cast("long")).alias("malformed"),
                 F.sum(F.col("unknown_version").cast("long")).alias("unknown_version"))
            .orderBy("file"))


def _between(c: Column, since, until) -> Column:
    cond = F.lit(True)
    if since is not None:
        cond = cond & (c >= F.lit(since))
    if until is not None:
        cond = cond & (c < F.lit(until))
    return cond


#: route lines whose broker never served the client: the proxy could not reach it (the client was
#: refused, or routed again: a line of its own follows)
FAILED_ACTIONS = ("upstream_failed", "upstream_retried")


def routes(parsed: DataFrame, since=None, until=None) -> DataFrame:
    """Good ``route`` lines: t, router, key_type, key (the transformed key, what pins match),
    the join fields, node (target node id, else the target's name) and ok (a connection the
    broker served: routed there, and not an attempt the proxy could not complete)."""
    node = F.coalesce(F.col("target_node_id"), F.col("target_name"))
    served = F.col("action").isNull() | ~F.col("action").isin(*FAILED_ACTIONS)
    return (parsed.where((F.col("kind") == "route") & F.col("reason").isNull()
                         & _between(F.col("time_t"), since, until))
            .select(F.col("time_t").alias("t"), "connection_id", "router", "key_type",
                    F.col("key_transformed").alias("key"), "container_id", "user", "client_address",
                    node.alias("node"),
                    ((F.col("outcome") == "OK") & node.isNotNull() & served).alias("ok")))


def activity(parsed: DataFrame, since=None, until=None) -> DataFrame:
    """Good activity records (a record belongs to the window it ends in): node, connection_id,
    container_id, user, client_host, address, direction, messages, bytes, ws, we, peer."""
    host = F.regexp_extract(F.col("source"), r"^\[?(.*?)\]?:\d+$", 1)
    return (parsed.where((F.col("kind") == "activity") & F.col("reason").isNull()
                         & _between(F.col("we"), since, until))
            .select(F.col("node_id").alias("node"), "connection_id", "container_id", "user",
                    F.when(F.col("source").isNotNull(), host).alias("client_host"), "address", "direction",
                    "messages", "bytes", "ws", "we", F.col("peer_node_id").alias("peer")))


def attribute(routes_df: DataFrame, activity_df: DataFrame, key_type: str) -> DataFrame:
    """Client activity (produce, consume) with the ``key`` of its decision: (key, node, address,
    direction, bytes, messages), summed; key null = no decision for that field value (a client
    that connected to the broker directly).

    Almost always a field value has one key for the whole log: those records are summed per
    (field value, node, address, direction) first and then get that key by an equi-join, so the
    cost is one aggregation. Only the values whose key changed (a key filter changed at run time)
    take the as-of path: decisions and records unioned and sorted per field value, each record
    taking the last decision's key at or before its window start, else the first after it."""
    afield, rfield = JOIN_FIELDS[key_type]
    dec = routes_df.where(F.col("key").isNotNull()).select(F.col(rfield).alias("jf"), F.col("t").alias("at"), "key")
    recs = (activity_df.where(F.col("direction").isin(*CLIENT_DIRECTIONS))
            .select(F.col(afield).alias("jf"), F.col("ws").alias("at"), "node", "address", "direction", "bytes",
                    "messages"))
    per_field = dec.groupBy("jf").agg(F.countDistinct("key").alias("nkeys"), F.min("key").alias("only_key"))
    multi = per_field.where(F.col("nkeys") > 1).select("jf")
    single = per_field.where(F.col("nkeys") == 1).select("jf", F.col("only_key").alias("key"))
    cols = ["key", "node", "address", "direction", "bytes", "messages"]
    summed = (recs.join(F.broadcast(multi), "jf", "left_anti")
              .groupBy("jf", "node", "address", "direction")
              .agg(F.sum("bytes").alias("bytes"), F.sum("messages").alias("messages"))
              .join(single, "jf", "left")
              .select(*cols))
    timed = _as_of(dec.join(F.broadcast(multi), "jf", "left_semi"), recs.join(F.broadcast(multi), "jf", "left_semi"))
    return summed.unionByName(timed.select(*cols))


def _as_of(dec: DataFrame, recs: DataFrame) -> DataFrame:
    """Each record (jf, at, …) with the key of the last decision (jf, at, key) at or before it,
    else the first after it: one sort of the union per field value."""
    both = (dec.select("jf", "at", F.lit(0).alias("ord"), "key")
            .unionByName(recs.withColumn("ord", F.lit(1)).withColumn("key", F.lit(None).cast("string")),
                         allowMissingColumns=True))
    w = Window.partitionBy("jf").orderBy("at", "ord")
    before = F.last("key", ignorenulls=True).over(w.rowsBetween(Window.unboundedPreceding, Window.currentRow))
    after = F.first("key", ignorenulls=True).over(w.rowsBetween(Window.currentRow, Window.unboundedFollowing))
    return both.withColumn("key", F.coalesce(before, after)).where(F.col("ord") == 1)


def key_usage(attributed: DataFrame) -> DataFrame:
    """(key, address, node) → produce_bytes, consume_bytes; key null = unattributed traffic."""
    return (attributed.groupBy("key", "address", "node")
            .agg(F.sum(F.when(F.col("direction") == "produce", F.col("bytes")).otherwise(0)).alias("produce_bytes"),
                 F.sum(F.when(F.col("direction") == "consume", F.col("bytes")).otherwise(0)).alias("consume_bytes")))


def key_routes(routes_df: DataFrame) -> DataFrame:
    """Per key: connections (decisions that routed it), current node (the latest decision's),
    moves (decisions that chose another broker than the key's previous one), first/last time."""
    ok = routes_df.where("ok")
    w = Window.partitionBy("key").orderBy("t", "connection_id")
    prev = F.lag("node").over(w)
    return (ok.withColumn("moved", (prev.isNotNull() & (prev != F.col("node"))).cast("long"))
            .groupBy("key")
            .agg(F.count(F.lit(1)).alias("connections"),
                 F.max_by("node", F.struct("t", "connection_id")).alias("current_node_id"),
                 F.sum("moved").alias("moves"),
                 F.min("t").alias("first_seen"), F.max("t").alias("last_seen")))


def address_nodes(activity_df: DataFrame) -> DataFrame:
    """(address, node) → bytes per direction: produce, consume, forward, redistribute, forward_in."""
    def total(d: str) -> Column:
        return F.sum(F.when(F.col("direction") == d, F.col("bytes")).otherwise(0))
    return (activity_df.groupBy("address", "node")
            .agg(*(total(d).alias(d.replace("-", "_")) for d in DIRECTIONS)))


def homes(addr_nodes: DataFrame) -> DataFrame:
    """Each address's home broker: most bytes produced there plus bytes left there (backlog =
    produced + forwarded in − consumed − forwarded − redistributed, if positive); ties → more
    consumed, then the smaller node id."""
    backlog = F.greatest(F.lit(0), F.col("produce") + F.col("forward_in") - F.col("consume")
                         - F.col("forward") - F.col("redistribute"))
    w = Window.partitionBy("address").orderBy(F.desc("weight"), F.desc("consume"), F.asc("node"))
    return (addr_nodes.withColumn("backlog", backlog)
            .withColumn("weight", F.col("produce") + F.col("backlog"))
            .withColumn("rank", F.row_number().over(w))
            .where(F.col("rank") == 1)
            .select("address", F.col("node").alias("home_node_id"), F.col("weight").alias("home_weight")))


def gravity(usage: DataFrame, homes_df: DataFrame) -> DataFrame:
    """Per key: bytes served, bytes served on the home broker of the address, and the gravity
    score (their ratio; null for a key without bytes)."""
    served = F.col("produce_bytes") + F.col("consume_bytes")
    j = usage.where(F.col("key").isNotNull()).join(homes_df, "address", "left")
    return (j.groupBy("key")
            .agg(F.sum(served).alias("bytes"),
                 F.sum("produce_bytes").alias("produce_bytes"), F.sum("consume_bytes").alias("consume_bytes"),
                 F.sum(F.when(F.col("node") == F.col("home_node_id"), served).otherwise(0)).alias("home_bytes"),
                 F.sort_array(F.collect_set("address")).alias("addresses"))
            .withColumn("gravity_score", F.when(F.col("bytes") > 0, F.col("home_bytes") / F.col("bytes"))))


def moved_matrix(activity_df: DataFrame) -> DataFrame:
    """Bytes moved between brokers: (from, to) → forwarded, redistributed, bytes (their sum),
    from the sending node's records (forward-in is the same bytes seen by the receiver)."""
    moved = activity_df.where(F.col("direction").isin("forward", "redistribute"))
    return (moved.groupBy(F.col("node").alias("from"), F.col("peer").alias("to"))
            .agg(F.sum(F.when(F.col("direction") == "forward", F.col("bytes")).otherwise(0)).alias("forwarded"),
                 F.sum(F.when(F.col("direction") == "redistribute", F.col("bytes")).otherwise(0))
                 .alias("redistributed"),
                 F.sum("bytes").alias("bytes")))


def broker_connections(routes_df: DataFrame) -> DataFrame:
    """Per broker: connections routed to it."""
    return routes_df.where("ok").groupBy("node").agg(F.count(F.lit(1)).alias("connections"))


def broker_bytes(activity_df: DataFrame) -> DataFrame:
    """Per broker: client bytes served (produce + consume)."""
    return (activity_df.where(F.col("direction").isin(*CLIENT_DIRECTIONS))
            .groupBy("node").agg(F.sum("bytes").alias("bytes")))


def brokers(routes_df: DataFrame, activity_df: DataFrame) -> DataFrame:
    """Every broker seen: decision targets, activity nodes and their cluster peers."""
    return (routes_df.where("ok").select("node")
            .union(activity_df.select("node"))
            .union(activity_df.where(F.col("peer").isNotNull()).select(F.col("peer").alias("node")))
            .distinct())


def node_names(parsed: DataFrame) -> DataFrame:
    """Per (node id, node name) of the good activity lines: when that name first served the node id
    (``first_ws``), its records and bytes. An HA pair serves one node id under two names (broker-1,
    then broker-1-backup after a failover, broker-1 again after failback)."""
    return (parsed.where((F.col("kind") == "activity") & F.col("reason").isNull() & F.col("node").isNotNull())
            .groupBy("node_id", "node")
            .agg(F.min("ws").alias("first_ws"), F.count(F.lit(1)).alias("records"),
                 F.sum("bytes").alias("bytes")))


def routers_seen(routes_df: DataFrame) -> DataFrame:
    """(router, key_type) pairs in the decisions, with their counts."""
    return routes_df.groupBy("router", "key_type").agg(F.count(F.lit(1)).alias("decisions"))
