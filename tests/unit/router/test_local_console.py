"""What ``lodestone-local`` copies from its children's logs to the console: why a child stopped,
and the configuration warnings they logged while starting (each once, with who logged it)."""

from router.local import failure_reason, start_warnings

T = "2026-11-28T15:13:16.541Z"


def test_the_reason_is_the_non_record_lines_and_errors_not_the_warnings():
    lines = [f"{T} WARNING lodestone.broker security: users.toml: user 'app' has sample credentials",
             f"{T} INFO lodestone.broker starting",
             "lodestone-broker: data directory etc/../var/broker-1 is locked by process 4242", ""]
    assert failure_reason(lines) == ["lodestone-broker: data directory etc/../var/broker-1 is locked by process 4242"]
    tb = ["Traceback (most recent call last):", '  File "x.py", line 1', "OSError: boom",
          f"{T} ERROR router.main fatal: boom"]
    assert failure_reason([f"{T} INFO a b"] + tb, n=3) == tb[1:]
    # nothing that looks like a reason: the last lines, whatever they are
    assert failure_reason([f"{T} INFO a one", f"{T} INFO a two"], n=1) == [f"{T} INFO a two"]
    assert failure_reason([]) == []


def test_start_warnings_once_each_with_who_logged_them_and_only_configuration_ones():
    sample = "users.toml: user 'app' has sample credentials; accepted from loopback only"
    logs = {
        "broker-1": [f"{T} WARNING lodestone.broker security: {sample}",
                     f"{T} WARNING lodestone.broker.peer peer connection: giving up",   # progress, not config
                     f"{T} WARNING lodestone.broker cluster password is a published sample"],
        "broker-2": [f"{T} WARNING lodestone.broker security: {sample}", f"{T} INFO lodestone.broker up"],
        "router": [f"{T} WARNING router.main max-connections needs about 50064 file descriptors",
                   f"{T} WARNING router.server {sample}"],
    }
    assert start_warnings(logs) == [
        (sample, ["broker-1", "broker-2", "router"]),
        ("cluster password is a published sample", ["broker-1"]),
        ("max-connections needs about 50064 file descriptors", ["router"]),
    ]
