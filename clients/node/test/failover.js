/*
 * A rhea requester with lodestone-redirect.js, driven by tests/integration/test_client_failover.py.
 * argv[2] is JSON: {host, port, username, password, mode, options, deadline_ms}; options are the
 * helper's failover options (reconnectAttempts, retryInterval, ...).
 *
 * mode "request-reply": a dynamic receiver (a temporary queue), 5 non-durable and 3 durable
 * messages to "notes", a durable request "q1" to "requests" with reply_to = the temporary queue;
 * on its reply prints {"phase": "ready"} (the test then kills the primary). After the failover
 * event it sends "q2" with reply_to = the *old* address (the helper sends it with the new one),
 * and prints what it saw once the reply comes.
 * mode "attempts": one durable message; once accepted prints {"phase": "ready"} (the test kills
 * the broker), then prints what it saw once rhea says no reconnect is scheduled.
 */
'use strict';
const rhea = require('rhea');
const { connect } = require('../lodestone-redirect');

const cfg = JSON.parse(process.argv[2]);
const container = rhea.create_container({ id: `failover-${process.pid}` });
const out = { events: [], replies: [], temp1: null, temp2: null, rhea_disconnected: [] };
const conn = connect(container, Object.assign({ host: cfg.host, port: cfg.port, username: cfg.username,
                                                password: cfg.password }, cfg.options || {}));
const print = (o) => console.log(JSON.stringify(o));
function finish() {
    clearTimeout(timer);
    print(out);
    conn.close();
    setTimeout(() => process.exit(0), 200);
}
const timer = setTimeout(() => { out.deadline = true; finish(); }, cfg.deadline_ms || 30000);
const record = (e) => out.events.push({ type: e.type, tries: e.tries, url: e.url,
                                        lost: e.lost ? { name: e.lost.name, count: e.lost.count,
                                                         message: e.lost.message } : null,
                                        temporary_queues: e.temporary_queues, broker: e.broker,
                                        error: e.error ? { name: e.error.name, tries: e.error.tries,
                                                           message: e.error.message } : null });
conn.lodestone_events.on('failover', record);
conn.lodestone_events.on('reconnected', record);
conn.lodestone_events.on('disconnect', record);
container.on('disconnected', (ctx) => {
    out.rhea_disconnected.push(!!ctx.reconnecting);
    if (cfg.mode === 'attempts' && !ctx.reconnecting) finish();
});
container.on('error', (e) => { out.error = String(e); });

if (cfg.mode === 'attempts') {
    const snd = conn.open_sender('attempts');
    let sent = false;
    snd.on('sendable', () => { if (!sent) { sent = true; snd.send({ body: 'before', durable: true }); } });
    snd.on('accepted', () => print({ phase: 'ready' }));
} else {
    const replies = conn.open_receiver({ source: { dynamic: true } });
    const requests = conn.open_sender('requests');
    const notes = conn.open_sender('notes');
    let started = false, accepted = 0;
    replies.on('receiver_open', () => {
        if (out.temp1 === null) out.temp1 = replies.source.address;
        maybeStart();
    });
    function maybeStart() {
        if (started || out.temp1 === null || !requests.sendable() || !notes.sendable()) return;
        started = true;
        for (let i = 0; i < 5; i++) notes.send({ body: `nd${i}` });                  // non-durable
        for (let i = 0; i < 3; i++) notes.send({ body: `d${i}`, durable: true });
        requests.send({ body: 'q1', reply_to: out.temp1, correlation_id: 'c1', durable: true });
    }
    requests.on('sendable', maybeStart);
    notes.on('sendable', maybeStart);
    let q1Accepted = false, q1Answered = false, ready = false;
    const maybeReady = () => {   // everything the primary holds is confirmed: the test may kill it
        if (ready || !q1Accepted || !q1Answered || accepted < 8) return;
        ready = true;
        out.notes_accepted = accepted;
        print({ phase: 'ready' });
    };
    notes.on('accepted', () => { accepted += 1; maybeReady(); });
    requests.on('accepted', () => { q1Accepted = true; maybeReady(); });
    replies.on('message', (ctx) => {
        const m = ctx.message;
        out.replies.push({ body: m.body, correlation_id: m.correlation_id });
        if (m.correlation_id === 'c1' && out.replies.length === 1) {
            q1Answered = true;
            maybeReady();
        } else if (m.correlation_id === 'c2') {
            out.temp2 = replies.source.address;
            finish();
        }
    });
    conn.lodestone_events.on('failover', () => {
        const go = () => requests.send({ body: 'q2', reply_to: out.temp1, correlation_id: 'c2', durable: true });
        if (requests.sendable()) go(); else requests.once('sendable', go);
    });
}
