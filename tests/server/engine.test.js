// Serving behaviour through the HTTP API: batch invariance, a load test with
// metrics reconciliation, client disconnects, and preemption / prefix caching
// on a server with a tiny KV budget (outputs must equal an unconstrained
// server's, and every block must come back).
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const { env, post, metrics, pool, waitFor, sleep } = require('./lib');

const A = env.main;
const prompts = Array.from({ length: 64 }, (_, i) => `Request number ${i}: the ${['red', 'green', 'blue', 'old'][i % 4]} house ${i * 7}`);
const req = (p, extra = {}) => ({ model: env.model, prompt: p, max_tokens: 12, temperature: 0, ignore_eos: true, ...extra });

async function texts(base, list, concurrency, extra) {
  const res = await pool(list, concurrency, (p) => post(base, '/v1/completions', req(p, extra)));
  for (const r of res) assert.equal(r.status, 200, r.text);
  return res.map((r) => r.json.choices[0].text);
}

test('batch invariance: 64 concurrent greedy requests == one at a time', async () => {
  const alone = await texts(A, prompts, 1);
  const together = await texts(A, prompts, 64);
  for (let i = 0; i < prompts.length; i++) assert.equal(together[i], alone[i], `prompt ${i}`);
});

test('load: 500 requests from 64 clients, none lost or duplicated, metrics match', async () => {
  const before = await metrics(A);
  const jobs = Array.from({ length: 500 }, (_, i) => ({ i, stream: i % 3 === 0, max: 1 + (i % 8) }));
  const results = await pool(jobs, 64, async (j) => {
    const body = req(`load ${j.i}`, { max_tokens: j.max });
    if (!j.stream) {
      const r = await post(A, '/v1/completions', body);
      assert.equal(r.status, 200, r.text);
      return { id: r.json.id, tokens: r.json.usage.completion_tokens, text: r.json.choices[0].text };
    }
    const res = await fetch(A + '/v1/completions', {
      method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    });
    const raw = await res.text();
    const events = raw.split('\n\n').filter((e) => e.startsWith('data: ') && e !== 'data: [DONE]').map((e) => JSON.parse(e.slice(6)));
    assert.ok(raw.endsWith('data: [DONE]\n\n'));
    return { id: events[0].id, tokens: events.at(-1).usage.completion_tokens, text: events.filter((e) => e.choices.length).map((e) => e.choices[0].text).join('') };
  });
  assert.equal(results.length, 500);
  assert.equal(new Set(results.map((r) => r.id)).size, 500, 'ids are unique');
  let tokens = 0;
  for (let i = 0; i < 500; i++) {
    assert.equal(results[i].tokens, jobs[i].max, `request ${i} got all its tokens`);
    tokens += results[i].tokens;
  }
  const after = await metrics(A);
  const d = (n, f) => after.sum(n, f) - before.sum(n, f);
  assert.equal(d('vllm:request_success_total', 'finished_reason="length"'), 500);
  assert.equal(d('vllm:request_success_total', 'finished_reason="abort"'), 0);
  assert.equal(d('vllm:generation_tokens_total'), tokens);
  assert.equal(d('vllm:request_generation_tokens_sum'), tokens);
  // The gauges are published once a step, so the step that finished the
  // last requests may still be publishing as their clients read the
  // response: the scheduler must get to 0, within a second.
  const idle = await waitFor(async () => {
    const m = await metrics(A);
    return m.sum('vllm:num_requests_running') === 0 && m.sum('vllm:num_requests_waiting') === 0;
  }, 1000);
  assert.ok(idle, 'no request left running or waiting');
});

const finished = (m, reason) => m.sum('vllm:request_success_total', `finished_reason="${reason}"`);

