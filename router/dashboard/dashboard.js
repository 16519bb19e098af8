// Lodestone router dashboard: polls GET /api/v1/dashboard once a second and draws it.
// Plain DOM, no library. Every value from the API goes in with textContent (keys, container
// ids and user names are client input).
"use strict";

const PERIOD_MS = 1000;
let previous = null;           // the last snapshot: rates are the difference to it
let busy = new Set();          // targets whose drain/undrain request is in flight

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = String(v);
    else if (k === "onclick") node.addEventListener("click", v);
    else if (k.startsWith("data-")) node.setAttribute(k, String(v));
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat(Infinity)) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function pill(text, cls, title) { return el("span", {class: "pill " + cls, text: text, title: title}); }

function fmt(n, digits) {
  if (n === null || n === undefined || Number.isNaN(n)) return "–";
  return Number(n).toLocaleString(undefined, {maximumFractionDigits: digits === undefined ? 1 : digits});
}

function pct(part, whole) { return whole > 0 ? fmt(100 * part / whole, 1) + " %" : "–"; }

function slot(t) { return t.name || (t.host + ":" + t.port); }
function group(t) { return t.pair || slot(t); }

// a table head; a name starting with # is a number column (right-aligned, as its cells)
function head(names) {
  return el("thead", {}, el("tr", {}, ...names.map((h) => h.startsWith("#") ? el("th", {class: "num", text: h.slice(1)})
                                                                            : el("th", {text: h}))));
}

function clock(t) { return new Date(t * 1000).toLocaleTimeString([], {hour12: false}); }

function sum(obj, names) { return names.reduce((a, n) => a + (obj[n] || 0), 0); }

// -- traffic tiles ------------------------------------------------------------------------
function rates(snap) {
  const tiles = document.getElementById("rates");
  const e = snap.edge;
  const dt = previous ? Math.max(0.001, snap.time - previous.time) : null;
  const per = (name) => dt ? ((e[name] || 0) - (previous.edge[name] || 0)) / dt : null;
  const hits = e.cache_hit || 0, misses = e.cache_miss || 0;
  const dh = previous ? hits - (previous.edge.cache_hit || 0) : 0;
  const dm = previous ? misses - (previous.edge.cache_miss || 0) : 0;
  const active = snap.summary.acceptors.reduce((a, x) => a + (x.active_connections || 0), 0);
  const items = [
    ["decisions/s ok", per("route_ok"), "rate-ok"],
    ["refused/s (unavailable)", per("route_refused_unavailable"), "rate-unavailable"],
    ["refused/s (use another)", per("route_refused_use_another"), "rate-use-another"],
    ["redirected/s", per("redirected"), "rate-redirected"],
    ["proxied/s", per("proxied"), "rate-proxied"],
    ["open client connections", active, "active"],
    ["cache hit rate (last second)", dh + dm > 0 ? pct(dh, dh + dm) : "–", "cache-window"],
    ["cache hit rate (since start)", pct(hits, hits + misses), "cache-total"],
    ["decisions since start", sum(e, ["route_ok", "route_refused_unavailable", "route_refused_use_another"]), "total"],
  ];
  tiles.replaceChildren(...items.map(([label, value, id]) =>
    el("div", {class: "tile", "data-tile": id},
       el("div", {class: "value", text: typeof value === "string" ? value : fmt(value)}),
       el("div", {class: "label", text: label}))));
}

// -- pools ----------------------------------------------------------------------------------
async function targetOp(router, target, op, button) {
  busy.add(router + "/" + target);
  button.disabled = true;
  try {
    const resp = await fetch(`/api/v1/routers/${encodeURIComponent(router)}/targets/${encodeURIComponent(target)}/${op}`,
                             {method: "POST", credentials: "same-origin", headers: {"Accept": "application/json"}});
    if (!resp.ok) {
      let msg = resp.status + " " + resp.statusText;
      try { msg = (await resp.json()).error || msg; } catch (_) { /* not JSON */ }
      showError(`${op} ${target}: ${msg}`);
    } else {
      showError(null);
    }
  } catch (err) {
    showError(`${op} ${target}: ${err}`);
  } finally {
    busy.delete(router + "/" + target);
    poll(true);
  }
}

