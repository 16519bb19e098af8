"""docs/configuration.md, checked against the config model: no key missing, none stale.

Every TOML file Lodestone reads goes through ``broker.wire.io.tomlconfig.Table``, and every
value is read by one of its accessors naming the key (``get`` underneath ``str``, ``int``,
``bool``, ``float``, ``choice``, ``str_list``, ``path_value``, ``convert``), every sub-table by
``table``, ``tables`` or ``array_of_tables``. Three loaders use it: the router's
(``router.config.load_router_config``), the broker's (``broker.config.load_config``) and the
users file's (``broker.wire.io.users.load_users``). The pins file is JSON Lines and the
transaction table is no config, so nothing else reads TOML.

This test wraps those accessors, feeds the real loaders every sample file in ``etc/`` plus small
configs that open each table the samples leave out, and records ``(section, table, key)`` with
the names users choose (routers, acceptors, addresses, users, …) replaced by the placeholders
the reference uses (``<name>``; ``<user>`` under ``resource-limits``, ``<match>`` under
``address-settings``). A loader reads every key of a table it opens (defaults included), so
once every table is opened the recording is the whole model.

The reference is parsed by these conventions, which the document keeps:

* ``## Router``, ``## Broker node``, ``## Users file`` are the sections (one per loader).
* A ``###`` or ``####`` heading documents the tables written in backticks in it
  (``[routers.<name>.cache]``, ``[[acceptors]]``; quotes are ignored, so
  ``[resource-limits."<user>"]`` is ``resource-limits.<user>``); ``### Top level`` is the file's
  root. A heading naming two tables (``[broadcast-groups.<name>]`` and
  ``[discovery-groups.<name>]``) documents both with one key table: each table's keys must be
  in it, and each key in it must be read in at least one of them.
* A key table is a markdown table whose header's first cell is ``key``; every backticked word in
  a row's first cell is a key (``| `user`, `password` | …`` documents two).
* Fenced code blocks (examples) are skipped.
* In the broker section, ``[routers.…]`` and ``[routing-log]`` (the router inside the broker)
  are the router's tables: their keys are checked against the Router section.
"""

from __future__ import annotations

import re
import textwrap
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from broker.config import load_config
from broker.wire.io import tomlconfig
from broker.wire.io.tomlconfig import Table
from broker.wire.io.users import load_users
from router.config import load_router_config

ROOT = Path(__file__).resolve().parents[2]
ETC = ROOT / "etc"
DOC = ROOT / "docs" / "configuration.md"

ROUTER, BROKER, USERS = "Router", "Broker node", "Users file"
TOP_LEVEL = "Top level"

#: placeholder for the user-chosen names of a ``tables()`` family, by the family's path
PLACEHOLDERS = {("resource-limits",): "<user>", ("address-settings",): "<match>"}
#: tables whose keys are free (a policy's properties): recorded as a key of the parent table
FREE_FORM = {("routers", "<name>", "policy", "properties")}
#: broker tables that are the router's (the router inside the broker), documented under Router
EMBEDDED_ROUTER_TABLES = ("routers", "routing-log")


# -- recording -----------------------------------------------------------------------------------
@dataclass
class Recording:
    section: str = ""
    quiet: int = 0
    keys: set[tuple[str, str, str]] = field(default_factory=set)      # (section, table, key)
    opened: set[tuple[str, str]] = field(default_factory=set)          # (section, table)

    def doc_section(self, path: tuple[str, ...]) -> str:
        if self.section == BROKER and path and path[0] in EMBEDDED_ROUTER_TABLES:
            return ROUTER
        return self.section


def _path(t: Table) -> tuple[str, ...]:
    return getattr(t, "_doc_path", ())


def table_id(path: tuple[str, ...], array: bool) -> str:
    if not path:
        return TOP_LEVEL
    dotted = ".".join(path)
    return f"[[{dotted}]]" if array else f"[{dotted}]"


