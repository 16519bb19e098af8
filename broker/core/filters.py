"""Consumer and queue filters over the core's messages (pure).

A filter is a predicate ``accepts(msg) -> bool`` that the queues call (``broker.core.queues``):

* a **selector** (``apache.org:selector-filter:string``, the JMS/Artemis SQL-92 subset parsed by
  :mod:`broker.core.selector`), evaluated over a lazy view of the message's sections that is
  decoded at most once per message and kept on it (``Message.view``), so several consumers'
  selectors over one waiting message decode it once;
* **no-local** (``apache.org:no-local-filter:list``): not the messages its own connection
  published (``Message.origin``);
* both together.

A configured queue filter (``[addresses.<name>] filter``) and a multicast subscriber's selector
are *queue* filters: a message they do not accept never enters that queue (``Broker.publish``).
"""

from __future__ import annotations

from typing import Callable

from broker.core.deliveries import Message
from broker.core.selector import MessageView, SelectorError, compile_filter, parse_selector

__all__ = ["SelectorError", "compile_queue_filter", "consumer_filter", "view_of"]


def view_of(msg: Message) -> MessageView:
    """The message's decoded view, made once and kept on the message."""
    v = msg.view
    if v is None:
        v = msg.view = MessageView(msg.body)
    return v


def compile_queue_filter(text: str) -> Callable[[Message], bool]:
    """A selector as a predicate on messages; raises :class:`SelectorError` when it is invalid."""
    sel = compile_filter(text)
    if sel is None:
        return lambda msg: True
    matches = sel.matches
    return lambda msg: matches(view_of(msg))


def consumer_filter(selector: str | None, no_local_origin: object = None) -> Callable[[Message], bool] | None:
    """The predicate for a consumer with an optional selector and, when ``no_local_origin`` is
    given, no-local against that origin; None when nothing filters."""
    # on the attach path a blank selector is an error, as in Artemis (SelectorParser.parse)
    sel = parse_selector(selector) if selector is not None else None
    if sel is None and no_local_origin is None:
        return None
    if no_local_origin is None:
        matches = sel.matches
        return lambda msg: matches(view_of(msg))
    if sel is None:
        return lambda msg: msg.origin != no_local_origin
    matches = sel.matches
    return lambda msg: msg.origin != no_local_origin and matches(view_of(msg))
