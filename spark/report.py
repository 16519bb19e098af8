"""The job's outputs: summary.json, pins.jsonl, filters.json, report.html and its PNG plots.

Plain files from the collected summary (no Spark here). Formats:

* ``pins.jsonl`` — the router's pinned routes (docs/configuration.md, ``[routers.<name>.pins]``):
  one ``{"key": …, "node_id": …}`` per key of the recommendation, sorted by key.
* ``filters.json`` — the same assignment as one ``local-target-filter`` regex per broker, for a
  router inside each broker: ``{"<node id>": {"name", "local_target_filter", "keys"}}``. The regex
  full-matches exactly that broker's keys (each escaped), so a key arriving at its broker stays.
* ``summary.json`` — every figure; ``report.html`` shows them with three plots.
"""

from __future__ import annotations

import html
import json
import os
import re
from pathlib import Path
from typing import Any

PLOTS = {"gravity": "gravity_scores.png", "matrix": "bytes_moved.png", "load": "broker_load.png"}


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def pins_lines(assignment: dict[str, str]) -> str:
    return "".join(json.dumps({"key": k, "node_id": assignment[k]}, ensure_ascii=False) + "\n"
                   for k in sorted(assignment))


def local_target_filter(keys: list[str]) -> str | None:
    """A regex that full-matches exactly ``keys`` (None for no key)."""
    if not keys:
        return None
    return "^(?:" + "|".join(re.escape(k) for k in sorted(keys)) + ")$"


