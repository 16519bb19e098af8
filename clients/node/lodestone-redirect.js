/*
 * Follow AMQP 1.0 redirects (amqp:connection:redirect) with rhea, as Lodestone's router and
 * Artemis connection routers send them. One line in an ordinary rhea application:
 *
 *     const rhea = require('rhea');
 *     const { connect } = require('./lodestone-redirect');
 *     const conn = connect(rhea, { host: 'router.example', port: 5672, username: 'app', password: 'app',
 *                                  container_id: 'orders-1' });      // instead of rhea.connect({...})
 *     conn.open_sender('orders');                                       // links as usual
 *     rhea.on('sendable', (context) => { ... });
 *
 * Theory of operation. A router in redirect mode answers the client's Open with an Open whose
 * properties carry amqp:connection-establishment-failed = true, then a Close: either
 * amqp:connection:redirect with info {network-host, port}, or amqp:connection:forced
 * ("Connection router <r> is not ready (...)" — transient — or "... rejected this connection").
 * rhea treats the redirect as fatal and reports the router's Open as connection_open. This
 * module wraps one rhea Connection: from the failed Open until a real Open arrives, the
 * application sees no event at all (no connection_open, no connection_error, no disconnected);
 * the redirect target (or, for "not ready", the front door after a back-off) is fed to rhea's
 * own reconnect machinery (options.connection_details / options.reconnect), which re-attaches
 * every session and link the application opened, with their options, on the new connection.
 * The rules are those of the Python helpers (router/client/hops.py): at most max_hops
 * redirects per journey, a hop back to a (host, port) already visited is a loop, a "not ready"
 * router is retried after each delay of refusal_backoff_ms, "rejected" is final. When the
 * journey fails the application gets connection_error (and connection_close) with the router's
 * condition, a description that says why (loop, too many hops, gave up after N attempts) and
 * connection.lodestone_error (an Error with .hops). A later disconnection from the broker
 * reconnects through the front door, following redirects again. A broker that closes an open
 * connection with amqp:connection:redirect (failback, scale-down, its management close: it names
 * the node that now serves the data) starts a reconnection whose first address is the one named.
 *
 * Failover (docs/clients.md, "Failover"): the addresses a lost connection is tried again at are
 * the one that opened last, the front door, then every backup a broker named in its Open's
 * failover-server-list. A *try* is one pass over them; the first is made at once, then
 * reconnectAttempts more (-1: no limit), retryInterval ms before the second, each next wait
 * retryIntervalMultiplier times the last, at most maxRetryInterval ms; initialConnectAttempts
 * counts the same way for the first connection (Artemis's URL parameter names; Artemis counts
 * differently: its reconnectAttempts = N is N tries in all). Without these options rhea's own reconnect options
 * (reconnect, initial_reconnect_delay, max_reconnect_delay, reconnect_limit) space the tries, as
 * before. connection.lodestone_events (an EventEmitter) emits, after a lost connection:
 * 'failover' (another broker process: a backup, a restarted one), 'reconnected' (the same
 * process: same node-id and started-ms in its Open) — each once the connection is open again
 * and every dynamic receiver (temporary queue) has been attached again, under a new address —
 * and 'disconnect' when it gave up. The event: {type: 'FAILOVER' | 'RECONNECTED' |
 * 'DISCONNECT', url, tries, lost, temporary_queues: {old: new}, broker: {node_id, started_ms},
 * error}. lost is a NonDurableLost (count: the non-durable messages senders opened with
 * connection.open_sender saw accepted by the old process — up to that many are gone, as only
 * durable messages reach a backup) or null. A message sent by such a sender with reply_to naming
 * an old address of a re-created temporary queue goes with the new one.
 *
 * The Open announces the desired capability 'lodestone:follows-redirect'.
 */
'use strict';

const { EventEmitter } = require('events');
const net = require('net');
const tls = require('tls');

const FOLLOWS_REDIRECT = 'lodestone:follows-redirect';
const REDIRECT = 'amqp:connection:redirect';
const FORCED = 'amqp:connection:forced';
const ESTABLISHMENT_FAILED = 'amqp:connection-establishment-failed';
const DEFAULT_REFUSAL_BACKOFF_MS = [250, 500, 1000];

