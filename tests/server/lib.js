// Helpers for the pdserve HTTP tests: raw requests, SSE parsing, metrics
// scraping. Servers are started by test_http.sh; their URLs come in env vars.
'use strict';
const net = require('node:net');

const env = {
  main: process.env.PD_URL_MAIN,     // ordinary server
  auth: process.env.PD_URL_AUTH,     // --api-key
  small: process.env.PD_URL_SMALL,   // tiny KV budget
  busy: process.env.PD_URL_BUSY,     // --max-waiting 1 --max-num-seqs 1
  model: process.env.PD_MODEL_NAME || 'tiny',
  apiKey: process.env.PD_API_KEY || 'test-key',
};

async function post(base, path, body, { headers = {}, raw = false } = {}) {
  const res = await fetch(base + path, {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', ...headers },
    body: raw ? body : JSON.stringify(body),
  });
  const text = await res.text();
  let json = null;
  try { json = JSON.parse(text); } catch { /* not JSON */ }
  return { status: res.status, headers: res.headers, text, json };
}

async function get(base, path, headers = {}) {
  const res = await fetch(base + path, { headers });
  const text = await res.text();
  let json = null;
  try { json = JSON.parse(text); } catch { /* not JSON */ }
  return { status: res.status, headers: res.headers, text, json };
}

// POST with stream: true; returns the raw body and the parsed events.
async function stream(base, body, headers = {}) {
  const res = await fetch(base + '/v1/completions', {
    method: 'POST',
    headers: { 'Content-Type': 'application/json', ...headers },
    body: JSON.stringify({ ...body, stream: true }),
  });
  const text = await res.text();
  return { status: res.status, headers: res.headers, text, ...parseSSE(text) };
}

function parseSSE(text) {
  const events = [];
  let done = false, wellFormed = true;
  const parts = text.split('\n\n');
  if (parts[parts.length - 1] !== '') wellFormed = false;
  for (const p of parts.slice(0, -1)) {
    if (!p.startsWith('data: ')) { wellFormed = false; continue; }
    const data = p.slice(6);
    if (data === '[DONE]') { if (done) wellFormed = false; done = true; continue; }
    if (done) wellFormed = false; // nothing after [DONE]
    events.push(JSON.parse(data));
  }
  return { events, done, wellFormed };
}

async function metrics(base) {
  const r = await get(base, '/metrics');
  const values = new Map();
  for (const line of r.text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const sp = line.lastIndexOf(' ');
    values.set(line.slice(0, sp), Number(line.slice(sp + 1)));
  }
  // sum of every sample whose name (and optional label fragment) matches
  const sum = (name, frag = '') => {
    let s = 0;
    for (const [k, v] of values) {
      const n = k.indexOf('{') < 0 ? k : k.slice(0, k.indexOf('{'));
      if (n === name && k.includes(frag)) s += v;
    }
    return s;
  };
  return { text: r.text, headers: r.headers, values, sum };
}

// Raw bytes over TCP (for bodies fetch cannot send, e.g. a short body).
function rawRequest(base, bytes, { closeAfterMs = 0 } = {}) {
  const u = new URL(base);
  return new Promise((resolve) => {
    const sock = net.connect(Number(u.port), u.hostname);
    let out = '';
    sock.on('data', (d) => { out += d.toString('latin1'); });
    sock.on('error', () => resolve(out));
    sock.on('close', () => resolve(out));
    sock.write(bytes);
    if (closeAfterMs) setTimeout(() => sock.end(), closeAfterMs);
  });
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function waitFor(pred, ms = 5000) {
  const end = Date.now() + ms;
  for (;;) {
    if (await pred()) return true;
    if (Date.now() > end) return false;
    await sleep(50);
  }
}

// Run fn over items with at most `limit` in flight.
async function pool(items, limit, fn) {
  const out = new Array(items.length);
  let next = 0;
  const workers = Array.from({ length: Math.min(limit, items.length) }, async () => {
    while (next < items.length) {
      const i = next++;
      out[i] = await fn(items[i], i);
    }
  });
  await Promise.all(workers);
  return out;
}

function isErrorShape(j, status) {
  return j && j.error && typeof j.error.message === 'string' && j.error.message.length > 0 &&
    typeof j.error.type === 'string' && 'param' in j.error && j.error.code === status;
}

module.exports = { env, post, get, stream, parseSSE, metrics, rawRequest, sleep, waitFor, pool, isErrorShape };
