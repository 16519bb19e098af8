"""TOML configuration reading shared by the broker and the router.

Every service turns one TOML file into frozen dataclasses. This module gives them one way to
read a table strictly: unknown keys are rejected, types are checked, and every error names the
file, the dotted key path and the offending value, e.g.

    etc/router.toml: routers.main.pool.quorum-size: 0 must be > 0

The CLI prints that one line and exits with status 2.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

T = TypeVar("T")

_MISSING = object()


class ConfigError(Exception):
    """A configuration file is unusable. ``str(err)`` is the one line an operator reads."""

    def __init__(self, file: str | Path, path: str, message: str):
        self.file = str(file)
        self.path = path
        self.message = message
        super().__init__(f"{self.file}: {path}: {message}" if path else f"{self.file}: {message}")


def load_toml(file: str | Path, data: bytes | None = None) -> dict[str, Any]:
    """Read a TOML file (or ``data``, that file's content read earlier), turning I/O and syntax
    errors into ConfigError."""
    p = Path(file)
    try:
        if data is None:
            data = p.read_bytes()
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(p, "", f"invalid TOML: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except FileNotFoundError:
        raise ConfigError(p, "", "no such file") from None
    except OSError as exc:
        raise ConfigError(p, "", f"cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(p, "", f"invalid TOML: {exc}") from None


@dataclass
class Table:
    """A strict view of one TOML table: every key read is remembered, the rest are typos.

    Call :meth:`done` after reading; it raises for any key that was not read.
    """

    file: Path
    path: str
    data: dict[str, Any]

    def __post_init__(self) -> None:
        if not isinstance(self.data, dict):
            raise ConfigError(self.file, self.path, f"{self.data!r} must be a table")
        self._seen: set[str] = set()

    # -- navigation -------------------------------------------------------------------------
    def key_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str, message: str) -> ConfigError:
        return ConfigError(self.file, self.key_path(key), message)

    def has(self, key: str) -> bool:
        return key in self.data

    def keys(self) -> Iterable[str]:
        return self.data.keys()

    def table(self, key: str, *, required: bool = False) -> "Table":
        self._seen.add(key)
        raw = self.data.get(key, _MISSING)
        if raw is _MISSING:
            if required:
                raise self.error(key, "missing (required table)")
            raw = {}
        if not isinstance(raw, dict):
            raise self.error(key, f"{raw!r} must be a table")
        return Table(self.file, self.key_path(key), raw)

    def tables(self, key: str) -> dict[str, "Table"]:
        """A table of named sub-tables (``[routers.main]``, ``[routers.other]``)."""
        outer = self.table(key)
        out = {}
        for name in list(outer.data):
            out[name] = outer.table(name)
        outer.done()
        return out

    def array_of_tables(self, key: str) -> list["Table"]:
        self._seen.add(key)
        raw = self.data.get(key, [])
        if not isinstance(raw, list):
            raise self.error(key, f"{raw!r} must be an array of tables")
        out = []
        for i, item in enumerate(raw):
            if not isinstance(item, dict):
                raise self.error(f"{key}[{i}]", f"{item!r} must be a table")
            out.append(Table(self.file, f"{self.key_path(key)}[{i}]", item))
        return out

    # -- scalars ----------------------------------------------------------------------------
    def get(self, key: str, kind: type | tuple[type, ...], default: Any = _MISSING) -> Any:
        self._seen.add(key)
        if key not in self.data:
            if default is _MISSING:
                raise self.error(key, "missing (required)")
            return default
        value = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # TOML integers are acceptable where a float is expected; bools are never ints here.
        if float in kinds and int not in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) and bool not in kinds:
            raise self.error(key, f"{value!r} must be {_kind_name(kinds)}")
        if not isinstance(value, kinds):
            raise self.error(key, f"{value!r} must be {_kind_name(kinds)}")
        return value

    def str(self, key: str, default: Any = _MISSING) -> str:
        return self.get(key, str, default)

    def bool(self, key: str, default: Any = _MISSING) -> bool:
        return self.get(key, bool, default)

    def int(self, key: str, default: Any = _MISSING, *, min: int | None = None,
            max: int | None = None) -> int:
        value = self.get(key, int, default)
        if value is None:
            return value
        if min is not None and value < min:
            raise self.error(key, f"{value} must be >= {min}" if min != 1 else f"{value} must be > 0")
        if max is not None and value > max:
            raise self.error(key, f"{value} must be <= {max}")
        return value

    def float(self, key: str, default: Any = _MISSING, *, min: float | None = None) -> float:
        value = self.get(key, float, default)
        if value is not None and min is not None and value < min:
            raise self.error(key, f"{value} must be >= {min}")
        return value

    def choice(self, key: str, choices: Iterable[str], default: Any = _MISSING) -> str:
        choices = tuple(choices)
        value = self.get(key, str, default)
        if value not in choices:
            raise self.error(key, f"{value!r} must be one of {', '.join(choices)}")
        return value

    def str_list(self, key: str, default: Any = _MISSING) -> list[str]:
        value = self.get(key, list, default)
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise self.error(f"{key}[{i}]", f"{item!r} must be a string")
        return list(value)

    def path_value(self, key: str, default: Any = _MISSING) -> Path | None:
        """A file path, relative paths taken from the config file's folder."""
        value = self.get(key, str, default)
        if value is None:
            return None
        p = Path(value)
        return p if p.is_absolute() else (self.file.parent / p)

    def convert(self, key: str, fn: Callable[[Any], T], default: Any = _MISSING) -> T:
        """Read a raw value and convert it; a ValueError from ``fn`` becomes a ConfigError."""
        value = self.get(key, object, default)
        try:
            return fn(value)
        except ValueError as exc:
            raise self.error(key, f"{value!r}: {exc}") from None

    def done(self) -> None:
        """Reject keys nobody read: they are typos, and a typo must not be silently ignored."""
        unknown = [k for k in self.data if k not in self._seen]
        if unknown:
            raise self.error(unknown[0], f"unknown key (value {self.data[unknown[0]]!r})")


def open_config(file: str | Path, data: bytes | None = None) -> Table:
    """Load a TOML file (``data``: its content, already read) and return its root Table."""
    p = Path(file)
    return Table(p, "", load_toml(p, data))


def _kind_name(kinds: tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
             list: "an array", dict: "a table", object: "a value"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)
