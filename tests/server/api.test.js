// Raw-HTTP suite: every /v1/completions field, response and SSE shapes,
// finish/stop reasons, usage, the small endpoints and every error code.
// Expected values come from the server's own independent paths (e.g.
// /tokenize counts, the non-streaming text for a streamed request, the
// unconstrained output for a stop string), never from constants.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const { env, post, get, stream, isErrorShape, metrics } = require('./lib');

const A = env.main;
const greedy = { temperature: 0, ignore_eos: true };
const complete = (body, opts) => post(A, '/v1/completions', { model: env.model, ...body }, opts);

test('non-streaming response shape', async () => {
  const r = await complete({ prompt: 'Hello world', max_tokens: 5, ...greedy });
  assert.equal(r.status, 200);
  assert.match(r.headers.get('content-type'), /application\/json/);
  const j = r.json;
  assert.match(j.id, /^cmpl-[0-9a-f]{32}$/);
  assert.equal(j.object, 'text_completion');
  assert.equal(typeof j.created, 'number');
  assert.equal(j.model, env.model);
  assert.equal(j.choices.length, 1);
  const c = j.choices[0];
  for (const k of ['index', 'text', 'logprobs', 'finish_reason', 'stop_reason']) assert.ok(k in c, k);
  assert.equal(c.index, 0);
  assert.equal(c.finish_reason, 'length');
  assert.equal(c.stop_reason, null);
  assert.equal(c.logprobs, null);
  assert.equal(j.kv_transfer_params, null);
  const tok = await post(A, '/tokenize', { prompt: 'Hello world' });
  assert.equal(j.usage.prompt_tokens, tok.json.count);
  assert.equal(j.usage.completion_tokens, 5);
  assert.equal(j.usage.total_tokens, j.usage.prompt_tokens + 5);
});

test('prompt forms: string, list of strings, token ids, list of lists', async () => {
  const tok = await post(A, '/tokenize', { prompt: 'The cat' });
  const ids = tok.json.tokens;
  const s = await complete({ prompt: 'The cat', max_tokens: 6, ...greedy });
  const i = await complete({ prompt: ids, max_tokens: 6, ...greedy });
  assert.equal(i.status, 200);
  assert.equal(i.json.choices[0].text, s.json.choices[0].text, 'ids and text give the same output');
  const ls = await complete({ prompt: ['The cat', 'A dog'], max_tokens: 6, ...greedy });
  const ll = await complete({ prompt: [ids, ids], max_tokens: 6, ...greedy });
  assert.equal(ls.json.choices.length, 2);
  assert.equal(ls.json.choices[0].text, s.json.choices[0].text);
  assert.equal(ll.json.choices[1].text, s.json.choices[0].text);
  const tok2 = await post(A, '/tokenize', { prompt: 'A dog' });
  assert.equal(ls.json.usage.prompt_tokens, tok.json.count + tok2.json.count);
});

test('n > 1 with several prompts: index order and usage not multiplied by n', async () => {
  const r = await complete({ prompt: ['one', 'two'], n: 2, max_tokens: 4, temperature: 1, seed: 3, ignore_eos: true });
  assert.equal(r.status, 200);
  assert.deepEqual(r.json.choices.map((c) => c.index), [0, 1, 2, 3]);
  const t1 = (await post(A, '/tokenize', { prompt: 'one' })).json.count;
  const t2 = (await post(A, '/tokenize', { prompt: 'two' })).json.count;
  assert.equal(r.json.usage.prompt_tokens, t1 + t2);
  assert.equal(r.json.usage.completion_tokens, 16);
  const again = await complete({ prompt: ['one', 'two'], n: 2, max_tokens: 4, temperature: 1, seed: 3, ignore_eos: true });
  assert.deepEqual(again.json.choices.map((c) => c.text), r.json.choices.map((c) => c.text), 'seeded sampling repeats');
});

test('echo, and echo with max_tokens 0', async () => {
  const base = await complete({ prompt: 'Echo me', max_tokens: 4, ...greedy });
  const r = await complete({ prompt: 'Echo me', max_tokens: 4, echo: true, ...greedy });
  assert.equal(r.json.choices[0].text, 'Echo me' + base.json.choices[0].text);
  const z = await complete({ prompt: 'Echo me', max_tokens: 0, echo: true });
  assert.equal(z.status, 200);
  assert.equal(z.json.choices[0].text, 'Echo me');
  assert.equal(z.json.usage.completion_tokens, 0);
  const bad = await complete({ prompt: 'Echo me', max_tokens: 0 });
  assert.equal(bad.status, 400);
});

