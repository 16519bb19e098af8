"""Both programs' ``/openapi.json``, fetched from running processes, is a valid OpenAPI document."""

from __future__ import annotations

import pytest
from openapi_spec_validator import validate

from tests.brokerproc import start_broker
from tests.routerproc import start_router
from tests.serverproc import REPO, http_json

pytestmark = pytest.mark.slow


def test_broker_openapi_validates(tmp_path):
    b = start_broker(tmp_path)
    try:
        status, doc = http_json(b.management_url + "/openapi.json")
    finally:
        b.terminate()
    assert status == 200 and doc["openapi"].startswith("3.")
    validate(doc)


def test_router_openapi_validates(tmp_path):
    toml = (f'users-file = "{REPO / "etc" / "users.toml"}"\n[management]\nport = 0\n'
            '[[acceptors]]\nname = "a"\nport = 0\nrouter = "m"\n[routers.m]\n')
    r = start_router(tmp_path, toml, expect=2)
    try:
        status, doc = http_json(r.management_url + "/openapi.json")
    finally:
        r.terminate()
    assert status == 200 and doc["openapi"].startswith("3.")
    validate(doc)
