"""What both programs speak: the shared package of the broker and the router.

The sans-IO formats at this level (AMQP 1.0 codec and frames, SASL, PROXY v2, the discovery
packet, the cluster notifications, the users' address wildcards, source limits) are pure: bytes
and values in, values and bytes out, no sockets, clocks or files. ``broker.wire.io`` holds the
I/O helpers both programs use (the HTTP server on h11, TLS contexts, TOML loading, the users file,
the login gate, logging, multicast UDP, trio helpers).

This package imports nothing else of the broker or the router (tests/unit/test_architecture.py).
"""