test('logprobs object shape', async () => {
  const r = await complete({ prompt: 'Numbers', max_tokens: 5, logprobs: 3, ...greedy });
  const lp = r.json.choices[0].logprobs;
  assert.ok(lp);
  for (const k of ['text_offset', 'token_logprobs', 'tokens', 'top_logprobs']) assert.equal(lp[k].length, 5, k);
  for (let i = 0; i < 5; i++) {
    assert.ok(lp.token_logprobs[i] <= 0 && lp.token_logprobs[i] >= -9999);
    const keys = Object.keys(lp.top_logprobs[i]);
    assert.ok(keys.length >= 1 && keys.length <= 4, `top has ${keys.length} keys`);
    assert.ok(keys.includes(lp.tokens[i]), 'sampled token is among the top ones');
    // greedy: the sampled token is the most likely one
    const best = Math.max(...Object.values(lp.top_logprobs[i]));
    assert.ok(Math.abs(best - lp.token_logprobs[i]) < 1e-4);
    if (i) assert.equal(lp.text_offset[i], lp.text_offset[i - 1] + [...lp.tokens[i - 1]].length);
  }
  // per-token strings only add up to the text when no token is a partial character
  if (!lp.tokens.some((t) => t.includes('\uFFFD'))) assert.equal(lp.tokens.join(''), r.json.choices[0].text);
  const z = await complete({ prompt: 'Numbers', max_tokens: 3, logprobs: 0, ...greedy });
  for (const t of z.json.choices[0].logprobs.top_logprobs) assert.equal(Object.keys(t).length, 1);
});

test('stop strings: truncation, include_stop_str_in_output, list order', async () => {
  const base = await complete({ prompt: 'Once upon a time', max_tokens: 24, ...greedy });
  const text = base.json.choices[0].text;
  // a stop string taken from the middle of the unconstrained output
  const chars = [...text];
  assert.ok(chars.length >= 6, 'need some output');
  const stop = chars.slice(3, 5).join('');
  const at = text.indexOf(stop);
  const r = await complete({ prompt: 'Once upon a time', max_tokens: 24, stop, ...greedy });
  assert.equal(r.json.choices[0].text, text.slice(0, at));
  assert.equal(r.json.choices[0].finish_reason, 'stop');
  assert.equal(r.json.choices[0].stop_reason, stop);
  assert.ok(r.json.usage.completion_tokens < 24 || at + stop.length >= text.length);
  const inc = await complete({ prompt: 'Once upon a time', max_tokens: 24, stop: [stop], include_stop_str_in_output: true, ...greedy });
  assert.equal(inc.json.choices[0].text, text.slice(0, at + stop.length));
  // several stops: the one that completes first ends it, whatever its place in the list
  const two = await complete({ prompt: 'Once upon a time', max_tokens: 24, stop: ['\u0001never\u0002', stop], ...greedy });
  assert.equal(two.json.choices[0].stop_reason, stop);
  assert.equal(two.json.choices[0].text, text.slice(0, at));
  // streaming never shows the stop string and ends the same way
  const s = await stream(A, { model: env.model, prompt: 'Once upon a time', max_tokens: 24, stop, ...greedy });
  assert.equal(s.events.map((e) => e.choices[0].text).join(''), text.slice(0, at));
  assert.equal(s.events.at(-1).choices[0].stop_reason, stop);
  // min_tokens holds stop strings back too (as vLLM): all 24 tokens, the full text
  const held = await complete(
      {prompt : 'Once upon a time', max_tokens : 24, min_tokens : 24, stop, ...greedy});
  assert.equal(held.json.choices[0].finish_reason, 'length');
  assert.equal(held.json.usage.completion_tokens, 24);
  assert.equal(held.json.choices[0].text, text);
});

