"""The dry run reads the routing log the router writes."""

from __future__ import annotations


def test_routing_log_keys_follow_the_written_schema():
    """key_filtered (docs/router.md "Routing log"); close lines and key-too-long refusals skipped."""
    import json

    from router.core.dryrun import keys_from_routing_log

    lines = [json.dumps({"v": 1, "event": "route", "key_raw": "a", "key_filtered": "a", "reason": "cache hit"}),
             json.dumps({"v": 1, "event": "close", "connection_id": "x"}),
             json.dumps({"v": 1, "event": "route", "key_raw": "b" * 300, "key_filtered": "NULL",
                         "reason": "key too long (300 characters; max-key-length is 255)"}),
             json.dumps({"v": 1, "event": "route", "key_raw": None, "key_filtered": "NULL", "reason": "x"})]
    assert keys_from_routing_log(lines) == ["a", "NULL"]
