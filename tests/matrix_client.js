/*
 * rhea client programs of the failover matrix (tests/integration/test_failover_matrix.py; the
 * Python ones and the JSON lines they print: tests/matrix_clients.py).
 *
 *     node tests/matrix_client.js '{"kind": "rhea" | "rhea-helper", "role": "producer" | "consumer",
 *                                   "host", "port", "address", "container_id", "interval_ms"}'
 *
 * "rhea": an ordinary rhea application, rhea's default reconnect (container.connect(options)).
 * rhea drops the unsettled sends of a lost connection without an event, so those simply never
 * get an outcome (they are not counted as acknowledged).
 * "rhea-helper": the same application on clients/node/lodestone-redirect.js (connect(container,
 * options), the one-line change), stamping every message with Artemis's duplicate id
 * _AMQ_DUPL_ID (<address>-<i>) and sending the sends that had no outcome when the connection was
 * lost again after the reconnect — the broker drops a copy it already stored.
 * A producer sends durable message i = 0, 1, … (application property i) every interval_ms; a
 * consumer accepts every message (rhea's autoaccept). SIGTERM stops: a producer waits up to 3 s
 * for outstanding outcomes, then prints {"k": "done", …} and exits.
 */
'use strict';
const path = require('path');
const rhea = require(path.join(__dirname, '..', 'clients', 'node', 'node_modules', 'rhea'));
const { connect } = require(path.join(__dirname, '..', 'clients', 'node', 'lodestone-redirect'));

const cfg = JSON.parse(process.argv[2]);
const helper = cfg.kind === 'rhea-helper';
const producer = cfg.role === 'producer';
const emit = (k, fields) => process.stdout.write(JSON.stringify(Object.assign({ k, t: Date.now() / 1000 }, fields || {})) + '\n');

const container = rhea.create_container({ id: cfg.container_id });
const options = { host: cfg.host, port: cfg.port, username: cfg.user || 'app', password: cfg.password || 'app',
                  container_id: cfg.container_id };
emit('start', { kind: cfg.kind, role: cfg.role, pid: process.pid });
const conn = helper ? connect(container, options) : container.connect(options);
const link = producer ? conn.open_sender(cfg.address)
                      : conn.open_receiver({ source: { address: cfg.address }, credit_window: 10 });

let gen = 0, next = 0, acked = 0, resent = 0, stopping = false;
const unsettled = new Map();     // i -> delivery (the current connection's)
const resend = [];               // helper: i whose send had no outcome when the connection was lost

container.on('connection_open', () => { gen += 1; emit('open', { g: gen }); });
container.on('disconnected', (ctx) => {
    emit('lost', { why: `disconnected (${ctx.error ? String(ctx.error.message || ctx.error) : 'closed'})`.slice(0, 200) });
    if (helper) for (const i of unsettled.keys()) resend.push(i);
    unsettled.clear();
});
container.on('connection_error', (ctx) => {
    const e = ctx.connection.error || {};
    emit('lost', { why: `connection error ${e.condition} ${e.description || ''}`.slice(0, 200) });
});
container.on('error', (err) => emit('lost', { why: `error ${String(err && err.message || err)}`.slice(0, 200) }));

function message(i) {
    const props = { i };
    if (helper) props._AMQ_DUPL_ID = `${cfg.address}-${i}`;
    return { body: `${cfg.address}-${i}`, durable: true, application_properties: props };
}

function tick() {
    if (stopping || !link.sendable()) return;
    if (resend.length) resent += 1;
    const i = resend.length ? resend.shift() : next++;
    const d = link.send(message(i));
    d.matrix_i = i;
    unsettled.set(i, d);
}
container.on('accepted', (ctx) => {
    const i = ctx.delivery.matrix_i;
    if (i === undefined || !unsettled.has(i)) return;
    unsettled.delete(i);
    acked += 1;
    emit('ack', { i });
});
container.on('message', (ctx) => emit('recv', { i: ctx.message.application_properties.i, g: gen }));

const timer = producer ? setInterval(tick, cfg.interval_ms || 50) : null;
const alive = setInterval(() => {}, 1000);   // stay up after a fatal connection error, until SIGTERM

process.on('SIGTERM', () => {
    stopping = true;
    const deadline = Date.now() + (producer ? 3000 : 0);
    const finish = () => {
        if (unsettled.size && Date.now() < deadline) { setTimeout(finish, 20); return; }
        if (timer) clearInterval(timer);
        clearInterval(alive);
        emit('done', { acked, sent: next, generations: gen, resent });
        conn.close();
        setTimeout(() => process.exit(0), 100);
    };
    finish();
});
