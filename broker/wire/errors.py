"""Errors shared by the broker and the router, split as h11 does.

* ``LocalProtocolError`` — *we* misused an API or tried to send something the protocol forbids
  (e.g. encoding a ``UByte(300)``). A bug on our side; never the peer's fault.
* ``RemoteProtocolError`` — the *peer* sent something malformed or out of order. The shell closes
  that one connection (writing ``reply`` first when it is not empty) and keeps serving others.

Every error carries the AMQP error condition symbol (AMQP 1.0 §2.8.15-§2.8.18) that belongs on the
wire, the way h2 errors carry ``error_code``, plus a human ``description``.
"""

from __future__ import annotations

__all__ = [
    "LodestoneError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "EncodeError",
    "DecodeError",
    "FramingError",
    "NotThisProtocol",
    "SaslProtocolError",
]


class LodestoneError(Exception):
    """Base of every Lodestone error: an AMQP ``condition`` symbol and a ``description``."""

    #: AMQP error condition symbol written to the peer (§2.8.15 amqp-error).
    condition: str = "amqp:internal-error"

    def __init__(self, description: str = "", condition: str | None = None, *, reply: bytes = b""):
        super().__init__(description)
        self.description = description
        if condition is not None:
            self.condition = condition
        #: Bytes the shell should write to the peer before closing (may be empty).
        self.reply = reply

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description!r}, condition={self.condition!r})"


class LocalProtocolError(LodestoneError):
    """We tried to do something the protocol or the API forbids."""


class RemoteProtocolError(LodestoneError):
    """The peer violated the protocol; close that connection with ``condition``."""


class EncodeError(LocalProtocolError, ValueError):
    """A Python value cannot be encoded as the requested AMQP type."""


class DecodeError(RemoteProtocolError):
    """Malformed or truncated AMQP encoded data (§1.6)."""

    condition = "amqp:decode-error"


class FramingError(RemoteProtocolError):
    """A frame header is invalid or a frame is larger than allowed (§2.3.1)."""

    condition = "amqp:connection:framing-error"


class SaslProtocolError(RemoteProtocolError):
    """The peer broke the SASL exchange (§5.3): an unexpected frame, a challenge we cannot answer."""

    condition = "amqp:connection:framing-error"


class NotThisProtocol(RemoteProtocolError):
    """The bytes are not an AMQP 1.0 protocol header we accept (§2.2).

    ``data`` holds every byte read so far (so a sniffer can hand them to another protocol
    handler); ``reply`` is our own supported protocol header — per §2.2 a server that does not
    accept the requested protocol writes the header it supports and closes the socket.
    """

    condition = "amqp:connection:framing-error"

    def __init__(self, description: str, data: bytes, *, reply: bytes = b""):
        super().__init__(description, reply=reply)
        self.data = data
