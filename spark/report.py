"""The job's outputs: summary.json, pins.jsonl, filters.json, report.html and its PNG plots.

Plain files from the collected summary (no Spark here). Formats:

* ``pins.jsonl`` — the router's pinned routes (docs/configuration.md, ``[routers.<name>.pins]``):
  one ``{"key": …, "node_id": …}`` per key of the recommendation, sorted by key.
* ``filters.json`` — the same assignment as one ``local-target-filter`` regex per broker, for a
  router inside each broker: ``{"<node id>": {"name", "local_target_filter", "keys"}}``. The regex
  full-matches exactly that broker's keys (each escaped), so a key arriving at its broker stays.
* ``summary.json`` — every figure; ``report.html`` shows them with three plots. A broker is
  labelled by the name that first served its node id (an HA backup that served it too is named
  beside it, with its share); a key without bytes has no gravity score, shown as ``n/a``; the
  histogram's title and the keys figure count the same keys (docs/gravity.md, "Outputs").
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
    summary["plots"] = plot(out, summary)
    write_summary(out, summary)
    _atomic_write(out / "pins.jsonl", pins_lines(dict(placement.assignment)))
    _atomic_write(out / "filters.json", json.dumps(
        filters(dict(placement.assignment), summary["brokers"], summary["broker_names"]), indent=2) + "\n")
    _atomic_write(out / "report.html", render_html(summary))


def node_names(rows: list[dict[str, Any]]) -> tuple[dict[str, str], dict[str, list[dict[str, Any]]]]:
    """The name each node id is known by, and every name that served it.

    ``rows`` are ``transforms.node_names`` rows (node_id, node, first_ws, records, bytes). An HA
    pair serves one node id under two names: broker-1, its backup broker-1-backup after a
    failover, broker-1 again after failback. The node is named as a user knows it: by the name
    that served it first in the logs (the primary, which started before its backup took over);
    ``served_by`` lists every name in that order with its share of the node's activity bytes (of
    its records when no bytes), so the report can say the backup served part."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_id.setdefault(r["node_id"], []).append(r)
    names: dict[str, str] = {}
    served: dict[str, list[dict[str, Any]]] = {}
    for node_id, rs in by_id.items():
        rs = sorted(rs, key=lambda r: (r["first_ws"] is None, str(r["first_ws"]), r["node"]))
        total_b = sum(int(r["bytes"] or 0) for r in rs)
        total_r = sum(int(r["records"] or 0) for r in rs)
        names[node_id] = rs[0]["node"]
        served[node_id] = [{"name": r["node"],
                            "first_window_start": None if r["first_ws"] is None else str(r["first_ws"]),
                            "records": int(r["records"] or 0), "bytes": int(r["bytes"] or 0),
                            "share": round(int(r["bytes"] or 0) / total_b if total_b
                                           else int(r["records"] or 0) / max(total_r, 1), 6)}
                           for r in rs]
    return names, served


def _share(x: float) -> str:
    return "<1 %" if 0 < x < 0.01 else f"{x:.0%}".replace("%", " %")


def _label(summary: dict, b: str | None, *, short: bool = False) -> str:
    """A broker as a user knows it: ``broker-1 (c687b0e0)``; a node id that other names served
    too (an HA backup after a failover) says so: ``broker-1 (c687b0e0; also served by
    broker-1-backup: 12 % of bytes)``, on two lines in the plots (``short``)."""
    if b is None:
        return "?"
    name = summary["broker_names"].get(b)
    if not name:
        return b[:13]
    others = [s for s in summary.get("broker_served_by", {}).get(b, []) if s["name"] != name]
    if not others:
        return f"{name} ({b[:8]})"
    also = ", ".join(f"{s['name']}: {_share(s['share'])}" for s in others)
    if short:
        return f"{name} ({b[:8]})\n+ {also}"
    return f"{name} ({b[:8]}; also served by {also} of bytes)"


def score_text(score: float | None) -> str:
    """A gravity score as shown: ``0.750``; a key that moved no bytes has none: ``n/a (no bytes)``."""
    return "n/a (no bytes)" if score is None else f"{score:.3f}"


def keys_text(summary: dict[str, Any]) -> str:
    """The keys figure, the same set the histogram's title counts."""
    n, scored = summary["keys"], summary["keys_scored"]
    return f"{n} ({scored} with a gravity score, {n - scored} without bytes: n/a)"


