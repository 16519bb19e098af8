"""Lodestone's AMQP 1.0 broker node (``lodestone-broker``); docs/architecture.md maps the packages."""

VERSION = "0.1.0"