test('stop_token_ids: finish stop with the id as stop_reason', async () => {
  const base = await complete({ prompt: 'Stop here', max_tokens: 8, logprobs: 0, ...greedy });
  const toks = base.json.choices[0].logprobs.tokens;
  // find a generated token whose text tokenizes back to one id
  let pick = -1, id = -1;
  for (let i = 1; i < toks.length && pick < 0; i++) {
    const t = await post(A, '/tokenize', { prompt: toks[i], add_special_tokens: false });
    if (t.json && t.json.count === 1) { pick = i; id = t.json.tokens[0]; }
  }
  if (pick < 0 || toks.some((t) => t.includes('\uFFFD'))) return; // nothing usable in this random model's output
  const first = toks.findIndex((t) => t === toks[pick]);
  const r = await complete({ prompt: 'Stop here', max_tokens: 8, stop_token_ids: [id], ...greedy });
  const c = r.json.choices[0];
  assert.equal(c.finish_reason, 'stop');
  assert.equal(c.stop_reason, id);
  assert.equal(r.json.usage.completion_tokens, first + 1, 'the stop token counts');
  assert.equal(c.text, toks.slice(0, first).join(''), 'its text is not shown');
  // min_tokens delays it
  const m = await complete({ prompt: 'Stop here', max_tokens: 8, stop_token_ids: [id], min_tokens: 8, ...greedy });
  assert.equal(m.json.choices[0].finish_reason, 'length');
});

test('streaming: framing, deltas equal the full text, include_usage, [DONE]', async () => {
  const full = await complete({ prompt: 'Stream this', max_tokens: 12, ...greedy });
  const s = await stream(A, { model: env.model, prompt: 'Stream this', max_tokens: 12, stream_options: { include_usage: true }, ...greedy });
  assert.equal(s.status, 200);
  assert.match(s.headers.get('content-type'), /text\/event-stream/);
  assert.ok(s.wellFormed && s.done, 'every event is "data: ...\\n\\n" and [DONE] is last');
  const usage = s.events.at(-1);
  assert.deepEqual(usage.choices, []);
  assert.equal(usage.usage.completion_tokens, 12);
  assert.equal(usage.usage.prompt_tokens, full.json.usage.prompt_tokens);
  const chunks = s.events.slice(0, -1);
  assert.ok(chunks.length >= 1);
  for (const e of chunks) {
    assert.equal(e.id, chunks[0].id);
    assert.equal(e.created, chunks[0].created);
    assert.equal(e.object, 'text_completion');
    assert.equal(e.choices.length, 1);
    assert.ok(!('usage' in e) || e.usage === null);
  }
  assert.ok(chunks[0].choices[0].text.length > 0 || chunks.length === 1, 'first chunk is not empty');
  assert.equal(chunks.map((e) => e.choices[0].text).join(''), full.json.choices[0].text);
  assert.equal(chunks.at(-1).choices[0].finish_reason, 'length');
  for (const e of chunks.slice(0, -1)) assert.equal(e.choices[0].finish_reason, null);
  // without stream_options: no usage chunk
  const s2 = await stream(A, { model: env.model, prompt: 'Stream this', max_tokens: 3, ...greedy });
  assert.ok(s2.events.every((e) => e.choices.length === 1));
  // n = 2, 2 prompts: indices 0..3 all end
  const s3 = await stream(A, { model: env.model, prompt: ['a', 'b'], n: 2, max_tokens: 3, ...greedy });
  const ends = s3.events.filter((e) => e.choices[0].finish_reason).map((e) => e.choices[0].index).sort();
  assert.deepEqual(ends, [0, 1, 2, 3]);
  // continuous usage stats
  const s4 = await stream(A, { model: env.model, prompt: 'x', max_tokens: 3, stream_options: { include_usage: true, continuous_usage_stats: true }, ...greedy });
  assert.ok(s4.events.every((e) => e.usage && typeof e.usage.total_tokens === 'number'));
  // continuous_usage_stats counts only with include_usage (as vLLM)
  const su = await stream(A, { model: env.model, prompt: 'x', max_tokens: 3, stream_options: { include_usage: false, continuous_usage_stats: true }, ...greedy });
  assert.ok(su.events.every((e) => !e.usage && e.choices.length === 1), JSON.stringify(su.events));
  // echo while streaming: the first chunk starts with the prompt
  const s5 = await stream(A, { model: env.model, prompt: 'Echo', max_tokens: 3, echo: true, ...greedy });
  assert.ok(s5.events[0].choices[0].text.startsWith('Echo'));
});

