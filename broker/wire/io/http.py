"""A small HTTP/1.1 server for management APIs, on trio + h11.

Theory of operation: h11 is the sans-IO HTTP codec; this module is the shell around it. One
nursery accepts connections and a handler task per connection reads one request at a time
(keep-alive is honoured), calls the application's async ``handler(Request) -> Response`` and
writes the reply. Every connection has a deadline for reading a request (``request_timeout_s``)
so an idle or slow client cannot hold a task forever. Bodies are capped (``max_body_bytes``).
A handler exception becomes a 500 for that request only; the server keeps serving.

Both the broker and the router mount their management API on this server.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import ssl
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable
from urllib.parse import parse_qs, unquote, urlsplit

import h11
import trio

log = logging.getLogger("lodestone.http")


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names
    body: bytes
    client: str  # "host:port" of the peer

    def json(self) -> Any:
        """Decode the body as JSON; raises HttpError(400) when it is not."""
        try:
            return json.loads(self.body or b"null")
        except (ValueError, UnicodeDecodeError):
            raise HttpError(400, "request body is not valid JSON") from None


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)


class HttpError(Exception):
    """Raise from a handler to answer with this status and a JSON error body."""

    def __init__(self, status: int, message: str, headers: Iterable[tuple[str, str]] = ()):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = list(headers)


Handler = Callable[[Request], Awaitable[Response]]


def json_response(obj: Any, status: int = 200) -> Response:
    """A JSON response (UTF-8, compact, keys in insertion order)."""
    return Response(status, json.dumps(obj, separators=(",", ":"), default=str).encode() + b"\n")


def text_response(text: str, status: int = 200, content_type: str = "text/plain; charset=utf-8") -> Response:
    return Response(status, text.encode(), content_type)


def basic_auth(request: Request) -> tuple[str, str] | None:
    """The (user, password) of an ``Authorization: Basic`` header, or None."""
    value = request.headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "basic" or not token:
        return None
    try:
        user, sep, password = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return (user, password) if sep else None


def require_basic_auth(request: Request, check: Callable[[str, str], bool], realm: str = "lodestone") -> str:
    """Return the authenticated user or raise HttpError(401) with a WWW-Authenticate challenge."""
    creds = basic_auth(request)
    if creds is None or not check(*creds):
        raise HttpError(401, "authentication required", [("WWW-Authenticate", f'Basic realm="{realm}"')])
    return creds[0]


# -- Prometheus text exposition (format 0.0.4) ------------------------------------------------

@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # counter | gauge
    help: str
    samples: tuple[tuple[dict[str, str], float], ...]  # (labels, value)


def render_metrics(metrics: Iterable[Metric]) -> str:
    """Render metrics in the Prometheus text format."""
    out: list[str] = []
    for m in metrics:
        out.append(f"# HELP {m.name} {_escape_help(m.help)}")
        out.append(f"# TYPE {m.name} {m.kind}")
        for labels, value in m.samples:
            if labels:
                inner = ",".join(f'{k}="{escape_label(str(v))}"' for k, v in labels.items())
                out.append(f"{m.name}{{{inner}}} {_fmt(value)}")
            else:
                out.append(f"{m.name} {_fmt(value)}")
    return "\n".join(out) + "\n"


def metrics_response(metrics: Iterable[Metric]) -> Response:
    return text_response(render_metrics(metrics), content_type="text/plain; version=0.0.4; charset=utf-8")


def _escape_help(s: str) -> str:
    return s.replace("\\", "\\\\").replace("\n", "\\n")


def escape_label(s: str) -> str:
    """A Prometheus label value, escaped (backslash, double quote, newline)."""
    return s.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(v: float) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


# -- the server ------------------------------------------------------------------------------

_REASONS = {200: b"OK", 201: b"Created", 204: b"No Content", 400: b"Bad Request", 401: b"Unauthorized",
            403: b"Forbidden", 404: b"Not Found", 405: b"Method Not Allowed", 408: b"Request Timeout",
            413: b"Payload Too Large", 500: b"Internal Server Error", 503: b"Service Unavailable"}


async def serve_http(handler: Handler, host: str, port: int, *, request_timeout_s: float = 10.0,
                     max_body_bytes: int = 1 << 20, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve HTTP on host:port forever. ``task_status.started((host, port))`` reports the bound address."""
    try:
        listeners = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:  # name the address: "Address already in use" alone tells nothing
        raise OSError(exc.errno, f"management: cannot listen on {host}:{port}: {exc.strerror}") from None
    sockname = listeners[0].socket.getsockname()
    async with trio.open_nursery() as nursery:
        task_status.started((sockname[0], sockname[1]))
        await nursery.start(trio.serve_listeners,
                            lambda s: _serve_connection(s, handler, request_timeout_s, max_body_bytes),
                            listeners)