// One request that the client leaves: after its first streamed chunk, or
// (non-streaming) once the server shows it running, or after abortAfterMs
// when that is given. Says how it ended: 'aborted', 'finished' (it was done
// before the client left: a fast device) or 'lost' (neither was counted).
async function disconnectOnce(streaming, abortAfterMs) {
  const before = await metrics(A);
  const ctl = new AbortController();
  // as long as the context allows, so it is surely still running when the client leaves
  const models = await (await fetch(A + '/v1/models')).json();
  const body = req('disconnect me', { max_tokens: models.data[0].max_model_len - 16, stream: streaming });
  const p = fetch(A + '/v1/completions', {
    method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body), signal: ctl.signal,
  }).then(async (res) => {
    if (streaming) {
      const reader = res.body.getReader();
      await reader.read(); // the first chunk arrived: the request is running
    }
    ctl.abort();
  }).catch(() => {});
  if (!streaming) {
    if (abortAfterMs === undefined) {
      await waitFor(async () => (await metrics(A)).sum('vllm:num_requests_running') > 0, 5000);
    } else {
      await sleep(abortAfterMs);
    }
    ctl.abort();
  }
  await p;
  let outcome = 'lost';
  await waitFor(async () => {
    const m = await metrics(A);
    if (m.sum('vllm:num_requests_running') !== 0) return false;
    if (finished(m, 'abort') === finished(before, 'abort') + 1) outcome = 'aborted';
    else if (finished(m, 'length') === finished(before, 'length') + 1) outcome = 'finished';
    return outcome !== 'lost';
  }, 5000);
  return outcome;
}

async function disconnectCase(streaming) {
  // On a GPU the tiny model generates the whole context in tens of
  // milliseconds, so a non-streaming request can be over before the client
  // sees it running: then the client leaves sooner, until one is aborted.
  const tries = [undefined, 20, 10, 5, 2, 1, 0];
  const seen = [];
  for (const ms of tries) {
    const outcome = await disconnectOnce(streaming, ms);
    seen.push(`${ms === undefined ? 'when running' : ms + ' ms'}: ${outcome}`);
    if (outcome === 'aborted') break;
    if (streaming && outcome !== 'finished') break;
  }
  assert.ok(seen[seen.length - 1].endsWith('aborted'), `the request was aborted (${seen.join('; ')})`);
  const m = await metrics(A);
  assert.equal(m.sum('vllm:num_requests_running'), 0, 'nothing is left running');
  assert.equal(m.sum('vllm:kv_cache_usage_perc'), 0);
}

test('a streaming client that disconnects aborts its request', () => disconnectCase(true));
test('a non-streaming client that disconnects aborts its request', () => disconnectCase(false));

test('tiny KV budget: preemption and prefix caching, outputs unchanged, no block leaks', async () => {
  const S = env.small;
  const long = prompts.slice(0, 12).map((p) => (p + ' and more words to fill blocks, ').repeat(3));
  const want = await texts(A, long, 4, { max_tokens: 24 });
  const before = await metrics(S);
  const got = await texts(S, long, 12, { max_tokens: 24 });
  for (let i = 0; i < long.length; i++) assert.equal(got[i], want[i], `prompt ${i} under memory pressure`);
  // the same prompt again: its full blocks come from the prefix cache
  await texts(S, [long[0]], 1, { max_tokens: 24 });
  const mid = await metrics(S);
  const again = await texts(S, [long[0]], 1, { max_tokens: 24 });
  assert.equal(again[0], want[0]);
  const after = await metrics(S);
  const dm = (n) => after.sum(n) - mid.sum(n);
  assert.ok(dm('pdserve:prompt_tokens_computed_total') < dm('vllm:prompt_tokens_total'),
    'a cached prefix is not computed again');
  assert.ok(after.sum('vllm:num_preemptions_total') > before.sum('vllm:num_preemptions_total'), 'preempted');
  assert.ok(after.sum('vllm:prefix_cache_hits_total') > before.sum('vllm:prefix_cache_hits_total'), 'prefix cache hit');
  const idle = await waitFor(async () => (await metrics(S)).sum('vllm:kv_cache_usage_perc') === 0, 3000);
  assert.ok(idle, 'KV usage back to 0');
  await sleep(0);
});
