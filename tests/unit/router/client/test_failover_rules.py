"""FailoverConnection's pure rules (router.client.failover): how many connection tries, how far
apart, and when a reconnection is a failover to another broker process. Table-driven."""

from __future__ import annotations

import pytest

from router.client.failover import BrokerIdentity, NonDurableLost, RetrySchedule


def tries_and_waits(schedule: RetrySchedule) -> tuple[int, list[float]]:
    """Drive the schedule as FailoverConnection does when every try fails: (tries, waits)."""
    tries, waits, wait = 0, [], schedule.interval_s
    while True:
        tries += 1
        if not schedule.may_try_again(tries) or tries > 50:
            return tries, waits
        waits.append(round(wait, 6))
        wait = schedule.next_interval(wait)


@pytest.mark.parametrize("attempts, interval, multiplier, max_interval, tries, waits", [
    (0, 0.1, 2.0, 2.0, 1, []),                              # one try at once, no retry
    (2, 0.1, 2.0, 2.0, 3, [0.1, 0.2]),                      # the first at once + 2 retries = 3 tries
    (5, 0.1, 2.0, 0.3, 6, [0.1, 0.2, 0.3, 0.3, 0.3]),       # capped at max_retry_interval
    (3, 2.0, 1.0, 2.0, 4, [2.0, 2.0, 2.0]),                 # Artemis's interval and multiplier
    (1, 5.0, 2.0, 2.0, 2, [5.0]),                           # the first wait is the interval, even above the cap
])
def test_a_reconnection_makes_one_try_at_once_then_attempts_more(attempts, interval, multiplier, max_interval,
                                                                  tries, waits):
    assert tries_and_waits(RetrySchedule(attempts, interval, multiplier, max_interval)) == (tries, waits)


def test_minus_one_never_gives_up():
    assert tries_and_waits(RetrySchedule(-1, 0.1, 2.0, 2.0))[0] == 51


@pytest.mark.parametrize("bad", [(-2, 0.1, 2.0, 2.0), (1, -0.1, 2.0, 2.0), (1, 0.1, 0.5, 2.0), (1, 0.1, 2.0, -1.0)])
def test_nonsense_schedules_are_refused(bad):
    with pytest.raises(ValueError):
        RetrySchedule(*bad)


@pytest.mark.parametrize("props, identity", [
    ({"node-id": "n1", "started-ms": 17}, BrokerIdentity("n1", 17)),
    ({"node-id": "n1"}, BrokerIdentity("n1", None)),
    ({"node-id": "n1", "started-ms": "17"}, BrokerIdentity("n1", None)),   # not a number: unknown
    ({"node-id": "n1", "started-ms": True}, BrokerIdentity("n1", None)),
    (None, BrokerIdentity(None, None)), ([1, 2], BrokerIdentity(None, None)),
])
def test_the_identity_is_read_from_the_open_properties(props, identity):
    assert BrokerIdentity.from_properties(props) == identity


@pytest.mark.parametrize("old, new, same, why", [
    (("n1", 17), ("n1", 17), True, "same node id and process"),
    (("n1", 17), ("n1", 18), False, "another process"),            # the backup took the node id over
    (("n1", 17), ("n2", 17), False, "node id n1 -> n2"),
    (("n1", None), ("n1", None), False, "cannot be ruled out"),    # no started-ms: a restart is possible
    (("n1", 17), ("n1", None), False, "cannot be ruled out"),
    ((None, None), (None, None), False, "no node id"),
])
def test_only_the_same_node_id_and_start_time_is_the_same_process(old, new, same, why):
    got, reason = BrokerIdentity(*old).same_process(BrokerIdentity(*new))
    assert got is same and why in reason


def test_the_loss_names_its_count_and_both_brokers():
    lost = NonDurableLost(5, BrokerIdentity("n1", 17), BrokerIdentity("n1", 18), "another process")
    assert lost.count == 5 and "up to 5 non-durable messages" in str(lost) and "n1@17" in str(lost)
    assert "n1@18" in str(lost) and "only durable messages survive" in str(lost)
    assert "up to 1 non-durable message accepted" in str(NonDurableLost(1, lost.old, lost.new, "x"))
