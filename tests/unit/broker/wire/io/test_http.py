"""The shared management HTTP server: real sockets, keep-alive, auth, errors, timeouts."""

import json

import trio

from broker.wire.io.http import (HttpError, Metric, Request, basic_auth, http_get, http_request, json_response,
                         render_metrics, require_basic_auth)


async def _app(request: Request):
    if request.path == "/boom":
        raise RuntimeError("handler bug")
    if request.path == "/secret":
        user = require_basic_auth(request, lambda u, p: (u, p) == ("admin", "admin"))
        return json_response({"user": user})
    if request.path == "/echo":
        return json_response({"method": request.method, "query": request.query, "body": request.json()})
    raise HttpError(404, "no such resource")


async def _start(nursery, **kw):
    from broker.wire.io.http import serve_http
    host, port = await nursery.start(lambda task_status: serve_http(_app, "127.0.0.1", 0, task_status=task_status, **kw))
    return host, port


async def test_routes_auth_and_errors():
    async with trio.open_nursery() as nursery:
        host, port = await _start(nursery)
        status, body = await http_get(host, port, "/secret")
        assert status == 401
        status, body = await http_get(host, port, "/secret", auth=("admin", "wrong"))
        assert status == 401
        status, body = await http_get(host, port, "/secret", auth=("admin", "admin"))
        assert (status, json.loads(body)) == (200, {"user": "admin"})
        status, body = await http_get(host, port, "/boom")
        assert status == 500
        # the server survived the handler's exception
        status, body = await http_request(host, port, "POST", "/echo?x=1", headers=[("Host", "h")], body=b'{"a": 2}')
        assert json.loads(body) == {"method": "POST", "query": {"x": "1"}, "body": {"a": 2}}
        status, body = await http_get(host, port, "/nothing")
        assert status == 404 and json.loads(body)["error"] == "no such resource"
        nursery.cancel_scope.cancel()


async def test_garbage_and_silent_clients_are_closed():
    async with trio.open_nursery() as nursery:
        host, port = await _start(nursery, request_timeout_s=0.5)
        garbage = await trio.open_tcp_stream(host, port)
        await garbage.send_all(b"\x00\x01\x02 not http\r\n\r\n")
        reply = await garbage.receive_some(4096)
        assert reply.startswith(b"HTTP/1.1 400")
        await garbage.aclose()
        silent = await trio.open_tcp_stream(host, port)
        with trio.fail_after(5):
            while await silent.receive_some(4096):
                pass  # the server closes the silent connection after its deadline
        await silent.aclose()
        status, _ = await http_get(host, port, "/nothing")
        assert status == 404
        nursery.cancel_scope.cancel()


def test_basic_auth_parsing_and_metrics_format():
    r = Request("GET", "/", {}, {"authorization": "Basic YWRtaW46YTpi"}, b"", "x")
    assert basic_auth(r) == ("admin", "a:b")
    assert basic_auth(Request("GET", "/", {}, {"authorization": "Basic !!!"}, b"", "x")) is None
    text = render_metrics([Metric("x_total", "counter", "X.", (({"a": 'q"'}, 3),)),
                           Metric("y", "gauge", "Y.", (({}, 1.5),))])
    assert text == '# HELP x_total X.\n# TYPE x_total counter\nx_total{a="q\\""} 3\n# HELP y Y.\n# TYPE y gauge\ny 1.5\n'
