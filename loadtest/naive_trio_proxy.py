"""A naive trio TCP/TLS byte proxy: the "plain Python" baseline loadtest/bench_proxy.py measures
in the same run as the router (target ``trio-naive``).

    python loadtest/naive_trio_proxy.py BACKEND_HOST:BACKEND_PORT [CERT_AND_KEY.pem]

Binds two ports on 127.0.0.1 (plain, and TLS-terminating when a PEM is given) and prints
``listening plain <port>`` / ``listening tls <port>``. One task pair per connection, 64 KiB reads,
no half-close, no AMQP, no tuning — what a straightforward trio proxy costs per connection.
"""

import ssl
import sys
from functools import partial

import trio

BUF = 65536


async def handle(backend_addr, client):
    try:
        backend = await trio.open_tcp_stream(*backend_addr)
    except OSError:
        await client.aclose()
        return

    async def one_way(src, dst, cancel_scope):
        try:
            while data := await src.receive_some(BUF):
                await dst.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        cancel_scope.cancel()  # naive: either side ending ends both

    async with client, backend:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one_way, client, backend, nursery.cancel_scope)
            nursery.start_soon(one_way, backend, client, nursery.cancel_scope)


async def main():
    host, port = sys.argv[1].rsplit(":", 1)
    h = partial(handle, (host, int(port)))
    async with trio.open_nursery() as nursery:
        plain = await trio.open_tcp_listeners(0, host="127.0.0.1")
        print("listening plain", plain[0].socket.getsockname()[1], flush=True)
        nursery.start_soon(trio.serve_listeners, h, plain)
        if len(sys.argv) > 2:
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.load_cert_chain(sys.argv[2])
            tls = [trio.SSLListener(l, ctx, https_compatible=True)
                   for l in await trio.open_tcp_listeners(0, host="127.0.0.1")]
            print("listening tls", tls[0].transport_listener.socket.getsockname()[1], flush=True)
            nursery.start_soon(trio.serve_listeners, h, tls)


if __name__ == "__main__":
    try:
        trio.run(main)
    except KeyboardInterrupt:
        pass
