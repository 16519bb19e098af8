"""The architecture, enforced: no import cycles, rings that hold, no private names across packages.

docs/architecture.md draws the map; this test reads every module of the project with ``ast``
(it finds them itself) and fails on:

- an import cycle between the project's modules. Imports inside functions count (they are still
  edges: a cycle closed by a lazy import is a cycle); ``from pkg import mod`` is an import of
  ``pkg.mod``; imports under ``if TYPE_CHECKING:`` do not count (they never run);
- an import inside a function of a project module (with no cycles there is nothing to dodge;
  a lazy import stays only for an optional third-party dependency such as pyspark);
- an import that breaks a ring:
  * the pure rings (the router core, the broker core, the shared package's formats outside
    ``broker.wire.io``, the store's records, state and config, every ``errors`` module) import
    only pure modules, no trio, socket, ssl, threading, time, os, pathlib, io, logging or other
    I/O module, and call no ``open()``; they take ``now``, bytes and a seeded ``random.Random``
    from their callers (``random`` may be imported only to name or build a seeded
    ``random.Random(seed)``);
  * the broker core and the store import neither the engine (``broker.amqp``) nor proton;
  * the engine (``broker.amqp`` but its listener, ``driver``) knows the node only as an
    ``EngineHost``: it imports no node, server, management, routing, cluster or HA module; and
    proton's C calls (``broker.amqp.pn``) stay inside it: services own links through
    ``broker.amqp.links``;
  * the shared package (``broker.wire``) imports nothing else of the broker or the router;
  * the broker imports from the router only its pure core and the embedding module
    (``router.embed``); the router imports from the broker only the shared package;
    ``router.local`` (``lodestone-local``, which runs both programs) may import both;
- a private name (``_x``) or private module imported from another package;
- an attribute of the broker's node set from outside ``broker.node`` (``node.ha = …``): a role
  or a service goes through the node's methods or is asked by the node (``Node.role``).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("broker", "router", "spark", "loadtest")

#: modules a pure ring may not import (top-level names)
IMPURE = {"trio", "socket", "ssl", "threading", "time", "os", "pathlib", "io", "shutil",
          "tempfile", "subprocess", "select", "selectors", "asyncio", "concurrent", "multiprocessing",
          "glob", "logging", "signal", "getpass", "h11", "redis", "proton"}
#: what a pure ring may not touch in ``sys`` (``sys.byteorder`` and the like are fine)
SYS_IO = {"stdin", "stdout", "stderr", "argv", "exit", "environ", "path", "modules"}
#: third-party modules a function may import lazily: optional dependencies
OPTIONAL = {"pyspark", "matplotlib", "locust", "gevent", "pandas", "numpy"}


@dataclass
class Import:
    importer: str
    target: str          # the project module imported (longest existing prefix)
    names: tuple[str, ...]  # names taken from it (``from m import a, b``); () for ``import m``
    lineno: int
    in_function: bool
    external: str | None = None   # a third-party / stdlib top-level module, when not ours


@dataclass
class Project:
    root: Path = REPO
    modules: dict[str, Path] = field(default_factory=dict)
    imports: list[Import] = field(default_factory=list)
    opens: list[tuple[str, int]] = field(default_factory=list)   # calls of builtin open(), sys.stdout & co
    randomness: list[tuple[str, int, str]] = field(default_factory=list)   # random.* other than a seeded Random


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def scan(repo: Path = REPO, packages=PACKAGES) -> Project:
    """Every module under ``packages`` and every import it makes (TYPE_CHECKING blocks excluded)."""
    proj = Project(repo)
    for pkg in packages:
        for path in sorted((repo / pkg).rglob("*.py")):
            if "node_modules" not in path.parts:
                proj.modules[_module_name(path, repo)] = path

    def resolve(name: str) -> str | None:
        while name and name not in proj.modules:
            name = name.rpartition(".")[0]
        return name or None

    for mod, path in proj.modules.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))

        def visit(node: ast.AST, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, ast.If) and _is_type_checking(child.test):
                    for stmt in child.orelse:
                        visit(stmt, inner)
                    continue
                if isinstance(child, ast.Import):
                    for alias in child.names:
                        target = resolve(alias.name)
                        proj.imports.append(Import(mod, target or "", (), child.lineno, in_function,
                                                   None if target else alias.name.split(".")[0]))
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        here = mod.split(".") if is_pkg else mod.split(".")[:-1]
                        here = here[:len(here) - child.level + 1]
                        base = ".".join(here + ([base] if base else []))
                    owner = resolve(base)
                    if owner is None:
                        proj.imports.append(Import(mod, "", tuple(a.name for a in child.names), child.lineno,
                                                   in_function, base.split(".")[0]))
                        continue
                    plain = []
                    for alias in child.names:
                        sub = f"{base}.{alias.name}"
                        if sub in proj.modules:        # from pkg import mod: an import of pkg.mod
                            proj.imports.append(Import(mod, sub, (), child.lineno, in_function))
                        else:
                            plain.append(alias.name)
                    if plain:
                        proj.imports.append(Import(mod, owner, tuple(plain), child.lineno, in_function))
                elif (isinstance(child, ast.Call) and isinstance(child.func, ast.Name)
                      and child.func.id == "open"):
                    proj.opens.append((mod, child.lineno))
                elif isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name) \
                        and child.value.id == "sys" and child.attr in SYS_IO:
                    proj.opens.append((mod, child.lineno))
                elif isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name) \
                        and child.value.id == "random" and child.attr != "Random":
                    proj.randomness.append((mod, child.lineno, f"random.{child.attr}"))
                elif (isinstance(child, ast.Call) and ast.unparse(child.func) == "random.Random"
                      and not (child.args or child.keywords)):
                    proj.randomness.append((mod, child.lineno, "an unseeded random.Random()"))
                visit(child, inner)

        visit(tree, False)
    return proj


def cycles(proj: Project) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), and self-imports."""
    edges: dict[str, set[str]] = defaultdict(set)
    for imp in proj.imports:
        if imp.target:
            edges[imp.importer].add(imp.target)
    found = [[m] for m in edges if m in edges[m]]
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def strongconnect(v: str) -> None:     # iterative, so deep graphs do not hit the recursion limit
        work = [(v, iter(sorted(edges[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))

    for v in sorted(proj.modules):
        if v not in index:
            strongconnect(v)
    return found


def _under(mod: str, *prefixes: str) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def _package(mod: str, modules: dict[str, Path]) -> str:
    return mod if modules[mod].name == "__init__.py" else mod.rpartition(".")[0]


def is_pure(mod: str) -> bool:
    """The pure rings: decisions and formats, no I/O."""
    return (_under(mod, "router.core", "broker.core")
            or (_under(mod, "broker.wire") and not _under(mod, "broker.wire.io"))
            or mod.rpartition(".")[2] == "errors"          # every package's errors.py (STYLE: one per package)
            or mod in {"broker.store.journal.records", "broker.store.journal.state",
                       "broker.store.journal.config"})


def ring_violations(proj: Project) -> list[str]:
    bad = []
    for imp in proj.imports:
        m, t = imp.importer, imp.target
        where = f"{proj.modules[m].relative_to(proj.root)}:{imp.lineno}: {m} imports {t or imp.external}"
        if is_pure(m):
            if imp.external in IMPURE:
                bad.append(f"{where} (a pure ring does no I/O, clocks or randomness)")
            if t and not is_pure(t):
                bad.append(f"{where} (a pure ring imports only pure modules)")
        if _under(m, "broker.core", "broker.store") and (_under(t, "broker.amqp") or imp.external == "proton"):
            bad.append(f"{where} (the broker core and the store do not know the engine)")
        if (_under(m, "broker.amqp") and m != "broker.amqp.driver"
                and _under(t, "broker.node", "broker.lifecycle", "broker.role", "broker.process", "broker.management",
                           "broker.routing", "broker.cluster", "broker.ha", "broker.amqp.driver")):
            bad.append(f"{where} (the engine knows its host only as an EngineHost)")
        if _under(t, "broker.amqp.pn") and not _under(m, "broker.amqp"):
            bad.append(f"{where} (proton's C calls stay in the engine's package: own links with broker.amqp.links)")
        if _under(m, "broker.wire") and t and not _under(t, "broker.wire"):
            bad.append(f"{where} (the shared package imports neither program)")
        if _under(m, "broker") and _under(t, "router") and not _under(t, "router.core", "router.embed"):
            bad.append(f"{where} (the broker imports only router.core and router.embed)")
        if (_under(m, "router") and m != "router.local" and _under(t, "broker")
                and not _under(t, "broker.wire")):
            bad.append(f"{where} (the router imports only broker.wire from the broker)")
    for m, line in proj.opens:
        if is_pure(m):
            bad.append(f"{proj.modules[m].relative_to(proj.root)}:{line}: {m} calls open() or uses sys I/O (a pure ring reads no files)")
    for m, line, what in proj.randomness:
        if is_pure(m):
            bad.append(f"{proj.modules[m].relative_to(proj.root)}:{line}: {m} uses {what} "
                       "(a pure ring takes a seeded random.Random)")
    for imp in proj.imports:
        if is_pure(imp.importer) and imp.external == "random" and imp.names:
            bad.append(f"{proj.modules[imp.importer].relative_to(proj.root)}:{imp.lineno}: {imp.importer} takes "
                       f"{', '.join(imp.names)} from random (a pure ring takes a seeded random.Random)")
    return bad


def private_imports(proj: Project) -> list[str]:
    bad = []
    for imp in proj.imports:
        if not imp.target:
            continue
        here = _package(imp.importer, proj.modules)
        there = _package(imp.target, proj.modules)
        if here == there:
            continue
        private_mod = any(p.startswith("_") and not p.startswith("__") for p in imp.target.split("."))
        names = [n for n in imp.names if n.startswith("_") and not n.startswith("__")]
        if private_mod or names:
            bad.append(f"{proj.modules[imp.importer].relative_to(proj.root)}:{imp.lineno}: {imp.importer} takes "
                       f"{', '.join(names) or imp.target} from {imp.target}")
    return bad


def node_attribute_assignments(proj: Project) -> list[str]:
    """Assignments to an attribute of the broker's node from outside ``broker.node``
    (``node.x = …``, ``self.node.x = …``): the node's state is its own; a role or a service
    hands it what it needs through the node's methods (``Node.set_cluster``, ``Node.set_active``,
    ``node.services.register``) or is asked for it (``Node.role``). Items of the node's tables
    (``node.counters[k] += 1``) are not attributes of the node."""
    bad = []
    for mod, path in proj.modules.items():
        if not mod.startswith("broker.") or mod == "broker.node":
            continue
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(n, ast.Assign):
                targets = n.targets
            elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
                targets = [n.target]
            else:
                continue
            for t in targets:
                for x in ast.walk(t):
                    if isinstance(x, ast.Attribute) and _names_the_node(x.value) and x is _direct(t, x):
                        bad.append(f"{path.relative_to(proj.root)}:{n.lineno}: {mod} sets {ast.unparse(x)}")
    return bad


def _names_the_node(v: ast.expr) -> bool:
    return (isinstance(v, ast.Name) and v.id == "node") or (isinstance(v, ast.Attribute) and v.attr == "node")


def _direct(target: ast.expr, x: ast.Attribute):
    """``x`` when it is what the assignment sets (or one of a tuple's targets), not a part of a
    subscript or of a deeper attribute."""
    if target is x:
        return x
    if isinstance(target, (ast.Tuple, ast.List)):
        return x if any(e is x for e in target.elts) else None
    return None


def lazy_imports(proj: Project) -> list[str]:
    """Imports inside functions, but those of an optional dependency: a module in ``OPTIONAL``,
    or one of ours that imports such a module at its top (``spark.transforms``: pyspark)."""
    optional_ours = {i.importer for i in proj.imports if not i.in_function and i.external in OPTIONAL}
    return [f"{proj.modules[i.importer].relative_to(proj.root)}:{i.lineno}: {i.importer} imports "
            f"{i.target or i.external} inside a function"
            for i in proj.imports
            if i.in_function and (i.target not in optional_ours if i.target
                                  else i.external not in OPTIONAL and not _stdlib(i.external))]


def _stdlib(name: str | None) -> bool:
    import sys
    return name in sys.stdlib_module_names


# -- the project ----------------------------------------------------------------------------------

PROJECT = scan()


def test_it_finds_the_modules_itself():
    assert len(PROJECT.modules) > 100
    assert {"broker.node", "router.core.decide", "broker.wire.codec", "router.embed"} <= set(PROJECT.modules)


def test_there_are_no_import_cycles():
    assert cycles(PROJECT) == []


def test_the_rings_hold():
    assert ring_violations(PROJECT) == []


def test_no_private_name_is_imported_across_packages():
    assert private_imports(PROJECT) == []


def test_nothing_outside_the_node_sets_its_attributes():
    assert node_attribute_assignments(PROJECT) == []


def test_project_modules_are_imported_at_the_top():
    assert lazy_imports(PROJECT) == []


# -- the checker can fail: a made-up project with each fault --------------------------------------

def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def toy(tmp_path):
    base = {
        "broker/__init__.py": "", "broker/core/__init__.py": "", "broker/wire/__init__.py": "",
        "broker/wire/io/__init__.py": "", "broker/amqp/__init__.py": "", "router/__init__.py": "",
        "router/core/__init__.py": "",
        "broker/wire/codec.py": "import struct\n",
        "broker/wire/io/http.py": "import trio\nfrom broker.wire import codec\n",
        "broker/amqp/engine.py": "from broker.wire.codec import struct\n",
        "broker/core/queues.py": "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
                                 "if TYPE_CHECKING:\n    from broker.amqp.engine import X\n",
        "router/core/decide.py": "from broker.wire import codec\n",
        "router/embed.py": "from router.core import decide\n",
        "broker/routing.py": "from router import embed\nfrom router.core.decide import decide\n",
    }
    _write(tmp_path, base)
    return tmp_path


def test_a_clean_toy_passes(toy):
    proj = scan(toy, ("broker", "router"))
    assert cycles(proj) == [] and ring_violations(proj) == [] and private_imports(proj) == []
    assert lazy_imports(proj) == []


def test_a_cycle_closed_by_a_lazy_import_fails(toy):
    _write(toy, {"broker/wire/codec.py": "import struct\ndef f():\n    from broker.wire.io import http\n"})
    proj = scan(toy, ("broker", "router"))
    assert ["broker.wire.codec", "broker.wire.io.http"] in cycles(proj)
    assert any("inside a function" in v for v in lazy_imports(proj))
    assert any("pure ring imports only pure" in v for v in ring_violations(proj))


def test_from_package_import_module_is_an_edge_to_the_module(toy):
    _write(toy, {"broker/wire/codec.py": "from broker.amqp import engine\n"})
    proj = scan(toy, ("broker", "router"))
    assert ["broker.amqp.engine", "broker.wire.codec"] in cycles(proj)


def test_a_lazy_import_stays_only_for_an_optional_dependency(toy):
    _write(toy, {"broker/wire/io/plot.py": "import matplotlib\n",
                 "broker/wire/io/http.py": "import trio\ndef f():\n    import pyspark\n"
                                           "    from broker.wire.io import plot\n    import h11\n"})
    bad = lazy_imports(scan(toy, ("broker", "router")))
    assert len(bad) == 1 and "imports h11 inside a function" in bad[0]


def test_type_checking_imports_do_not_count(toy):
    _write(toy, {"broker/wire/codec.py": "from typing import TYPE_CHECKING\n"
                                         "if TYPE_CHECKING:\n    from broker.amqp import engine\n"})
    assert cycles(scan(toy, ("broker", "router"))) == []


@pytest.mark.parametrize("path, text, says", [
    ("broker/core/queues.py", "import time\n", "no I/O, clocks"),
    ("router/core/decide.py", "import random\nx = random.random()\n", "takes a seeded"),
    ("router/core/decide.py", "import random\nr = random.Random()\n", "takes a seeded"),
    ("router/core/decide.py", "from random import shuffle\n", "takes a seeded"),
    ("broker/wire/codec.py", "import socket\n", "no I/O, clocks"),
    ("broker/core/queues.py", "def f():\n    return open('x').read()\n", "calls open()"),
    ("broker/core/queues.py", "import sys\ndef f():\n    sys.stdout.write('x')\n", "calls open()"),
    ("broker/core/queues.py", "from broker.amqp.engine import X\n", "do not know the engine"),
    ("broker/core/queues.py", "import proton\n", "do not know the engine"),
    ("broker/wire/io/http.py", "import trio\nfrom broker.amqp import engine\n", "imports neither program"),
    ("broker/amqp/engine.py", "from broker.node import Node\n", "only as an EngineHost"),
    ("broker/cluster/bridge.py", "from broker.amqp.pn import pn_link_credit\n", "stay in the engine's package"),
    ("broker/routing.py", "from router.net import proxy\n", "only router.core and router.embed"),
    ("router/embed.py", "from broker.amqp.engine import X\n", "only broker.wire"),
])
def test_each_ring_rule_can_fail(toy, path, text, says):
    _write(toy, {"router/net/__init__.py": "", "router/net/proxy.py": "", "broker/node.py": "",
                 "broker/amqp/pn.py": "", "broker/cluster/__init__.py": "", path: text})
    assert any(says in v for v in ring_violations(scan(toy, ("broker", "router"))))


def test_a_private_name_from_another_package_fails(toy):
    _write(toy, {"broker/amqp/engine.py": "_secret = 1\n",
                 "broker/core/queues.py": "from broker.wire.codec import _secret\n",
                 "broker/wire/other.py": "from broker.wire.codec import _secret\n"})
    bad = private_imports(scan(toy, ("broker", "router")))
    assert len(bad) == 1 and "broker.core.queues takes _secret" in bad[0]


def test_setting_a_node_attribute_from_outside_fails(toy):
    _write(toy, {"broker/node.py": "class Node:\n    def __init__(self):\n        self.ha = None\n",
                 "broker/ha/member.py": "def on_node(node, status):\n    node.ha = status\n"
                                        "    node.counters['x'] += 1\n",
                 "broker/cluster/bridge.py": "class C:\n    def f(self):\n        self.node.shared_backup = 1\n"
                                             "        self.node.cluster.x = 2\n"})
    bad = node_attribute_assignments(scan(toy, ("broker", "router")))
    assert len(bad) == 2 and "broker.ha.member sets node.ha" in bad[0] + bad[1]
    assert "broker.cluster.bridge sets self.node.shared_backup" in bad[0] + bad[1]
