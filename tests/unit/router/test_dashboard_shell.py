"""The dashboard's pieces without a browser: its files, one decision as JSON (client input cut),
and the check that keeps another site's page from changing anything (router.management)."""

from __future__ import annotations

import pytest

from broker.wire.io.http import HttpError, Request
from router.core.decide import Decision, Explanation, Outcome
from router.dashboard import MAX_FIELD_CHARS, STATIC, decision_view, static_response
from router.management import _same_origin
from router.policies import Target


def _request(headers: dict) -> Request:
    return Request("POST", "/api/v1/routers/main/targets/b1/drain", {}, headers, b"", "127.0.0.1:5000")


@pytest.mark.parametrize("path", sorted(STATIC))
def test_every_file_of_the_page_is_served_with_its_type_and_a_strict_policy(path):
    resp = static_response(path)
    assert resp.status == 200 and resp.body
    assert resp.content_type.split(";")[0] in ("text/html", "text/javascript", "text/css", "image/svg+xml")
    headers = dict(resp.headers)
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    assert headers["X-Content-Type-Options"] == "nosniff"


def test_the_page_names_only_files_the_router_serves():
    html = static_response("/").body.decode()
    for ref in ("/dashboard.js", "/dashboard.css", "/favicon.svg"):
        assert f'"{ref}"' in html and ref in STATIC
    assert static_response("/other") is None


def test_a_decision_as_json_cuts_client_supplied_strings():
    long_key = "k" * 5000
    e = Explanation("main", "CLIENT_ID", long_key, long_key[:10], long_key[:10], "^k{10}", None, False, None,
                    "hit", "local", 1.5, "CONSISTENT_HASH", 2, 3, 1, True, "cache hit")
    d = Decision(Outcome.OK, Target("node-a", "127.0.0.1", 5672, name="b1"), False, e)
    view = decision_view((1700000000.25, "main", "proxy", "proxy", "c-1", "127.0.0.1", "app", long_key, d, 17,
                          "proxied"), 1)
    assert view["key_raw"].startswith("k" * MAX_FIELD_CHARS) and view["key_raw"].endswith("(5000 chars)")
    assert len(view["container_id"]) < MAX_FIELD_CHARS + 20
    assert (view["key_filtered"], view["cache"], view["cache_tier"], view["target"], view["target_node_id"],
            view["outcome"], view["action"], view["worker"]) == \
        ("kkkkkkkkkk", "hit", "local", "b1", "node-a", "OK", "proxied", 1)


@pytest.mark.parametrize("headers", [
    {},                                                                     # curl, the drain command
    {"host": "127.0.0.1:8160", "origin": "http://127.0.0.1:8160", "sec-fetch-site": "same-origin"},
    {"host": "127.0.0.1:8160", "sec-fetch-site": "none"},                   # typed into the address bar
], ids=["no-browser", "the-page", "address-bar"])
def test_a_change_from_the_api_own_page_or_a_non_browser_passes(headers):
    _same_origin(_request(headers))


@pytest.mark.parametrize("headers", [
    {"host": "127.0.0.1:8160", "origin": "http://evil.example"},
    {"host": "127.0.0.1:8160", "origin": "null"},
    {"host": "127.0.0.1:8160", "origin": "http://127.0.0.1:9999"},
    {"host": "127.0.0.1:8160", "sec-fetch-site": "cross-site"},
    {"host": "127.0.0.1:8160", "sec-fetch-site": "same-site"},
    {"origin": "http://127.0.0.1:8160"},                                    # no Host to compare with
], ids=["other-site", "opaque", "other-port", "cross-site", "same-site", "no-host"])
def test_a_change_from_another_site_is_refused(headers):
    with pytest.raises(HttpError) as err:
        _same_origin(_request(headers))
    assert err.value.status == 403