test('kv_transfer_params, unknown fields, user, model aliases', async () => {
  const r = await complete({ prompt: 'x', max_tokens: 2, kv_transfer_params: { do_remote_decode: true }, user: 'me', no_such_field: [1, { a: 2 }] });
  assert.equal(r.status, 200);
  assert.ok('kv_transfer_params' in r.json);
  const m = await post(A, '/v1/completions', { prompt: 'x', max_tokens: 1 });
  assert.equal(m.status, 200, 'model may be omitted');
  const models = await get(A, '/v1/models');
  for (const card of models.json.data) {
    const x = await post(A, '/v1/completions', { model: card.id, prompt: 'x', max_tokens: 1 });
    assert.equal(x.status, 200);
    assert.equal(x.json.model, models.json.data[0].id, 'the first served name is reported');
  }
});

test('length limits around max_model_len', async () => {
  const models = await get(A, '/v1/models');
  const M = models.json.data[0].max_model_len;
  assert.ok(M > 8);
  const P = 5;
  const ids = Array.from({ length: P }, (_, i) => 100 + i);
  const ok = await complete({ prompt: ids, max_tokens: M - P });
  assert.equal(ok.status, 200);
  const over = await complete({ prompt: ids, max_tokens: M - P + 1 });
  assert.equal(over.status, 400);
  assert.ok(isErrorShape(over.json, 400));
  assert.match(over.json.error.message, /context length/);
  assert.ok(over.json.error.message.includes(String(M)));
  const full = await complete({ prompt: Array(M).fill(100), max_tokens: 1 });
  assert.equal(full.status, 400);
  const big = await complete({ prompt: 'x', max_tokens: M + 1 });
  assert.equal(big.status, 400);
});

test('small endpoints', async () => {
  const h = await get(A, '/health');
  assert.equal(h.status, 200);
  assert.equal(h.text, '');
  const v = await get(A, '/version');
  assert.equal(typeof v.json.version, 'string');
  const m = await get(A, '/v1/models');
  assert.equal(m.json.object, 'list');
  assert.equal(m.json.data[0].object, 'model');
  assert.equal(m.json.data[0].id, env.model);
  const t = await post(A, '/tokenize', { prompt: 'Hello there' });
  assert.equal(t.json.count, t.json.tokens.length);
  const nobos = await post(A, '/tokenize', { prompt: 'Hello there', add_special_tokens: false });
  assert.ok(nobos.json.count <= t.json.count);
  const d = await post(A, '/detokenize', { tokens: nobos.json.tokens });
  assert.equal(d.json.prompt, 'Hello there', 'detokenize(tokenize(x)) == x');
  const chat = await post(A, '/v1/chat/completions', { model: env.model, messages: [{ role: 'user', content: 'hi' }] });
  assert.equal(chat.status, 400);
  assert.match(chat.json.error.message, /chat template/);
  const mt = await metrics(A);
  assert.match(mt.headers.get('content-type'), /text\/plain; version=0\.0\.4/);
  for (const name of ['vllm:num_requests_running', 'vllm:num_requests_waiting', 'vllm:kv_cache_usage_perc',
    'vllm:prompt_tokens_total', 'vllm:generation_tokens_total', 'vllm:time_to_first_token_seconds_bucket',
    'vllm:inter_token_latency_seconds_bucket', 'vllm:e2e_request_latency_seconds_count',
    'vllm:request_time_per_output_token_seconds_sum', 'vllm:request_queue_time_seconds_count',
    'vllm:prefix_cache_queries_total', 'vllm:prefix_cache_hits_total', 'vllm:num_preemptions_total',
    'vllm:request_success_total', 'vllm:request_prompt_tokens_bucket', 'vllm:request_generation_tokens_count',
    'pdserve:prompt_tokens_computed_total']) {
    assert.ok(mt.text.includes(name + '{model_name="' + env.model + '",engine="0"'), name);
  }
});

