"""Strict TOML reading: every error names the file, the key path and the value."""

import pytest

from broker.wire.io.tomlconfig import ConfigError, open_config


def _cfg(tmp_path, text):
    p = tmp_path / "x.toml"
    p.write_text(text)
    return open_config(p), p


def test_reads_values_with_defaults_and_paths(tmp_path):
    root, p = _cfg(tmp_path, 'a = 1\n[t]\nb = "x"\nf = 2\nd = "data"\n')
    assert root.int("a", min=1) == 1
    t = root.table("t")
    assert t.str("b") == "x" and t.float("f") == 2.0 and t.bool("missing", False) is False
    assert t.path_value("d") == tmp_path / "data"
    t.done()
    root.done()


@pytest.mark.parametrize("text, call, message", [
    ("q = 0", lambda r: r.int("q", min=1), "x.toml: q: 0 must be > 0"),
    ("q = true", lambda r: r.int("q"), "x.toml: q: True must be an integer"),
    ("q = 'A'", lambda r: r.choice("q", ["B", "C"]), "x.toml: q: 'A' must be one of B, C"),
    ("[t]\nu = 3", lambda r: r.table("t").done(), "x.toml: t.u: unknown key (value 3)"),
    ("", lambda r: r.str("need"), "x.toml: need: missing (required)"),
    ("l = ['a', 1]", lambda r: r.str_list("l"), "x.toml: l[1]: 1 must be a string"),
    ("[[a]]\nx = 1\n[[a]]\ny = 2", lambda r: [t.done() for t in r.array_of_tables("a")],
     "x.toml: a[0].x: unknown key (value 1)"),
])
def test_errors_name_file_key_and_value(tmp_path, text, call, message):
    root, p = _cfg(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        call(root)
    assert str(err.value) == str(tmp_path / message)


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        open_config(tmp_path / "nope.toml")
    (tmp_path / "bad.toml").write_text("a = [")
    with pytest.raises(ConfigError, match="invalid TOML"):
        open_config(tmp_path / "bad.toml")


def test_an_integer_stays_an_integer_where_either_is_allowed(tmp_path):
    root, _ = _cfg(tmp_path, "m = 2\nf = 2.5")
    assert root.get("m", (str, int, float)) == 2 and isinstance(root.get("m", (str, int, float)), int)
    assert root.get("f", (str, int, float)) == 2.5