// a pair member that is not ready while another member of its pair serves: a standby
function standby(t, pool) {
  const p = (pool.pairs || []).find((x) => x.name === t.pair);
  return !t.ready && p !== undefined && p.serving !== null && p.serving !== slot(t);
}

function targetState(t, pool) {
  const out = [];
  if (t.ready) out.push(pill("ready", "ready"));
  else if (standby(t, pool)) out.push(pill("standby", "info", t.last_error || ""));
  else out.push(pill("not ready", "not-ready", t.last_error || ""));
  if (t.held) out.push(pill("held", "held", "held out of routing (allow-failback = false or an operator's hold)"));
  if (t.draining) out.push(pill(pool.drain_fallback ? "draining (serving: nothing else ready)" : "draining",
                                pool.drain_fallback ? "fallback" : "draining"));
  if (t.local) out.push(pill("local", "info"));
  if (t.backup && !standby(t, pool)) out.push(pill("backup", "info"));
  return out;
}

function routerCard(r) {
  const pool = r.pool;
  const facts = el("div", {class: "facts"},
    "key ", el("b", {text: r.key_type || "–"}),
    r.key_filter ? [" · key filter ", el("b", {text: r.key_filter})] : "",
    " · policy ", el("b", {text: r.policy || "none"}),
    r.local_target_filter ? [" · local-target filter ", el("b", {text: r.local_target_filter})] : "");
  const card = el("div", {class: "router", "data-router": r.name}, el("h3", {text: "router " + r.name}), facts);
  if (!pool) {
    card.append(el("div", {class: "note muted", text: "no pool: this router only rejects or accepts locally"}));
    return card;
  }
  const up = pool.targets.filter((t) => t.ready).length;
  const quorum = el("div", {class: "facts", "data-quorum": pool.quorum_met ? "met" : "not-met"},
    "ready ", el("b", {text: `${up} of ${pool.targets.length}`}),
    pool.ready !== up ? [" · taking connections ", el("b", {text: String(pool.ready)})] : "",
    " · quorum ", el("b", {text: String(pool.quorum_size)}), " ",
    pool.quorum_met ? pill("quorum met", "ok") : pill("no quorum", "not-ready"),
    pool.membership ? ` · members from ${pool.membership.source || "a dynamic source"}` +
                      (pool.membership.last_error ? ` (last error: ${pool.membership.last_error})` : "") : "");
  card.append(quorum);
  const draining = new Set(pool.draining || []);
  const rows = pool.targets.map((t) => {
    const g = group(t);
    const name = slot(t);
    const isDraining = draining.has(g) || t.draining;
    const op = isDraining ? "undrain" : "drain";
    const button = el("button", {class: op, "data-op": op, "data-target": name,
                                 disabled: busy.has(r.name + "/" + name) || t.local || t.backup,
                                 title: t.backup ? "a backup is drained with its pair (the primary's button)"
                                      : isDraining ? "let this target take new connections again"
                                                   : "move this target's clients elsewhere at the pool's drain rate",
                                 text: isDraining ? "Undrain" : "Drain"});
    button.addEventListener("click", () => targetOp(r.name, name, op, button));
    return el("tr", {"data-target": name, "data-ready": t.ready ? "true" : "false",
                     "data-draining": isDraining ? "true" : "false", class: t.ready ? "ready" : "not-ready"},
      el("td", {}, el("b", {text: name})),
      el("td", {class: "key", text: t.node_id || "–"}),
      el("td", {text: `${t.host}:${t.port}${t.tls ? " (TLS)" : ""}`}),
      el("td", {text: t.pair ? `${t.pair}${t.backup ? " (backup)" : ""}` : "–"}),
      el("td", {}, ...targetState(t, pool)),
      el("td", {class: "num", text: fmt(t.connection_count, 0)}),
      el("td", {class: "num", text: fmt((r.proxied || {})[g] || 0, 0)}),
      el("td", {class: "err", text: t.ready || standby(t, pool) ? "" : (t.last_error || "")}),
      el("td", {}, button));
  });
  card.append(el("div", {class: "scroll"}, el("table", {class: "targets"},
    head(["target", "node id", "address", "HA pair", "state", "#broker connections", "#proxied here", "last error", ""]),
    el("tbody", {}, ...rows))));
  if (pool.pairs && pool.pairs.length) {
    card.append(el("h3", {text: "HA pairs", class: "sub"}), el("table", {class: "pairs"},
      el("thead", {}, el("tr", {}, ...["pair", "state", "serving", "members", "node id"].map((h) => el("th", {text: h})))),
      el("tbody", {}, ...pool.pairs.map((p) => el("tr", {"data-pair": p.name},
        el("td", {text: p.name}), el("td", {}, pill(p.state.replace("_", " "), p.state)),
        el("td", {text: p.serving || "none"}), el("td", {text: p.members.join(", ")}),
        el("td", {class: "key", text: p.node_id || "–"}))))));
  }
  if (pool.drains && pool.drains.length) {
    card.append(el("h3", {text: "Drains", class: "sub"}), el("table", {class: "drains"},
      head(["target", "phase", "#rate/s", "#left (proxied / on broker)", "#ended here", "#closed on broker", "last error"]),
      el("tbody", {}, ...pool.drains.map((d) => el("tr", {"data-drain": d.target},
        el("td", {text: d.target}), el("td", {}, pill(d.phase, "draining")), el("td", {class: "num", text: fmt(d.rate_per_s)}),
        el("td", {class: "num", text: `${fmt(d.left, 0)} (${fmt(d.proxied_left, 0)} / ${fmt(d.on_broker_left, 0)})`}),
        el("td", {class: "num", text: fmt(d.proxied_ended, 0)}), el("td", {class: "num", text: fmt(d.broker_closed, 0)}),
        el("td", {class: "err", text: d.last_error || ""}))))));
  }
  return card;
}