test('metrics count exactly one request', async () => {
  const before = await metrics(A);
  const r = await complete({ prompt: 'Count me', max_tokens: 7, ...greedy });
  const after = await metrics(A);
  const d = (n, f) => after.sum(n, f) - before.sum(n, f);
  assert.equal(d('vllm:prompt_tokens_total'), r.json.usage.prompt_tokens);
  assert.equal(d('vllm:generation_tokens_total'), 7);
  assert.equal(d('vllm:request_success_total', 'finished_reason="length"'), 1);
  assert.equal(d('vllm:time_to_first_token_seconds_count'), 1);
  assert.equal(d('vllm:e2e_request_latency_seconds_count'), 1);
  assert.equal(d('vllm:request_generation_tokens_sum'), 7);
  assert.equal(d('vllm:inter_token_latency_seconds_count'), 6);
  // Async scheduling is on by default: a greedy request's later steps were
  // queued while the step before still ran.
  assert.ok(d('pdserve:engine_steps_ahead_total') > 0, 'no step was queued ahead under the default flags');
});

test('error codes: 400, 404, 405, 413, and the server keeps serving', async () => {
  const e400 = await complete({ prompt: 'x', temperature: -1 });
  assert.equal(e400.status, 400);
  assert.ok(isErrorShape(e400.json, 400));
  assert.equal(e400.json.error.param, 'temperature');
  const ct = await post(A, '/v1/completions', '{"prompt":"x"}', { raw: true, headers: { 'Content-Type': 'text/plain' } });
  assert.equal(ct.status, 400);
  assert.match(ct.json.error.message, /application\/json/);
  const e404 = await complete({ prompt: 'x', model: 'no-such-model' });
  assert.equal(e404.status, 404);
  assert.ok(isErrorShape(e404.json, 404));
  assert.equal(e404.json.error.type, 'NotFoundError');
  const p404 = await get(A, '/v1/nothing');
  assert.equal(p404.status, 404);
  assert.ok(isErrorShape(p404.json, 404));
  const e405 = await get(A, '/v1/completions');
  assert.equal(e405.status, 405);
  assert.ok(isErrorShape(e405.json, 405));
  const e405b = await post(A, '/health', {});
  assert.equal(e405b.status, 405);
  const huge = '{"prompt":"' + 'a'.repeat(5 << 20) + '"}';
  const e413 = await post(A, '/v1/completions', huge, { raw: true });
  assert.equal(e413.status, 413);
  assert.ok(isErrorShape(e413.json, 413));
  const h = await get(A, '/health');
  assert.equal(h.status, 200);
});

test('401 with --api-key on /v1 only', async () => {
  const B = env.auth;
  const no = await post(B, '/v1/completions', { prompt: 'x', max_tokens: 1 });
  assert.equal(no.status, 401);
  assert.deepEqual(no.json, { error: 'Unauthorized' });
  const wrong = await post(B, '/v1/completions', { prompt: 'x', max_tokens: 1 }, { headers: { Authorization: 'Bearer nope' } });
  assert.equal(wrong.status, 401);
  const scheme = await post(B, '/v1/completions', { prompt: 'x', max_tokens: 1 }, { headers: { Authorization: 'Basic ' + env.apiKey } });
  assert.equal(scheme.status, 401);
  const ok = await post(B, '/v1/completions', { prompt: 'x', max_tokens: 1 }, { headers: { Authorization: 'bearer ' + env.apiKey } });
  assert.equal(ok.status, 200);
  assert.equal((await get(B, '/v1/models')).status, 401);
  assert.equal((await get(B, '/health')).status, 200);
  assert.equal((await get(B, '/metrics')).status, 200);
  assert.equal((await post(B, '/tokenize', { prompt: 'x' })).status, 200);
  const opt = await fetch(B + '/v1/completions', { method: 'OPTIONS' });
  assert.equal(opt.status, 200);
});

test('503 when the waiting queue is full, then recovery', async () => {
  const C = env.busy;
  const reqs = Array.from({ length: 12 }, (_, i) => post(C, '/v1/completions', { prompt: 'busy ' + i, max_tokens: 32, ignore_eos: true }));
  const res = await Promise.all(reqs);
  const codes = res.map((r) => r.status);
  assert.ok(codes.includes(503), 'some request was refused: ' + codes.join(','));
  assert.ok(codes.includes(200), 'some request ran: ' + codes.join(','));
  for (const r of res) if (r.status === 503) assert.ok(isErrorShape(r.json, 503));
  const after = await post(C, '/v1/completions', { prompt: 'later', max_tokens: 2 });
  assert.equal(after.status, 200);
});