def _id(t: Table) -> str:
    return table_id(_path(t), getattr(t, "_doc_array", False))


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> Recording:
    rec = Recording()
    orig = {name: getattr(Table, name) for name in ("get", "table", "tables", "array_of_tables")}

    def get(self, key, *args, **kwargs):
        if not rec.quiet and _path(self) not in FREE_FORM:
            rec.keys.add((rec.doc_section(_path(self)), _id(self), key))
        return orig["get"](self, key, *args, **kwargs)

    def table(self, key, *args, **kwargs):
        child = orig["table"](self, key, *args, **kwargs)
        if not rec.quiet:
            child._doc_path = _path(self) + (key,)
            if child._doc_path in FREE_FORM:
                rec.keys.add((rec.doc_section(_path(self)), _id(self), key))
            elif key in self.data:
                rec.opened.add((rec.section, _id(child)))
        return child

    def tables(self, key):
        rec.quiet += 1
        try:
            out = orig["tables"](self, key)
        finally:
            rec.quiet -= 1
        family = _path(self) + (key,)
        for child in out.values():
            child._doc_path = family + (PLACEHOLDERS.get(family, "<name>"),)
            rec.opened.add((rec.section, _id(child)))
        return out

    def array_of_tables(self, key):
        out = orig["array_of_tables"](self, key)
        for child in out:
            child._doc_path = _path(self) + (key,)
            child._doc_array = True
            rec.opened.add((rec.section, _id(child)))
        return out

    tmp = tmp_path_factory.mktemp("configs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Table, "get", get)
        mp.setattr(Table, "table", table)
        mp.setattr(Table, "tables", tables)
        mp.setattr(Table, "array_of_tables", array_of_tables)
        for section, loader, files in _configs(tmp):
            rec.section = section
            for f in files:
                try:
                    loader(f)
                except tomlconfig.ConfigError as exc:  # a config of this test must load
                    pytest.fail(f"{f.name}: {exc}")
    return rec


def _write(folder: Path, name: str, text: str) -> Path:
    p = folder / name
    p.write_text(textwrap.dedent(text))
    return p


def _configs(tmp: Path) -> list[tuple[str, object, list[Path]]]:
    """(section, loader, files): the samples in etc/ and configs opening every other table."""
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp / name).write_text("not read by the loaders\n")
    users = (ETC / "users.toml").as_posix()

    routers = [ETC / "router.toml", ETC / "sites" / "router.toml"]
    routers.append(_write(tmp, "router-full.toml", f"""
        name = "full"
        users-file = "{users}"
        workers = 0

        [[acceptors]]
        name = "tls"
        port = 0
        router = "static"
        mode = "proxy"
        tls-cert = "cert.pem"
        tls-key = "key.pem"
        tls-client-ca = "ca.pem"
        upstream-tls = true
        upstream-ca = "ca.pem"
        upstream-proxy-protocol = true

        [routers.static]
        key-type = "SOURCE_IP"
        key-filter = "^[^.]+"
        local-target-filter = "NULL"
        artemis-keys = true
        [routers.static.policy]
        name = "LEAST_CONNECTIONS"
        properties = {{ CONNECTION_COUNT_THRESHOLD = 10 }}
        [routers.static.cache]
        backend = "redis"
        redis-url = "redis://127.0.0.1:6379/0"
        [routers.static.pool]
        allow-failback = false
        [[routers.static.pool.targets]]
        name = "a"
        host = "127.0.0.1"
        port = 5672
        management-url = "http://127.0.0.1:8161"
        node-id = "a-node"
        [[routers.static.pool.targets]]
        name = "a-backup"
        backup-of = "a"
        host = "127.0.0.1"
        port = 5673
        management-url = "http://127.0.0.1:8162"
        [routers.static.local-target]
        host = "127.0.0.1"
        port = 5672
        [routers.static.pins]
        file = "pins.jsonl"

        [routers.discovery.pool]
        source = "discovery"
        [routers.discovery.pool.discovery-group]
        group-address = "231.7.7.7"
        group-port = 9876
        cluster = "prod"
        key = "secret"
        """))
    (tmp / "broker.xml").write_text(textwrap.dedent("""\
        <configuration xmlns="urn:activemq"><core xmlns="urn:activemq:core">
          <connectors><connector name="node1">tcp://127.0.0.1:61616</connector></connectors>
          <connection-routers><connection-router name="xml">
            <key-type>CLIENT_ID</key-type>
            <local-target-filter>NULL</local-target-filter>
            <pool><static-connectors><connector-ref>node1</connector-ref></static-connectors></pool>
          </connection-router></connection-routers>
        </core></configuration>
        """))
    routers.append(_write(tmp, "router-xml-table.toml", """
        [import-artemis-xml]
        file = "broker.xml"
        [import-artemis-xml.local-target]
        host = "127.0.0.1"
        port = 5672
        [import-artemis-xml.connectors.node1]
        node-id = "node-1"
        management-url = "http://127.0.0.1:8161"
        """))
    (tmp / "broker-nolocal.xml").write_text(
        (tmp / "broker.xml").read_text().replace("<local-target-filter>NULL</local-target-filter>", ""))
    routers.append(_write(tmp, "router-xml-path.toml", """
        import-artemis-xml = "broker-nolocal.xml"
        [routers.toml.pool]
        [[routers.toml.pool.targets]]
        host = "127.0.0.1"
        port = 5672
        """))

    def broker(name: str, body: str) -> Path:
        head = f"""
            [acceptors.amqp]
            port = 0
            [security]
            users-file = "{users}"
            """
        return _write(tmp, name, textwrap.dedent(head) + textwrap.dedent(body))

    cluster = """
        [cluster]
        connector = "amqp://127.0.0.1:5672"
        static-connectors = ["amqp://127.0.0.1:5673"]
        """
    brokers = (sorted(ETC.glob("broker*.toml")) + sorted((ETC / "sites").glob("site-*.toml"))
               + sorted((ETC / "zookeeper").glob("*.toml")))
    brokers.append(broker("broker-full.toml", """
        [acceptors.tls]
        port = 0
        router = "edge"
        sasl-mechanisms = ["PLAIN", "EXTERNAL"]
        proxy-protocol-from = ["10.0.0.5/32"]
        [acceptors.tls.tls]
        cert-file = "cert.pem"
        key-file = "key.pem"
        ca-file = "ca.pem"
        require-client-cert = true

        [resource-limit-defaults]
        max-connections = 10
        [resource-limits."app"]
        max-queues = 5

        [wildcard-addresses]
        routing-enabled = true

        [address-settings."orders.#"]
        max-delivery-count = 3
        [addresses.orders]
        routing-types = ["anycast"]
        filter = "color = 'red'"

        [broadcast-groups.announce]
        group-address = "231.7.7.7"
        group-port = 9876
        [discovery-groups.hear]
        group-address = "231.7.7.7"
        group-port = 9876

        [cluster]
        connector = "amqp://127.0.0.1:5672"
        discovery-group = "hear"
        key = "secret"
        ca-file = "ca.pem"

        [ha]
        policy = "replication"
        role = "primary"
        check-for-live-server = true
        [ha.colocated]
        request-backup = true

        [routers.edge]
        local-target-filter = "NULL"
        [routers.edge.policy]
        name = "FIRST_ELEMENT"
        [routers.edge.cache]
        persisted = true
        [routers.edge.pool]
        source = "cluster"
        cluster-connection = "my-cluster"
        [routers.edge.pins]
        file = "pins.jsonl"
        [routing-log]
        path = "routing.log"

        [broker-connections.dr]
        uri = "amqp://127.0.0.1:5673"
        user = "bridge"
        password = "secret"
        [[broker-connections.dr.senders]]
        address-match = "orders.#"
        [[broker-connections.dr.receivers]]
        queue-name = "inbound"
        [broker-connections.dr.mirror]
        durable = true

        [logging]
        level = "DEBUG"
        """))
    ha_variants = {
        "live-only": 'policy = "live-only"\nscale-down = true\nscale-down-group-name = "g"',
        "shared-store-primary": 'policy = "shared-store"\nfailover-on-shutdown = true\nwait-for-activation = true',
        "shared-store-backup": 'policy = "shared-store"\nrole = "backup"\nallow-failback = false\nrestart-backup = false',
        "replication-backup": ('policy = "replication"\nrole = "backup"\ngroup-name = "g"\n'
                               'max-saved-replicated-journals-size = 2\nbackup-fsync = false\nscale-down = true'),
        "replication-zookeeper": ('policy = "replication"\ncoordination-id = "pair-a"\n'
                                  '[ha.manager]\nconnect-string = "zk1:2181,zk2:2181,zk3:2181"'),
    }
    for variant, ha in ha_variants.items():
        brokers.append(broker(f"broker-ha-{variant}.toml", textwrap.dedent(cluster) + "[ha]\n" + ha + "\n"))

    users_files = [ETC / "users.toml", _write(tmp, "users-extra.toml", """
        [users.ops]
        password = "scrypt$n=16384,r=8,p=1$jp5aSVZpVPfj10CnbjlerA==$c18PoXTZeL59ALg4qpJvP2x5bf/T1D4GRChzXuT5u/g="
        sources = ["10.0.0.0/8"]
        [anonymous]
        enabled = true
        [login]
        max-concurrent-verifications = 2
        [[permissions]]
        match = "orders.#"
        send = ["ops"]
        """)]
    return [(ROUTER, load_router_config, routers), (BROKER, load_config, brokers),
            (USERS, load_users, users_files)]


