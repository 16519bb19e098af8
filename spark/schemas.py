"""Declared schemas of the job's inputs (never inferred).

One line schema covers both log kinds, so every input file is read and parsed once: a routing-log
line (docs/router.md, "Routing log": ``event`` = ``route`` | ``close``) and a broker activity
record (docs/broker.md, "Activity log schema": ``direction`` = ``produce`` | ``consume`` |
``forward`` | ``redistribute`` | ``forward-in``). Fields the job does not read are left out: the
formats only ever add fields, and JSON parsing ignores the others. Times stay strings here and are
parsed by ``transforms.parse_lines`` (a bad time makes the line malformed, not the job fail).
"""

from __future__ import annotations

from pyspark.sql.types import (ArrayType, BooleanType, DoubleType, IntegerType, LongType, StringType,
                               StructField, StructType)

#: the routing-log schema version this job reads (``router.routelog.SCHEMA_VERSION``)
ROUTING_LOG_VERSION = 1
#: activity records carry no version field; one that does must carry this
ACTIVITY_LOG_VERSION = 1

ROUTE_EVENTS = ("route", "close")
CLIENT_DIRECTIONS = ("produce", "consume")
CLUSTER_DIRECTIONS = ("forward", "redistribute", "forward-in")
DIRECTIONS = CLIENT_DIRECTIONS + CLUSTER_DIRECTIONS

#: the column from_json fills with the raw text of a line that is not JSON
CORRUPT = "_corrupt"


def _f(name: str, t, nullable: bool = True) -> StructField:
    return StructField(name, t, nullable)


# Routing log, event = "route" and "close" (the close line's own fields after the shared ones).
ROUTING_FIELDS = [
    _f("v", IntegerType()), _f("event", StringType()), _f("time", StringType()),
    _f("connection_id", StringType()), _f("worker", IntegerType()), _f("router", StringType()),
    _f("acceptor", StringType()), _f("mode", StringType()), _f("key_type", StringType()),
    _f("key_raw", StringType()), _f("key_filtered", StringType()), _f("key_transformed", StringType()),
    _f("client_address", StringType()), _f("client_port", IntegerType()), _f("sni", StringType()),
    _f("user", StringType()), _f("roles", ArrayType(StringType())), _f("sasl_mechanism", StringType()),
    _f("container_id", StringType()), _f("open_hostname", StringType()), _f("target_name", StringType()),
    _f("target_node_id", StringType()), _f("target_address", StringType()), _f("local", BooleanType()),
    _f("policy", StringType()), _f("cache", StringType()), _f("pin", StringType()),
    _f("outcome", StringType()), _f("action", StringType()), _f("reason", StringType()),
    _f("decision_us", LongType()),
    _f("bytes_client_to_broker", LongType()), _f("bytes_broker_to_client", LongType()),
    _f("duration_ms", DoubleType()), _f("close_reason", StringType()),
]

# Broker activity log (user, container_id are shared with the routing log above).
ACTIVITY_FIELDS = [
    _f("ts", StringType()), _f("node_id", StringType()), _f("node", StringType()),
    _f("source", StringType()), _f("address", StringType()), _f("direction", StringType()),
    _f("messages", LongType()), _f("bytes", LongType()), _f("window_start", StringType()),
    _f("window_end", StringType()), _f("final", BooleanType()), _f("peer_node_id", StringType()),
]

#: every input line is parsed with this one schema (shared field names appear once)
LINE = StructType(ROUTING_FIELDS + [f for f in ACTIVITY_FIELDS
                                    if f.name not in {g.name for g in ROUTING_FIELDS}]
                  + [_f(CORRUPT, StringType())])
