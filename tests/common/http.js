// http.js: the HTTP helpers the Node test suites share (tests/server,
// tests/proxy, tests/connector): JSON requests, SSE parsing, /metrics
// scraping, polling and a bounded-concurrency pool.
'use strict';

function parseJSON(text) {
  try { return JSON.parse(text); } catch { return null; }
}

// POST body (an object is sent as JSON; a string, or raw: true, as it is).
async function post(base, path, body, { headers = {}, signal, raw = false } = {}) {
  const res = await fetch(base + path, {
    method: 'POST', signal,
    headers: { 'Content-Type': 'application/json', ...headers },
    body: raw || typeof body === 'string' ? body : JSON.stringify(body),
  });
  const text = await res.text();
  return { status: res.status, headers: res.headers, text, json: parseJSON(text) };
}

async function get(base, path, headers = {}) {
  const res = await fetch(base + path, { headers });
  const text = await res.text();
  return { status: res.status, headers: res.headers, text, json: parseJSON(text) };
}

// The events of an SSE body. wellFormed: every part is "data: ...\n\n", each
// event is JSON, and nothing follows [DONE].
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
    const j = parseJSON(data);
    if (!j) wellFormed = false; else events.push(j);
  }
  return { events, done, wellFormed };
}

// POST /v1/completions with stream: true; the raw reply plus its parsed events.
async function stream(base, body, opts = {}) {
  const r = await post(base, '/v1/completions', { ...body, stream: true }, opts);
  return { ...r, ...parseSSE(r.text) };
}

// Scrape /metrics; sum(name, frag) adds every sample of that name whose
// key (with labels) contains frag.
async function metrics(base) {
  const r = await get(base, '/metrics');
  const values = new Map();
  for (const line of r.text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const sp = line.lastIndexOf(' ');
    values.set(line.slice(0, sp), Number(line.slice(sp + 1)));
  }
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

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// Poll pred (which may throw while a server is not up yet) for up to ms.
async function waitFor(pred, ms = 10000) {
  const end = Date.now() + ms;
  for (;;) {
    try { if (await pred()) return true; } catch { /* not up yet */ }
    if (Date.now() > end) return false;
    await sleep(50);
  }
}

// Run fn over items with at most `limit` in flight; results in item order.
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

// An OpenAI-style error body with this status as its code.
function isErrorShape(j, status) {
  return !!(j && j.error && typeof j.error.message === 'string' && j.error.message.length > 0 &&
    typeof j.error.type === 'string' && 'param' in j.error && j.error.code === status);
}

module.exports = { parseJSON, post, get, parseSSE, stream, metrics, sleep, waitFor, pool, isErrorShape };