def filters(assignment: dict[str, str], brokers: list[str], names: dict[str, str | None]) -> dict[str, Any]:
    out = {}
    for b in brokers:
        keys = sorted(k for k, n in assignment.items() if n == b)
        out[b] = {"name": names.get(b), "local_target_filter": local_target_filter(keys), "keys": keys}
    return out


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    _atomic_write(Path(out) / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")


def write_outputs(out: Path, summary: dict[str, Any], placement) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_summary(out, summary)
    _atomic_write(out / "pins.jsonl", pins_lines(dict(placement.assignment)))
    _atomic_write(out / "filters.json", json.dumps(
        filters(dict(placement.assignment), summary["brokers"], summary["broker_names"]), indent=2) + "\n")
    plot(out, summary)
    _atomic_write(out / "report.html", render_html(summary))


def _label(summary: dict, b: str) -> str:
    name = summary["broker_names"].get(b)
    return f"{name} ({b[:8]})" if name else b[:13]


def plot(out: Path, summary: dict[str, Any]) -> None:
    """The three PNGs: gravity score distribution, bytes-moved matrix, per-broker load before/after."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores = [r["gravity_score"] for r in summary["per_key"] if r["gravity_score"] is not None]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(scores, bins=[i / 10 for i in range(11)], color="#4477aa", edgecolor="white")
    ax.set_xlabel("gravity score (share of a key's bytes served on its addresses' home broker)")
    ax.set_ylabel("keys")
    ax.set_title(f"Gravity scores of {len(scores)} keys")
    fig.tight_layout()
    fig.savefig(out / PLOTS["gravity"], dpi=100)
    plt.close(fig)

    brokers = summary["brokers"]
    labels = [_label(summary, b) for b in brokers]
    grid = summary["bytes_moved_matrix"]["bytes"]
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    im = ax.imshow(grid if grid else [[0]], cmap="Oranges")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("to")
    ax.set_ylabel("from")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:,}", ha="center", va="center", fontsize=8)
    fig.suptitle(f"Bytes moved between brokers: {summary['cross_broker_bytes']:,}")
    fig.colorbar(im, ax=ax, label="bytes")
    fig.tight_layout()
    fig.savefig(out / PLOTS["matrix"], dpi=100)
    plt.close(fig)

    per = summary["per_broker"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, what in zip(axes, ("connections", "bytes")):
        before = [p[what] for p in per]
        after = [p[f"recommended_{what}"] for p in per]
        x = list(range(len(per)))
        ax.bar([i - 0.2 for i in x], before, 0.4, label="today", color="#aaaaaa")
        ax.bar([i + 0.2 for i in x], after, 0.4, label="recommended", color="#228833")
        if per:
            mean = sum(before) / len(per)
            ax.axhline(mean * (1 + summary["max_skew"]), color="#cc3311", linestyle="--", linewidth=1,
                       label=f"bound (mean × {1 + summary['max_skew']:.2f})")
        ax.set_xticks(x, labels, rotation=20, ha="right")
        ax.set_title(f"{what}: skew {summary['skew'][what]:.3f} → {summary['recommended_skew'][what]:.3f}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / PLOTS["load"], dpi=100)
    plt.close(fig)


def headline(summary: dict[str, Any]) -> str:
    s, r = summary["skew"], summary["recommended_skew"]
    return (f"cross-broker bytes {summary['cross_broker_bytes']:,} measured "
            f"(model {summary['modelled_cross_broker_bytes']:,.0f}) → recommended {summary['recommended_cross_broker_bytes']:,.0f}; "
            f"skew connections {s['connections']:.3f} → {r['connections']:.3f}, bytes {s['bytes']:.3f} → {r['bytes']:.3f} "
            f"(bound {summary['max_skew']:g}); {summary['keys_moved']} of {summary['keys']} keys move")


def render_html(summary: dict[str, Any]) -> str:
    e = html.escape

    def table(rows: list[list[Any]], head: list[str]) -> str:
        th = "".join(f"<th>{e(h)}</th>" for h in head)
        body = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in rows)
        return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"

    figures = [
        ["lines read", f"{summary['lines_read']:,}"], ["lines set aside", f"{summary['lines_malformed']:,}"],
        ["router / key type", f"{summary['router']} / {summary['key_type']}"],
        ["keys", summary["keys"]], ["brokers", len(summary["brokers"])],
        ["cross-broker bytes (measured)", f"{summary['cross_broker_bytes']:,}"],
        ["cross-broker bytes (model, today)", f"{summary['modelled_cross_broker_bytes']:,.0f}"],
        ["cross-broker bytes (model, recommended)", f"{summary['recommended_cross_broker_bytes']:,.0f}"],
        ["skew connections / bytes (today)", f"{summary['skew']['connections']:.3f} / {summary['skew']['bytes']:.3f}"],
        ["skew connections / bytes (recommended)",
         f"{summary['recommended_skew']['connections']:.3f} / {summary['recommended_skew']['bytes']:.3f}"],
        ["balance bound (--max-skew)", summary["max_skew"]],
        ["recommendation within bound", summary["recommended_within_bound"]],
        ["keys that move", summary["keys_moved"]], ["stickiness", summary["stickiness"]],
    ]
    brokers = [[_label(summary, p["node_id"]), p["connections"], f"{p['bytes']:,}", p["recommended_connections"],
                f"{p['recommended_bytes']:,}"] for p in summary["per_broker"]]
    moved = [[r["key"], _label(summary, r["current_node_id"] or "?"),
              _label(summary, r["recommended_node_id"] or "?"), r["gravity_score"], f"{r['bytes']:,}"]
             for r in summary["per_key"] if r["moved"]][:200]
    addrs = [[a["address"], _label(summary, a["home_node_id"] or "?"), f"{a['produced_bytes']:,}",
              f"{a['consumed_bytes']:,}", f"{a['forwarded_bytes'] + a['redistributed_bytes']:,}"]
             for a in summary["addresses"]][:200]
    files = [[f["file"], f["lines"], f["malformed"], f["unknown_version"]] for f in summary["files"]]
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Lodestone data gravity</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}} table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left}} img{{max-width:100%}}</style></head><body>
<h1>Data gravity</h1>
{table(figures, ["figure", "value"])}
<h2>Gravity score distribution</h2><img src="{PLOTS['gravity']}" alt="gravity score histogram">
<h2>Bytes moved between brokers</h2><img src="{PLOTS['matrix']}" alt="bytes moved matrix">
<h2>Load per broker, today and recommended</h2><img src="{PLOTS['load']}" alt="load per broker">
{table(brokers, ["broker", "connections", "bytes", "recommended connections", "recommended bytes"])}
<h2>Keys that move ({summary['keys_moved']})</h2>
{table(moved, ["key", "routed to today", "recommended", "gravity score", "bytes"])}
<h2>Addresses</h2>
{table(addrs, ["address", "home broker", "produced bytes", "consumed bytes", "moved between brokers"])}
<h2>Input files</h2>
{table(files, ["file", "lines", "set aside", "unknown version"])}
</body></html>
"""
