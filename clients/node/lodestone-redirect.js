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
 * reconnects through the front door, following redirects again.
 *
 * The Open announces the desired capability 'lodestone:follows-redirect'.
 */
'use strict';

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

class RedirectError extends Error {
    constructor(name, message, hops) {
        super(`${message} (hops: ${hops.join(' -> ')})`);
        this.name = name;
        this.hops = hops;
    }
}

/**
 * container.connect(options) that follows redirects. Extra options: max_hops (5),
 * refusal_backoff_ms ([250, 500, 1000]). Returns the rhea Connection; after the first real
 * Open, connection.lodestone_hops lists the "host:port" visited.
 */
function connect(container, options) {
    const maxHops = options.max_hops === undefined ? 5 : options.max_hops;
    const backoff = options.refusal_backoff_ms || DEFAULT_REFUSAL_BACKOFF_MS;
    const front = { host: options.host || 'localhost', port: options.port || 5672 };
    const frontKey = `${front.host}:${front.port}`;
    const caps = [].concat(options.desired_capabilities || []);
    if (caps.indexOf(FOLLOWS_REDIRECT) < 0) caps.push(FOLLOWS_REDIRECT);
    const policy = userReconnectPolicy(options);
    const st = {
        between: false,       // inside the router's failed connection / on the way to the next hop
        next: null,           // the next hop's {host, port}, consumed by connection_details
        delay: null,          // delay before that hop (ms), consumed by reconnect
        decision: null,       // 'go' | 'give-up' while rhea handles the Close
        hops: [frontKey],
        visited: new Set([frontKey]),
        refusals: 0,
    };
    const restart = () => { st.hops = [frontKey]; st.visited = new Set([frontKey]); };

    const opts = Object.assign({}, options, { desired_capabilities: caps });
    opts.connection_details = function () {
        const target = st.next || front;
        st.next = null;
        if (target === front) restart();
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
        return policy(successful);
    };

    const conn = container.connect(opts);
    const proto = Object.getPrototypeOf(conn);

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
            restart();
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

module.exports = { connect, FOLLOWS_REDIRECT, RedirectError };