# -- the reference -------------------------------------------------------------------------------
_HEADING = re.compile(r"^(#{2,4})\s+(.*)$")
_TABLE_REF = re.compile(r"`(\[\[?[^`\]]+\]\]?)`")
_TICKED = re.compile(r"`([^`]+)`")


@dataclass
class Heading:
    section: str
    text: str
    tables: tuple[str, ...]
    keys: set[str] = field(default_factory=set)
    has_key_table: bool = False


def _normalize_ref(ref: str) -> str:
    return ref.replace('"', "").replace(" ", "")


def parse_reference(text: str) -> list[Heading]:
    """The document's headings with the tables they name and the keys of their key tables."""
    headings: list[Heading] = []
    section, current = "", None
    in_key_table = in_code = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        if in_code or line.startswith("```"):
            in_key_table = False
            continue
        m = _HEADING.match(line)
        if m:
            in_key_table = False
            if len(m.group(1)) == 2:
                section, current = m.group(2).strip(), None
                continue
            title = m.group(2).strip()
            refs = tuple(_normalize_ref(r) for r in _TABLE_REF.findall(title))
            if title == TOP_LEVEL:
                refs = (TOP_LEVEL,)
            current = Heading(section, title, refs)
            headings.append(current)
            continue
        if not line.startswith("|"):
            in_key_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not in_key_table:
            if cells[0] == "key":
                if current is None or not current.tables:
                    raise AssertionError(f"docs/configuration.md:{n}: a key table under a heading "
                                         f"that names no table ({current.text if current else section!r})")
                in_key_table = current.has_key_table = True
            continue
        if set(cells[0]) <= set("-: "):
            continue
        keys = _TICKED.findall(cells[0])
        if not keys:
            raise AssertionError(f"docs/configuration.md:{n}: a key row without a `key`: {line!r}")
        current.keys.update(keys)
    return headings


