// Instances joining and leaving under load: 300 requests from 32 clients
// through the 2P2D stack while one prefill and one decode instance are
// killed (SIGKILL) and a new pair joins through discovery. Every request
// either succeeds with the colocated instance's greedy output or gets an
// OpenAI-style JSON error (a status, or an error event in a stream that
// broke); none outlives its deadline; the client's counts per status equal
// the proxy's /metrics counts; the new instances take traffic.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const { env, get, post, stream, completionOf, metrics, pool, prompts, isErrorShape, startInstance, stopProc, waitFor, sleep } = require('./lib');

const spawned = [];
test.after(async () => { for (const s of spawned) await stopProc(s.proc); });

test('churn: 300 requests, 32 clients, a P and a D killed and a new pair joining', async () => {
  assert.ok(await waitFor(async () => (await get(env.two, '/health')).json.decode.length === 2, 10000));
  const ps = prompts(30, 99);
  const want = await pool(ps, 8, async (p) => completionOf(await post(env.ref, '/v1/completions', { model: env.model, prompt: p, max_tokens: 24, temperature: 0 }), false));
  const before = await metrics(env.two);
  const items = Array.from({ length: 300 }, (_, i) => i);
  let done = 0, churned = false;
  const counts = new Map();
  const bump = (k) => counts.set(k, (counts.get(k) || 0) + 1);
  const results = await pool(items, 32, async (i) => {
    if (done >= 60 && !churned) {
      churned = true; // kill one of each role, start a new pair
      for (const pid of env.killPids) process.kill(pid, 'SIGKILL');
      const [h1, k1, h2, k2] = env.spare;
      spawned.push(startInstance('p2c', 'kv_producer', env.discoveryTwo, h1, k1));
      spawned.push(startInstance('d2c', 'kv_consumer', env.discoveryTwo, h2, k2));
    }
    const body = { model: env.model, prompt: ps[i % ps.length], max_tokens: 24, temperature: 0 };
    const streamed = i % 2 === 1;
    const t0 = Date.now();
    let r;
    try {
      const signal = AbortSignal.timeout(25000); // the proxy's --timeout is 20 s
      r = streamed ? await stream(env.two, body, { signal }) : await post(env.two, '/v1/completions', body, { signal });
    } catch (e) {
      done++;
      return { i, kind: 'hung', error: String(e), ms: Date.now() - t0 };
    }
    done++;
    const ms = Date.now() - t0;
    if (r.status === 200) {
      const c = completionOf(r, streamed);
      if (c) { bump(200); return { i, kind: 'ok', same: c.text === want[i % ps.length].text && c.finish === want[i % ps.length].finish, ms }; }
      const ev = r.events.find((e) => e.error);
      if (ev && isErrorShape(ev, ev.error.code)) { bump(ev.error.code); return { i, kind: 'error', status: ev.error.code, msg: ev.error.message, ms }; }
      return { i, kind: 'bad', text: r.text.slice(0, 300), ms };
    }
    if (isErrorShape(r.json, r.status)) { bump(r.status); return { i, kind: 'error', status: r.status, msg: r.json.error.message, ms }; }
    return { i, kind: 'bad', status: r.status, text: r.text.slice(0, 300), ms };
  });
  const by = (k) => results.filter((r) => r.kind === k);
  assert.deepEqual(by('hung'), [], 'requests outlived their deadline');
  assert.deepEqual(by('bad'), [], 'answers that are neither a completion nor a JSON error');
  assert.ok(by('ok').every((r) => r.same), 'a successful request differs from the colocated output');
  assert.ok(by('ok').length >= 200, `only ${by('ok').length} of 300 succeeded`);
  for (const e of by('error')) {
    assert.ok([502, 503, 504].includes(e.status), `${e.status}: ${e.msg}`);
    assert.match(e.msg, /instance/);
  }
  console.log(`churn: ${by('ok').length} ok, ${by('error').length} JSON errors (${[...counts].map(([k, v]) => `${k}: ${v}`).join(', ')}), slowest ${Math.max(...results.map((r) => r.ms))} ms`);
  // Totals add up: the proxy counted exactly what the clients saw.
  const after = await metrics(env.two);
  const codes = new Set([...counts.keys()]);
  for (const k of after.values.keys()) { const m = /^pdproxy_requests_total\{status="(\d+)"\}$/.exec(k); if (m) codes.add(Number(m[1])); }
  for (const c of codes) {
    const d = after.sum('pdproxy_requests_total', `status="${c}"`) - before.sum('pdproxy_requests_total', `status="${c}"`);
    assert.equal(d, counts.get(c) || 0, `status ${c}: proxy ${d}, clients ${counts.get(c) || 0}`);
  }
  // The killed pair is dropped, the new one registered; traffic reaches it.
  const newP = spawned[0].http, newD = spawned[1].http;
  assert.ok(await waitFor(async () => {
    const h = (await get(env.two, '/health')).json;
    return h.prefill.length === 2 && h.decode.length === 2 && h.prefill.some((i) => i.http_address === newP) && h.decode.some((i) => i.http_address === newD);
  }, 10000), 'the stack did not settle on the new pair');
  await pool(Array.from({ length: 20 }, (_, i) => i), 4, async (i) => {
    const r = await post(env.two, '/v1/completions', { model: env.model, prompt: ps[i], max_tokens: 24, temperature: 0 });
    assert.equal(r.status, 200, r.text);
    assert.equal(r.json.choices[0].text, want[i].text);
  });
  const m = await metrics(env.two);
  assert.ok(m.sum('pdproxy_instance_requests_total', `instance="${newP}"`) > 0);
  assert.ok(m.sum('pdproxy_instance_requests_total', `instance="${newD}"`) > 0);
  await sleep(10);
});