async def _serve_connection(stream: trio.SocketStream, handler: Handler, timeout_s: float, max_body: int) -> None:
    try:
        peer = stream.socket.getpeername()
        client = f"[{peer[0]}]:{peer[1]}" if ":" in peer[0] else f"{peer[0]}:{peer[1]}"
    except OSError:
        client = "?"
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
    try:
        while True:
            with trio.move_on_after(timeout_s) as scope:
                request = await _read_request(stream, conn, client, max_body)
            if scope.cancelled_caught:
                if conn.our_state is h11.SEND_RESPONSE:
                    await _send(stream, conn, Response(408, b'{"error":"request timeout"}\n'))
                return
            if request is None:
                return
            if isinstance(request, Response):  # a protocol-level error reply
                await _send(stream, conn, request)
                return
            try:
                response = await handler(request)
            except HttpError as exc:
                response = json_response({"error": exc.message}, exc.status)
                response.headers.extend(exc.headers)
            except Exception:  # the handler's bug must not take the server down
                log.exception("management handler failed for %s %s", request.method, request.path)
                response = json_response({"error": "internal error"}, 500)
            await _send(stream, conn, response)
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the peer went away; nothing to answer
    finally:
        await trio.aclose_forcefully(stream)


async def _read_request(stream, conn: h11.Connection, client: str, max_body: int) -> Request | Response | None:
    head: h11.Request | None = None
    body = bytearray()
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as exc:
            return json_response({"error": f"bad request: {exc}"}, exc.error_status_hint)
        if event is h11.NEED_DATA:
            data = await stream.receive_some(65536)
            conn.receive_data(data)  # b"" signals EOF
            if not data and head is None:
                return None
            continue
        if isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > max_body:
                return json_response({"error": "request body too large"}, 413)
        elif isinstance(event, h11.EndOfMessage):
            assert head is not None
            target = head.target.decode("latin-1")
            parts = urlsplit(target)
            query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in head.headers}
            return Request(head.method.decode("ascii"), unquote(parts.path), query, headers, bytes(body), client)
        elif isinstance(event, h11.ConnectionClosed):
            return None


async def _send(stream, conn: h11.Connection, response: Response) -> None:
    headers = [("Content-Type", response.content_type), ("Content-Length", str(len(response.body)))]
    headers += response.headers
    reason = _REASONS.get(response.status, b"")
    try:
        data = conn.send(h11.Response(status_code=response.status, headers=headers, reason=reason))
        data += conn.send(h11.Data(data=response.body)) if response.body else b""
        data += conn.send(h11.EndOfMessage())
    except h11.LocalProtocolError:
        return
    await stream.send_all(data)


# -- a small client, for tests and health probes ----------------------------------------------

async def http_get(host: str, port: int, path: str, *, auth: tuple[str, str] | None = None,
                   timeout_s: float = 5.0, ssl_context: ssl.SSLContext | None = None,
                   headers: list[tuple[str, str]] = (), max_body_bytes: int | None = None) -> tuple[int, bytes]:
    """GET one resource (a new connection each call). Raises OSError / trio.TooSlowError on failure.

    ``ssl_context`` makes it HTTPS (server name = ``host``); ``headers`` are added to the request.
    """
    return await http_call(host, port, "GET", path, auth=auth, timeout_s=timeout_s, ssl_context=ssl_context,
                           headers=headers, max_body_bytes=max_body_bytes)