function lookup(map, key) {
    if (!map) return undefined;
    if (map instanceof Map) {
        for (const [k, v] of map) if (String(k) === key) return v;
        return undefined;
    }
    return map[key];
}

function userReconnectPolicy(options) {
    // rhea's default: 100 ms doubling up to 60 s, reconnect_limit attempts (unbounded if unset)
    if (options.reconnect === false) return () => -1;
    if (typeof options.reconnect === 'function') return options.reconnect;
    const fixed = typeof options.reconnect === 'number' ? options.reconnect : undefined;
    const initial = options.initial_reconnect_delay || 100;
    const max = options.max_reconnect_delay || 60000;
    const limit = options.reconnect_limit;
    let delay = initial, tries = 0, reset;
    return function (successful) {
        if (reset !== successful) { delay = initial; tries = 0; reset = successful; }
        if (limit !== undefined && tries++ >= limit) return -1;
        if (fixed !== undefined) return fixed;
        const current = delay;
        delay = Math.min(max, delay * 2);
        return current;
    };
}

/** Up to `count` non-durable messages accepted by the broker process `old` were lost. */
class NonDurableLost extends Error {
    constructor(count, old, now, reason) {
        super(`up to ${count} non-durable message${count === 1 ? '' : 's'} accepted by broker ${ident(old)} before ` +
              `the failover to ${ident(now)} ${count === 1 ? 'was' : 'were'} lost (${reason}; only durable messages ` +
              'survive a failover)');
        this.name = 'NonDurableLost';
        this.count = count;
        this.old = old;
        this.now = now;
        this.reason = reason;
    }
}

function ident(b) {
    return `${b.node_id || '?'}${b.started_ms !== null && b.started_ms !== undefined ? '@' + b.started_ms : ''}`;
}

/** The broker process an Open came from: {node_id, started_ms} (started_ms only for a cluster node). */
function identity(props) {
    const node = lookup(props, 'node-id');
    const started = Number(lookup(props, 'started-ms'));
    return { node_id: node === undefined || node === null ? null : String(node),
             started_ms: Number.isInteger(started) ? started : null };
}

/** [same process?, why] — the same only with the same node id and the same start time. */
function sameProcess(a, b) {
    if (!a.node_id || !b.node_id) return [false, 'the broker names no node id'];
    if (a.node_id !== b.node_id) return [false, `node id ${a.node_id} -> ${b.node_id}`];
    if (a.started_ms === null || b.started_ms === null) {
        return [false, 'the broker does not say when its process started (no started-ms), so a restart cannot ' +
                       'be ruled out'];
    }
    if (a.started_ms !== b.started_ms) {
        return [false, `same node id, another process (started-ms ${a.started_ms} -> ${b.started_ms})`];
    }
    return [true, 'same node id and process'];
}

/** Tries and waits (Artemis's names; see the module doc). */
function schedule(options, attemptsName) {
    const given = ['reconnectAttempts', 'initialConnectAttempts', 'retryInterval', 'retryIntervalMultiplier',
                   'maxRetryInterval'].some((k) => options[k] !== undefined);
    if (!given) return null;
    const attempts = options[attemptsName] === undefined ? -1 : options[attemptsName];
    const interval = options.retryInterval === undefined ? 100 : options.retryInterval;
    const multiplier = options.retryIntervalMultiplier === undefined ? 2 : options.retryIntervalMultiplier;
    const max = options.maxRetryInterval === undefined ? 60000 : options.maxRetryInterval;
    if (!Number.isInteger(attempts) || attempts < -1 || interval < 0 || max < 0 || multiplier < 1) {
        throw new RangeError(`${attemptsName}: -1 or >= 0; retryInterval, maxRetryInterval >= 0; ` +
                             'retryIntervalMultiplier >= 1');
    }
    let wait = interval;
    return {
        mayTryAgain: (tries) => attempts < 0 || tries <= attempts,
        next: () => { const w = wait; wait = Math.min(wait * multiplier, max); return w; },
        reset: () => { wait = interval; },
    };
}

class RedirectError extends Error {
    constructor(name, message, hops) {
        super(`${message} (hops: ${hops.join(' -> ')})`);
        this.name = name;
        this.hops = hops;
    }
}

