/*
 * An ordinary rhea application, driven by the Python tests (tests/e2e/test_clients_rhea.py).
 * argv[2] is JSON: {helper, host, port, username, password, container_id, address,
 * send | receive, max_hops, refusal_backoff_ms, deadline_ms, hold}. The only line that differs with
 * "helper": connect(container, options) instead of container.connect(options).
 * Prints one JSON line: what the application saw. With "hold" the connection then stays open
 * until stdin ends (the test looks at the broker's connection list meanwhile).
 */
'use strict';
const rhea = require('rhea');
const { connect } = require('../lodestone-redirect');

const cfg = JSON.parse(process.argv[2]);
const container = rhea.create_container({ id: cfg.container_id });
const out = { events: [], opened_nodes: [], errors: [], sent: 0, accepted: 0, received: [], hops: null,
              desired_capabilities: null, link_same: true };
const options = { host: cfg.host, port: cfg.port, username: cfg.username, password: cfg.password,
                  container_id: cfg.container_id };
if (cfg.max_hops !== undefined) options.max_hops = cfg.max_hops;
if (cfg.refusal_backoff_ms !== undefined) options.refusal_backoff_ms = cfg.refusal_backoff_ms;
if (!cfg.helper) options.reconnect = false;

const conn = cfg.helper ? connect(container, options) : container.connect(options);
const link = cfg.send ? conn.open_sender(cfg.address) : conn.open_receiver({ source: { address: cfg.address },
                                                                               credit_window: 50 });
let done = false;
function finish() {
    if (done) return;
    done = true;
    clearTimeout(timer);
    out.hops = conn.lodestone_hops || null;
    console.log(JSON.stringify(out));
    const end = () => { conn.close(); setTimeout(() => process.exit(0), 200); };
    if (cfg.hold) {
        process.stdin.on('end', end);
        process.stdin.resume();
    } else {
        end();
    }
}
const timer = setTimeout(() => { out.events.push('deadline'); finish(); }, cfg.deadline_ms || 20000);

container.on('connection_open', (ctx) => {
    out.events.push('opened');
    const props = ctx.connection.properties || {};
    out.opened_nodes.push(props['node-id'] === undefined ? null : props['node-id']);
    out.desired_capabilities = ctx.connection.local.open.desired_capabilities || null;
});
container.on('connection_error', (ctx) => {
    const e = ctx.connection.error || {};
    const l = ctx.connection.lodestone_error;
    out.events.push('error');
    out.errors.push({ condition: e.condition ? String(e.condition) : null, description: e.description || null,
                      lodestone: l ? { name: l.name, message: l.message, hops: l.hops } : null });
    finish();
});
container.on('disconnected', (ctx) => { out.events.push('disconnected'); if (!cfg.helper) finish(); });
container.on('error', (err) => { out.events.push('error-event'); out.errors.push({ condition: err.condition || null,
                                 description: err.description || String(err), lodestone: null }); finish(); });
container.on('sendable', (ctx) => {
    if (ctx.sender !== link) out.link_same = false;
    while (ctx.sender.sendable() && out.sent < cfg.send) {
        ctx.sender.send({ body: `n${out.sent}` });
        out.sent += 1;
    }
});
container.on('accepted', () => {
    out.accepted += 1;
    if (out.accepted === cfg.send) finish();
});
container.on('message', (ctx) => {
    if (ctx.receiver !== link) out.link_same = false;
    out.received.push(ctx.message.body);
    if (out.received.length === cfg.receive) finish();
});
