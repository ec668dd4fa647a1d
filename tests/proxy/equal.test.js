// Greedy outputs through the 1P1D and 2P2D stacks equal those of a
// colocated instance, for 100 prompts, streamed and not. The instances were
// found only through their ZMQ announcements.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const { env, get, post, stream, completionOf, waitFor, pool, prompts, metrics } = require('./lib');

async function registered(base, np, nd) {
  const h = await get(base, '/health');
  return h.status === 200 && h.json.prefill.length === np && h.json.decode.length === nd;
}

test('stacks: instances register through discovery', async () => {
  assert.ok(await waitFor(() => registered(env.one, 1, 1), 20000), 'the 1P1D stack did not register');
  assert.ok(await waitFor(() => registered(env.two, 2, 2), 20000), 'the 2P2D stack did not register');
  assert.ok(await waitFor(async () => (await get(env.ref, '/health')).status === 200, 20000));
  const h = await get(env.two, '/health');
  for (const i of [...h.json.prefill, ...h.json.decode]) {
    assert.match(i.http_address, /^127\.0\.0\.1:\d+$/);
    assert.match(i.zmq_address, /^127\.0\.0\.1:\d+$/);
    assert.equal(i.static, false);
  }
  assert.ok(h.json.discovery.accepted >= 4);
});

test('greedy outputs equal a colocated instance (100 prompts, streamed and not, 1P1D and 2P2D)', async () => {
  const ps = prompts(100);
  const before = await metrics(env.two);
  const bodies = ps.map((p, i) => ({ model: env.model, prompt: p, max_tokens: 1 + (i % 16), temperature: 0 }));
  const want = await pool(bodies, 8, async (b) => {
    const r = await post(env.ref, '/v1/completions', b);
    assert.equal(r.status, 200, r.text);
    return { ...completionOf(r, false), usage: r.json.usage };
  });
  for (const base of [env.one, env.two]) {
    await pool(bodies, 8, async (b, i) => {
      const r = await post(base, '/v1/completions', b);
      assert.equal(r.status, 200, r.text);
      assert.deepEqual(completionOf(r, false), { text: want[i].text, finish: want[i].finish }, `prompt ${i} via ${base}`);
      assert.deepEqual(r.json.usage, want[i].usage);
      const s = await stream(base, { ...b, stream_options: { include_usage: true } });
      assert.equal(s.status, 200, s.text);
      assert.ok(s.wellFormed && s.done, `stream ${i} malformed: ${s.text.slice(0, 200)}`);
      assert.deepEqual(completionOf(s, true), { text: want[i].text, finish: want[i].finish }, `stream ${i} via ${base}`);
      const u = s.events.find((e) => e.usage);
      assert.equal(u.usage.completion_tokens, want[i].usage.completion_tokens);
    });
  }
  // Round robin spread the 200 requests of the 2P2D stack over both pairs.
  const after = await metrics(env.two);
  const inst = (role) => [...after.values.keys()].filter((k) => k.startsWith(`pdproxy_instance_requests_total{role="${role}"`));
  for (const role of ['prefill', 'decode']) {
    assert.equal(inst(role).length, 2);
    for (const k of inst(role)) assert.ok(after.values.get(k) - (before.values.get(k) || 0) >= 90, `${k}: ${after.values.get(k)}`);
  }
  assert.equal(after.sum('pdproxy_requests_total', 'status="200"') - before.sum('pdproxy_requests_total', 'status="200"'), 200);
});