/**
 * container.connect(options) that follows redirects and fails over. Extra options: max_hops (5),
 * refusal_backoff_ms ([250, 500, 1000]); reconnectAttempts, initialConnectAttempts, retryInterval
 * (ms), retryIntervalMultiplier, maxRetryInterval (ms) — see the module doc. Returns the rhea
 * Connection; after the first real Open, connection.lodestone_hops lists the "host:port" visited;
 * connection.lodestone_events emits 'failover', 'reconnected' and 'disconnect'.
 */
function connect(container, options) {
    const maxHops = options.max_hops === undefined ? 5 : options.max_hops;
    const backoff = options.refusal_backoff_ms || DEFAULT_REFUSAL_BACKOFF_MS;
    const front = { host: options.host || 'localhost', port: options.port || 5672 };
    const frontKey = `${front.host}:${front.port}`;
    const caps = [].concat(options.desired_capabilities || []);
    if (caps.indexOf(FOLLOWS_REDIRECT) < 0) caps.push(FOLLOWS_REDIRECT);
    const policy = userReconnectPolicy(options);
    const initialSchedule = schedule(options, 'initialConnectAttempts');
    const reconnectSchedule = schedule(options, 'reconnectAttempts');
    const events = new EventEmitter();
    const st = {
        between: false,       // inside the router's failed connection / on the way to the next hop
        next: null,           // the next hop's {host, port}, consumed by connection_details
        delay: null,          // delay before that hop (ms), consumed by reconnect
        decision: null,       // 'go' | 'give-up' while rhea handles the Close
        hops: [frontKey],
        visited: new Set([frontKey]),
        refusals: 0,
    };
    // failover: where a lost connection is tried again, and what the broker process held
    const fo = {
        learned: [],          // {host, port} from failover-server-list
        good: front,          // the address whose journey opened last
        start: front,         // the address the current journey started at
        opened: false,        // the connection is open (a loss starts a reconnection)
        everOpened: false,
        pass: [front],        // the current try's addresses, and where in them we are
        index: 0,
        tries: 1,             // the initial connection's first try is under way
        lossCause: null,      // set while reconnecting after a loss
        broker: null,         // identity of the process we are connected to
        nonDurable: 0,        // non-durable messages it accepted from our senders
        temps: new Map(),     // dynamic receiver -> its address before the loss
        renamed: {},          // every old temporary address -> its current one
        redirectedTo: null,   // {host, port} an open connection was redirected to: tried first
    };
    const restart = (start) => {
        const key = `${start.host}:${start.port}`;
        st.hops = [key];
        st.visited = new Set([key]);
    };
    const candidates = () => {
        const out = [];
        for (const a of [fo.good, front].concat(fo.learned)) {
            if (!out.some((b) => b.host === a.host && b.port === a.port)) out.push(a);
        }
        return out;
    };

    const opts = Object.assign({}, options, { desired_capabilities: caps });
    opts.connection_details = function () {
        let target = st.next;
        st.next = null;
        if (!target) {   // a new journey: the next address of the current try
            target = fo.pass[fo.index] || front;
            fo.start = target;
            restart(target);
        } else if (target === front) {   // the front door again after a "not ready": a new journey
            fo.start = front;
            restart(front);
        }
        const o = Object.assign({}, opts, { host: target.host, port: target.port });
        if (target !== front && (opts.transport === 'tls' || opts.transport === 'ssl') && !options.servername) {
            o.servername = target.host;
        }
        const useTls = o.transport === 'tls' || o.transport === 'ssl';
        return { connect: options.connect || (useTls ? tls.connect : net.connect), host: target.host,
                 port: target.port, options: o };
    };
    opts.reconnect = function (successful) {
        if (st.delay !== null) { const d = st.delay; st.delay = null; return d; }
        return nextTry(successful);
    };

    function giveUp() {
        const error = new Error(`gave up after ${fo.tries} tries (${candidates().map(
            (a) => `${a.host}:${a.port}`).join(', ')})`);
        error.name = 'FailoverError';
        error.tries = fo.tries;
        emit('disconnect', { type: 'DISCONNECT', url: null, tries: fo.tries, lost: null, temporary_queues: {},
                             broker: null, cause: fo.lossCause, error, initial: !fo.everOpened });
        return -1;
    }

    function nextTry(successful) {
        if (fo.opened) {   // the connection was lost: a reconnection starts, its first try at once
            fo.opened = false;
            fo.lossCause = conn.error || 'connection lost';
            if (!reconnectSchedule && (options.reconnect === false || options.reconnect_limit === 0)) {
                fo.tries = 0;
                return giveUp();   // the application asked for no reconnection (rhea's options)
            }
            fo.temps = new Map();
            for (const link of links()) {
                // the broker's attach echoes dynamic = true (the local terminus is encoded already)
                if (link.is_receiver() && link.source && link.source.dynamic) fo.temps.set(link, link.source.address);
            }
            // a broker that sent us elsewhere (failback, scale-down: amqp:connection:redirect on
            // the open connection) names where the data is now: that address is tried first
            fo.pass = candidates();
            if (fo.redirectedTo) {
                const r = fo.redirectedTo;
                fo.pass = [r].concat(fo.pass.filter((a) => a.host !== r.host || a.port !== r.port));
                fo.redirectedTo = null;
            }
            fo.index = 0;
            fo.tries = 1;
            if (reconnectSchedule) reconnectSchedule.reset();
            return 0;
        }
        fo.index += 1;
        if (fo.index < fo.pass.length) return 0;   // the same try: the next address at once
        const sched = fo.everOpened ? reconnectSchedule : initialSchedule;
        let delay;
        if (sched) {
            delay = sched.mayTryAgain(fo.tries) ? sched.next() : -1;
        } else {
            delay = policy(successful);
        }
        if (delay < 0) return giveUp();
        fo.pass = candidates();
        fo.index = 0;
        fo.tries += 1;
        return delay;
    }

    function emit(name, event) {
        try {
            events.emit(name, event);
        } catch (e) {   // one listener's failure must not break the connection (as Artemis)
            console.error('lodestone_events listener failed:', e);
        }
    }

    function links() {
        const out = [];
        for (const k in conn.local_channel_map) {
            const session = conn.local_channel_map[k];
            for (const name in session.links) out.push(session.links[name]);
        }
        return out;
    }

    function learn(list) {   // Artemis's failover-server-list entries (an Open's, a redirect's)
        for (const m of [].concat(list || [])) {
            const host = lookup(m, 'network-host');
            const port = Number(lookup(m, 'port'));
            if (typeof host === 'string' && host && Number.isInteger(port) &&
                !fo.learned.some((a) => a.host === host && a.port === port)) {
                fo.learned.push({ host, port });
            }
        }
    }

    function opened(props) {
        const now = identity(props);
        learn(lookup(props, 'failover-server-list'));
        fo.good = fo.start;
        fo.opened = true;
        const reconnection = fo.everOpened;
        fo.everOpened = true;
        const before = fo.broker;
        fo.broker = now;
        if (!reconnection) return;
        const [same, reason] = sameProcess(before, now);
        let lost = null;
        if (!same) {
            if (fo.nonDurable > 0) lost = new NonDurableLost(fo.nonDurable, before, now, reason);
            fo.nonDurable = 0;
        }
        const event = { type: same ? 'RECONNECTED' : 'FAILOVER', url: `${fo.good.host}:${fo.good.port}`,
                        tries: fo.tries, lost, temporary_queues: {}, broker: now, cause: fo.lossCause,
                        error: null };
        fo.lossCause = null;
        // tell once every dynamic receiver is attached again (its new address known)
        const waiting = new Set();
        let told = false;
        const done = () => {
            if (waiting.size || told) return;
            told = true;
            emit(same ? 'reconnected' : 'failover', event);
        };
        for (const [link, old] of fo.temps) {
            if (link.is_closed && link.is_closed()) continue;
            waiting.add(link);
            const settle = (ok) => {
                if (!waiting.has(link)) return;
                const address = link.source ? link.source.address : undefined;
                if (ok && old !== undefined && address !== undefined && old !== address) {
                    for (const k of Object.keys(fo.renamed)) if (fo.renamed[k] === old) fo.renamed[k] = address;
                    fo.renamed[old] = address;
                    event.temporary_queues[old] = address;
                }
                waiting.delete(link);
                done();
            };
            link.observers.once('receiver_open', () => settle(true));
            link.observers.once('receiver_error', () => settle(false));   // refused: nothing to wait for
        }
        fo.temps = new Map();
        process.nextTick(done);   // after the application's connection_open
    }

    const conn = container.connect(opts);
    const proto = Object.getPrototypeOf(conn);
    conn.lodestone_events = events;

    conn.open_sender = function () {
        const sender = proto.open_sender.apply(this, arguments);
        const send = sender.send;
        sender.send = function (msg) {
            if (msg && typeof msg === 'object' && msg.reply_to !== undefined && fo.renamed[msg.reply_to]) {
                msg.reply_to = fo.renamed[msg.reply_to];
            }
            const delivery = send.apply(this, arguments);
            if (delivery && msg && typeof msg === 'object' && !msg.durable) delivery.lodestone_non_durable = true;
            return delivery;
        };
        sender.observers.on('accepted', (context) => {
            if (context.delivery && context.delivery.lodestone_non_durable) fo.nonDurable += 1;
        });
        return sender;
    };

    conn.dispatch = function (name) {
        if (st.between) return true;  // the application sees nothing of the router's connection
        return proto.dispatch.apply(this, arguments);
    };
    conn._is_fatal = function (condition) {
        if (st.decision === 'go') return false;
        if (st.decision === 'give-up') return true;
        return proto._is_fatal.call(this, condition);
    };
    conn.on_open = function (frame) {
        const failed = lookup(frame.performative.properties, ESTABLISHMENT_FAILED);
        if (failed) {
            st.between = true;
        } else {
            st.between = false;
            st.refusals = 0;
            this.lodestone_hops = st.hops.slice();
            opened(frame.performative.properties);
            restart(fo.good);
        }
        return proto.on_open.call(this, frame);
    };
    conn.on_close = function (frame) {
        if (st.between) {
            const error = frame.performative.error || {};
            const verdict = decide(error);
            if (verdict.go) {
                st.decision = 'go';
            } else {
                st.between = false;
                st.decision = 'give-up';
                if (verdict.error) {
                    this.lodestone_error = verdict.error;
                    error.description = `${error.description || error.condition} — ${verdict.error.message}`;
                }
            }
        } else if (fo.opened) {
            // the broker of an open connection sends us to the node that now serves its data
            // (failback, scale-down, its management close): handled as rhea handles
            // amqp:connection:forced (connection_error and connection_close are dispatched, then
            // the reconnection), which starts there
            const error = frame.performative.error || {};
            const host = lookup(error.info, 'network-host');
            const port = Number(lookup(error.info, 'port'));
            if (String(error.condition) === REDIRECT && typeof host === 'string' && host && Number.isInteger(port)) {
                fo.redirectedTo = { host, port };
                learn(lookup(error.info, 'failover-server-list'));
                st.decision = 'go';
            }
        }
        try {
            return proto.on_close.call(this, frame);
        } finally {
            st.decision = null;
        }
    };

    function decide(error) {
        const condition = String(error.condition);
        if (condition === REDIRECT) {
            const host = lookup(error.info, 'network-host');
            const port = Number(lookup(error.info, 'port'));
            if (typeof host !== 'string' || !host || !Number.isInteger(port)) {
                return { error: new RedirectError('RedirectError', 'redirect without network-host/port', st.hops) };
            }
            const key = `${host}:${port}`;
            if (st.hops.length > maxHops) {
                return { error: new RedirectError('TooManyRedirects',
                                                  `more than ${maxHops} redirects, the next to ${key}`, st.hops) };
            }
            if (st.visited.has(key)) {
                return { error: new RedirectError('RedirectLoop', `redirect loop back to ${key}`,
                                                  st.hops.concat([key])) };
            }
            st.visited.add(key);
            st.hops.push(key);
            st.next = { host, port };
            st.delay = 0;
            return { go: true };
        }
        if (condition === FORCED) {
            st.refusals += 1;
            const what = String(error.description || FORCED);
            if (what.indexOf('rejected this connection') >= 0) {
                return { error: new RedirectError('RouterRefused',
                                                  'not retried: the router will not take this client', st.hops) };
            }
            if (st.refusals > backoff.length) {
                return { error: new RedirectError('RouterRefused', `gave up after ${st.refusals} attempts`, st.hops) };
            }
            st.next = front;
            st.delay = backoff[st.refusals - 1];
            return { go: true };
        }
        return {};  // not a router answer we know: the application sees it as it is
    }

    return conn;
}

module.exports = { connect, FOLLOWS_REDIRECT, RedirectError, NonDurableLost, identity, sameProcess };