@pytest.fixture(scope="module")
def reference() -> list[Heading]:
    return parse_reference(DOC.read_text())


def _documented(reference: list[Heading]) -> dict[tuple[str, str], list[Heading]]:
    out: dict[tuple[str, str], list[Heading]] = defaultdict(list)
    for h in reference:
        for t in h.tables:
            out[(h.section, t)].append(h)
    return out


# -- the checks ----------------------------------------------------------------------------------
def test_every_key_the_code_reads_is_documented(recording, reference):
    documented = _documented(reference)
    missing = []
    for section, table, key in sorted(recording.keys):
        keys = set().union(*(h.keys for h in documented.get((section, table), [])))
        if key not in keys:
            where = "no heading documents this table" if (section, table) not in documented else ""
            missing.append(f"{section} / {table}: `{key}` {where}".rstrip())
    assert not missing, "keys the code reads but docs/configuration.md does not document:\n  " + \
        "\n  ".join(missing)


def test_every_documented_key_is_read_by_the_code(recording, reference):
    read: dict[tuple[str, str], set[str]] = defaultdict(set)
    for section, table, key in recording.keys:
        read[(section, table)].add(key)
    stale = []
    for h in reference:
        if not h.has_key_table:
            continue
        seen = set().union(*(read.get((h.section, t), set()) for t in h.tables))
        for key in sorted(h.keys - seen):
            stale.append(f"{h.section} / {' and '.join(h.tables)}: `{key}`")
    assert not stale, "keys docs/configuration.md documents but the code does not read there:\n  " + \
        "\n  ".join(stale)


def test_every_documented_table_is_opened_by_a_config_of_this_test(recording, reference):
    unopened = [f"{h.section} / {t}" for h in reference for t in h.tables
                if t != TOP_LEVEL and (h.section, t) not in recording.opened]
    assert not unopened, ("tables docs/configuration.md documents that no config of this test opens "
                          "(a wrong name, or add a config that opens it):\n  " + "\n  ".join(unopened))


def test_every_table_the_code_opens_has_a_heading(recording, reference):
    documented = _documented(reference)
    # a broker's router tables are documented in the Router section (and pointed to from Broker node)
    undocumented = sorted(f"{s} / {t}" for s, t in recording.opened
                          if (s, t) not in documented
                          and not (s == BROKER and (ROUTER, t) in documented))
    assert not undocumented, "tables without a heading in docs/configuration.md:\n  " + \
        "\n  ".join(undocumented)


def test_the_parser_sees_the_sections_and_multi_key_rows():
    doc = textwrap.dedent("""\
        ## Router
        ### Top level
        | key | default | meaning |
        |---|---|---|
        | `name` | x | y |
        ### `[management]`
        | key | default | meaning |
        |---|---|---|
        | `user`, `password` | none | z |
        ## Broker node
        ### `[resource-limit-defaults]` and `[resource-limits."<user>"]`
        | key | default | meaning |
        |---|---|---|
        | `max-queues` | 1 | q |

        ```toml
        | key |
        ### `[not-a-heading]`
        ```
        """)
    h = parse_reference(doc)
    assert [(x.section, x.tables, x.keys) for x in h] == [
        (ROUTER, (TOP_LEVEL,), {"name"}),
        (ROUTER, ("[management]",), {"user", "password"}),
        (BROKER, ("[resource-limit-defaults]", "[resource-limits.<user>]"), {"max-queues"}),
    ]
