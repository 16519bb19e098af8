"""The client tests share one router process in front of three brokers (``clients_env.Env``)."""

import pytest

from clients_env import Env


@pytest.fixture(scope="session")
def clients_env(tmp_path_factory):
    e = Env(tmp_path_factory.mktemp("clients"))
    try:
        yield e
    finally:
        assert e.close() == 0, e.router.stderr_text()
