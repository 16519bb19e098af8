"""Artemis's cluster retry settings as pure arithmetic (broker.amqp.peer.RetrySettings)."""

from __future__ import annotations

import pytest

from broker.amqp.peer import RetrySettings

ARTEMIS_DEFAULTS = RetrySettings()


@pytest.mark.parametrize("settings,failures,delay", [
    (ARTEMIS_DEFAULTS, 1, 0.5), (ARTEMIS_DEFAULTS, 10, 0.5),          # multiplier 1.0: steady
    (RetrySettings(200, 2.0, 1000), 1, 0.2), (RetrySettings(200, 2.0, 1000), 2, 0.4),
    (RetrySettings(200, 2.0, 1000), 3, 0.8), (RetrySettings(200, 2.0, 1000), 4, 1.0),  # capped
    (RetrySettings(200, 2.0, 1000), 50, 1.0),
    (RetrySettings(100, 1.5, 10_000), 3, 0.225),
    (RetrySettings(0, 2.0, 0), 5, 0.0),
])
def test_delay(settings, failures, delay):
    assert settings.delay_s(failures) == pytest.approx(delay)


@pytest.mark.parametrize("initial,reconnect,connected_before,failures,more", [
    (-1, -1, False, 1000, True), (-1, -1, True, 1000, True),          # -1: forever
    (3, -1, False, 2, True), (3, -1, False, 3, False),                # initial-connect-attempts
    (3, -1, True, 3, True),                                           # ...not after a connection
    (-1, 2, True, 1, True), (-1, 2, True, 2, False), (-1, 0, True, 1, False),  # reconnect-attempts
    (1, 5, False, 1, False),
])
def test_may_retry(initial, reconnect, connected_before, failures, more):
    s = RetrySettings(initial_connect_attempts=initial, reconnect_attempts=reconnect)
    assert s.may_retry(failures, connected_before=connected_before) is more


@pytest.mark.parametrize("kw", [{"retry_interval_ms": -1}, {"retry_interval_multiplier": 0.5},
                                {"max_retry_interval_ms": -5}])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError):
        RetrySettings(**kw)


def test_frozen():
    with pytest.raises(AttributeError):
        ARTEMIS_DEFAULTS.retry_interval_ms = 1  # type: ignore[misc]