async def http_call(host: str, port: int, method: str, path: str, *, body: bytes = b"",
                    auth: tuple[str, str] | None = None, timeout_s: float = 5.0,
                    ssl_context: ssl.SSLContext | None = None, headers: list[tuple[str, str]] = (),
                    max_body_bytes: int | None = None) -> tuple[int, bytes]:
    """``http_get`` for any method, with an optional ``body``."""
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    hdrs = [("Host", netloc), ("Connection", "close")]
    if auth is not None:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        hdrs.append(("Authorization", f"Basic {token}"))
    hdrs += list(headers)
    return await http_request(host, port, method, path, headers=hdrs, body=body, timeout_s=timeout_s,
                              ssl_context=ssl_context, max_body_bytes=max_body_bytes)


async def get_json_url(url: str, *, headers: list[tuple[str, str]] = (), auth: tuple[str, str] | None = None,
                       timeout_s: float = 2.0, ssl_context: ssl.SSLContext | None = None,
                       max_body_bytes: int | None = None) -> tuple[int, bytes]:
    """GET ``url`` asking for JSON (the router's health probes and cluster reads, the HA vote);
    returns (status, body). https URLs use ``ssl_context`` or the system trust store."""
    return await call_json_url(url, "GET", headers=headers, auth=auth, timeout_s=timeout_s,
                               ssl_context=ssl_context, max_body_bytes=max_body_bytes)


async def call_json_url(url: str, method: str, *, body: bytes = b"", headers: list[tuple[str, str]] = (),
                        auth: tuple[str, str] | None = None, timeout_s: float = 2.0,
                        ssl_context: ssl.SSLContext | None = None,
                        max_body_bytes: int | None = None) -> tuple[int, bytes]:
    """``get_json_url`` for any method; a ``body`` is sent as JSON (the router's drain)."""
    parts = urlsplit(url)
    https = parts.scheme == "https"
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    ctx = (ssl_context or ssl.create_default_context()) if https else None
    hdrs = [("Accept", "application/json"), *([("Content-Type", "application/json")] if body else []), *headers]
    return await http_call(parts.hostname or "localhost", parts.port or (443 if https else 80), method, target,
                           body=body, auth=auth, timeout_s=timeout_s, ssl_context=ctx, headers=hdrs,
                           max_body_bytes=max_body_bytes)


async def http_request(host: str, port: int, method: str, path: str, *, headers: list[tuple[str, str]],
                       body: bytes = b"", timeout_s: float = 5.0, ssl_context: ssl.SSLContext | None = None,
                       server_hostname: str | None = None,
                       max_body_bytes: int | None = None) -> tuple[int, bytes]:
    """One HTTP/1.1 request over a fresh connection; returns (status, body).

    With ``ssl_context`` the connection is TLS (SNI and certificate name ``server_hostname``,
    default ``host``). A body longer than ``max_body_bytes`` raises ValueError.
    """
    with trio.fail_after(timeout_s):
        stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
        try:
            if ssl_context is not None:
                stream = trio.SSLStream(stream, ssl_context, server_hostname=server_hostname or host)
                await stream.do_handshake()
            conn = h11.Connection(h11.CLIENT)
            hdrs = list(headers)
            if body or method in ("POST", "PUT", "PATCH"):
                hdrs.append(("Content-Length", str(len(body))))
            data = conn.send(h11.Request(method=method, target=path, headers=hdrs))
            if body:
                data += conn.send(h11.Data(data=body))
            data += conn.send(h11.EndOfMessage())
            await stream.send_all(data)
            status = 0
            out = bytearray()
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await stream.receive_some(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    out += event.data
                    if max_body_bytes is not None and len(out) > max_body_bytes:
                        raise ValueError("response body too large")
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    return status, bytes(out)
        finally:
            await trio.aclose_forcefully(stream)