// -- decisions ------------------------------------------------------------------------------
function keyChain(d) {
  const parts = [d.key_raw, d.key_filtered, d.key_transformed];
  const shown = parts.map((k) => (k === null || k === undefined ? "∅" : k === "" ? '""' : k));
  // collapse steps that changed nothing
  const out = [shown[0]];
  if (parts[1] !== parts[0]) out.push(shown[1]);
  if (parts[2] !== parts[1]) out.push(shown[2]);
  return out.join(" → ");
}

function decisions(snap) {
  const body = document.querySelector("#decisions tbody");
  const list = snap.decisions.slice().reverse();
  if (!list.length) {
    body.replaceChildren(el("tr", {}, el("td", {colspan: 11, class: "muted", text: "no decision yet"})));
    return;
  }
  body.replaceChildren(...list.map((d) => el("tr", {class: d.outcome === "OK" ? "" : "refused", "data-outcome": d.outcome},
    el("td", {text: clock(d.time)}),
    el("td", {text: `${d.router} / ${d.acceptor}`}),
    el("td", {class: "key", text: [d.container_id, d.user, d.client_address].filter((x) => x).join(" · ")}),
    el("td", {class: "key", text: keyChain(d)}),
    el("td", {text: d.cache + (d.cache_tier ? ` (${d.cache_tier})` : "")}),
    el("td", {class: "key", text: d.pin || "–"}),
    el("td", {text: d.policy || "–"}),
    el("td", {}, `${d.ready_targets}/${d.total_targets} ready, need ${d.quorum_size} `,
       d.quorum_met ? pill("met", "ok") : pill("not met", "not-ready")),
    el("td", {text: d.target ? d.target + (d.local ? " (local)" : "") : "–"}),
    el("td", {}, pill(d.outcome === "OK" ? d.action : d.outcome, d.outcome === "OK" ? "ok" : "not-ready")),
    el("td", {class: "why", text: d.reason + (d.waited_s ? ` (waited ${fmt(d.waited_s, 2)} s)` : "")}))));
}