def plot(out: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """The three PNGs: gravity score distribution, bytes-moved matrix, per-broker load before/after.

    Returns what was drawn (``summary["plots"]``): the histogram's title and key counts, and each
    image's size with the bytes-moved colour bar's label box in image pixels (origin top left),
    so a test can check the label is inside the image. Constrained layout keeps every label of
    the figure inside it (``tight_layout`` cut the colour bar's label off)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    info: dict[str, Any] = {}
    scores = [r["gravity_score"] for r in summary["per_key"] if r["gravity_score"] is not None]
    n_keys = len(summary["per_key"])
    title = (f"Gravity scores of {n_keys} keys" if len(scores) == n_keys else
             f"Gravity scores of {n_keys} keys: {len(scores)} plotted, {n_keys - len(scores)} without bytes (n/a)")
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100, layout="constrained")
    ax.hist(scores, bins=[i / 10 for i in range(11)], color="#4477aa", edgecolor="white")
    ax.set_xlabel("gravity score (share of a key's bytes served on its addresses' home broker)")
    ax.set_ylabel("keys")
    ax.set_title(title, fontsize=10)
    fig.savefig(out / PLOTS["gravity"], dpi=100)
    info["gravity"] = {"file": PLOTS["gravity"], "title": title, "keys": n_keys, "keys_plotted": len(scores)}
    plt.close(fig)

    brokers = summary["brokers"]
    labels = [_label(summary, b, short=True) for b in brokers]
    grid = summary["bytes_moved_matrix"]["bytes"]
    fig, ax = plt.subplots(figsize=(6, 5), dpi=100, layout="constrained")
    im = ax.imshow(grid if grid else [[0]], cmap="Oranges")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_xlabel("to")
    ax.set_ylabel("from")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:,}", ha="center", va="center", fontsize=8)
    fig.suptitle(f"Bytes moved between brokers: {summary['cross_broker_bytes']:,}")
    cbar = fig.colorbar(im, ax=ax, label="bytes")
    fig.savefig(out / PLOTS["matrix"], dpi=100)
    fig.canvas.draw()
    w, h = fig.canvas.get_width_height()
    box = cbar.ax.yaxis.label.get_window_extent(fig.canvas.get_renderer())
    info["matrix"] = {"file": PLOTS["matrix"], "size_px": [w, h],
                      "colorbar_label": cbar.ax.get_ylabel(),
                      "colorbar_label_px": [round(box.x0, 1), round(h - box.y1, 1), round(box.x1, 1), round(h - box.y0, 1)]}
    plt.close(fig)

    per = summary["per_broker"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), dpi=100, layout="constrained")
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
        ax.set_xticks(x, labels, rotation=20, ha="right", fontsize=8)
        ax.set_title(f"{what}: skew {summary['skew'][what]:.3f} → {summary['recommended_skew'][what]:.3f}")
        ax.legend(fontsize=8)
    fig.savefig(out / PLOTS["load"], dpi=100)
    info["load"] = {"file": PLOTS["load"]}
    plt.close(fig)
    return info


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
        ["router / key type", f"{summary['router'] or 'n/a (no decisions)'} / {summary['key_type']}"],
        ["keys", keys_text(summary)], ["brokers", len(summary["brokers"])],
        ["gravity score, mean / bytes-weighted (keys with bytes)",
         f"{score_text(summary['gravity_score_mean'])} / {score_text(summary['gravity_score_bytes_weighted'])}"],
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
    moved = [[r["key"], _label(summary, r["current_node_id"]),
              _label(summary, r["recommended_node_id"]), score_text(r["gravity_score"]), f"{r['bytes']:,}"]
             for r in summary["per_key"] if r["moved"]][:200]
    addrs = [[a["address"], _label(summary, a["home_node_id"]), f"{a['produced_bytes']:,}",
              f"{a['consumed_bytes']:,}", f"{a['forwarded_bytes'] + a['redistributed_bytes']:,}"]
             for a in summary["addresses"]][:200]
    files = [[f["file"], f["lines"], f["malformed"], f["unknown_version"]] for f in summary["files"]]
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>Lodestone data gravity</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}} table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left}} img{{max-width:100%}}</style></head><body>
<h1>Data gravity</h1>
{table(figures, ["figure", "value"])}
<h2>Gravity score distribution</h2>
<p>{e(keys_text(summary))}: a key without bytes (it connected but produced and consumed nothing) has no score.</p><img src="{PLOTS['gravity']}" alt="gravity score histogram">
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
