"""The proton-C entry points the engine's package calls on the hot path.

Bound once from cffi (``lib.pn_*``): a direct call skips the Python wrapper objects proton
builds per call. Only ``broker.amqp`` uses them (the engine, its link API ``links.py``, the
transactions); a broker service owns links through :mod:`broker.amqp.links` and never reads
proton (tests/unit/test_architecture.py).
"""

from __future__ import annotations

from cproton_ffi import ffi, lib
from proton import Terminus

pn_collector_peek = lib.pn_collector_peek
pn_collector_pop = lib.pn_collector_pop
pn_event_type = lib.pn_event_type
pn_event_delivery = lib.pn_event_delivery
pn_event_link = lib.pn_event_link
pn_delivery_link = lib.pn_delivery_link
pn_delivery_partial = lib.pn_delivery_partial
pn_delivery_readable = lib.pn_delivery_readable
pn_delivery_pending = lib.pn_delivery_pending
pn_delivery_settled = lib.pn_delivery_settled
pn_delivery_updated = lib.pn_delivery_updated
pn_delivery_settle = lib.pn_delivery_settle
pn_delivery_update = lib.pn_delivery_update
pn_delivery_remote_state = lib.pn_delivery_remote_state
pn_delivery_remote = lib.pn_delivery_remote
pn_delivery = lib.pn_delivery
pn_link_recv = lib.pn_link_recv
pn_link_send = lib.pn_link_send
pn_link_advance = lib.pn_link_advance
pn_link_credit = lib.pn_link_credit
pn_link_flow = lib.pn_link_flow
pn_link_get_drain = lib.pn_link_get_drain
pn_link_drained = lib.pn_link_drained


def terminus_capabilities(terminus: Terminus) -> set[str]:
    """The capability symbols of a source or target (a list, an array or one symbol)."""
    data = terminus.capabilities
    out: set[str] = set()
    if data is None:
        return out
    data.rewind()
    while data.next():
        obj = data.get_object()
        items = getattr(obj, "elements", None)
        if items is None:
            items = obj if isinstance(obj, (list, tuple)) else [obj]
        out.update(str(x) for x in items)
    return out


#: cffi buffer view of bytes (what pn_link_send / pn_link_recv take)
from_buffer = ffi.from_buffer