// -- brokers --------------------------------------------------------------------------------
function brokerCard(b) {
  const title = b.name || b.targets.join(", ") || b.management_url;
  const card = el("div", {class: "card" + (b.reachable ? "" : " down"), "data-broker": title},
    el("h3", {}, title, " ", b.reachable ? (b.active ? pill("active", "ok") : pill("passive", "info"))
                                         : pill("unreachable", "not-ready")));
  if (!b.reachable) {
    card.append(el("div", {class: "err note", text: b.error || ""}),
                el("div", {class: "muted note", text: b.management_url}));
    return card;
  }
  const dl = el("dl", {});
  const row = (k, v) => dl.append(el("dt", {text: k}), el("dd", {text: v}));
  row("node id", b.node_id || "–");
  row("pool targets", b.targets.join(", "));
  if (b.ha) row("HA", `${b.ha.policy || "none"} · ${b.ha.role} · ${b.ha.phase}`);
  row("connections", fmt(b.connection_count, 0));
  if (b.cluster) {
    const up = b.cluster.members.filter((m) => m.connected).length;
    row("cluster " + (b.cluster.name || ""), `${b.cluster.members.length} other members, ${up} connected`);
  }
  if (b.queues) row("queues", `${b.queues.count} queues, ${fmt(b.queues.depth, 0)} messages`);
  card.append(dl);
  if (b.cluster && b.cluster.members.length) {
    card.append(el("table", {}, el("thead", {}, el("tr", {}, el("th", {text: "member"}), el("th", {text: "role"}), el("th", {text: "link"}))),
      el("tbody", {}, ...b.cluster.members.map((m) => el("tr", {},
        el("td", {class: "key", text: m.node_id}), el("td", {text: m.role || "member"}),
        el("td", {}, m.connected ? pill("connected", "ok") : pill("down", "not-ready")))))));
  }
  if (b.queues && b.queues.top.length) {
    card.append(el("table", {}, head(["queue", "#depth", "#consumers"]),
      el("tbody", {}, ...b.queues.top.map((q) => el("tr", {},
        el("td", {class: "key", text: q.name}), el("td", {class: "num", text: fmt(q.depth, 0)}),
        el("td", {class: "num", text: fmt(q.consumers, 0)}))))));
  }
  if (b.broker_connections && b.broker_connections.length) {
    card.append(el("table", {}, el("thead", {}, el("tr", {}, el("th", {text: "broker connection"}), el("th", {text: "state"}))),
      el("tbody", {}, ...b.broker_connections.map((c) => el("tr", {},
        el("td", {text: `${c.name} → ${c.uri}`}), el("td", {}, pill(c.state, c.state === "connected" ? "ok" : "not-ready")))))));
  }
  if (b.error) card.append(el("div", {class: "err note", text: b.error}));
  return card;
}

// -- the loop -------------------------------------------------------------------------------
function showError(text) {
  const box = document.getElementById("error");
  box.hidden = !text;
  box.textContent = text || "";
}

function draw(snap) {
  document.getElementById("router-name").textContent = snap.name;
  const status = document.getElementById("status");
  status.textContent = snap.status;
  status.className = "pill " + (snap.status === "draining" ? "draining-status" : snap.status);
  status.title = (snap.degraded || []).map((f) => `${f.component}${f.worker !== undefined ? " (worker " + f.worker + ")" : ""}: ${f.error}`).join("\n");
  document.getElementById("updated").textContent =
    `updated ${clock(snap.time)} · ${snap.summary.workers} worker${snap.summary.workers === 1 ? "" : "s"}`;
  rates(snap);
  document.getElementById("routers").replaceChildren(...snap.routers.map(routerCard));
  decisions(snap);
  const cluster = document.getElementById("cluster");
  cluster.replaceChildren(...(snap.cluster.length ? snap.cluster.map(brokerCard)
    : [el("div", {class: "muted", text: "no pool target has a management URL"})]));
  document.body.setAttribute("data-updated", String(snap.time));
}

let timer = null;
let failedPolls = 0;

async function poll(once) {
  if (timer !== null && !once) { clearTimeout(timer); timer = null; }
  try {
    const resp = await fetch("/api/v1/dashboard", {credentials: "same-origin", headers: {"Accept": "application/json"}});
    if (!resp.ok) throw new Error(`GET /api/v1/dashboard: ${resp.status} ${resp.statusText}`);
    const snap = await resp.json();
    draw(snap);
    previous = snap;
    if (failedPolls) showError(null);
    failedPolls = 0;
  } catch (err) {
    failedPolls += 1;
    showError(`the router does not answer (${failedPolls} tries): ${err.message || err}`);
  }
  if (!once) timer = setTimeout(poll, PERIOD_MS);
}

document.addEventListener("DOMContentLoaded", () => poll(false));
