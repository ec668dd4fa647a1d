// disagg.test.js: the proxy's three hops, played by hand against real
// pdserve processes started by test_disagg.sh:
//   1. prefill P: the prompt with max_tokens 1 and
//      kv_transfer_params {remote_kv_addr: D's KV address} (nothing else);
//   2. read back P's kv_transfer_params;
//   3. decode D: the original request plus those params, unchanged.
// D's greedy output must equal a colocated instance's, for every send type,
// streaming and not; D must compute only the last prompt token; faults must
// fail cleanly and leave every instance serving.
'use strict';
const test = require('node:test');
const assert = require('node:assert');
const http = require('../common/http');

const { parseSSE, stream, metrics, pool } = http;

const E = process.env;
const COLO = E.URL_colo;
const MAX_TOKENS = 8;

// Every request here is a completion.
const post = (base, body) => http.post(base, '/v1/completions', body);

// The text of a streamed completion; an error event throws.
function sseText(body) {
  const s = parseSSE(body);
  let text = '';
  for (const j of s.events) {
    if (j.error) throw new Error('stream error: ' + j.error.message);
    for (const c of j.choices) text += c.text;
  }
  assert.ok(s.done, 'stream ends with [DONE]');
  return text;
}

// Prompts as token ids so lengths are exact: 1 token, around block
// boundaries of every block size used (8, 16, 32), and near max_model_len
// (256 - MAX_TOKENS).
function makePrompts() {
  let seed = 12345;
  const rnd = (n) => { seed = (seed * 1103515245 + 12345) % 2147483648; return seed % n; };
  const lens = [1, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 95, 96, 97, 127, 128, 129,
    200, 239, 240, 247, 248];
  while (lens.length < 104) lens.push(1 + rnd(248));
  return lens.map((n, i) => {
    const p = [];
    for (let k = 0; k < n; k++) p.push(k === 0 && i % 3 ? 50256 : rnd(50257));
    return p;
  });
}
const PROMPTS = makePrompts();
// Prompts with KV to move (a 1-token prompt has none: decode computes it).
const LONG = PROMPTS.filter((p) => p.length >= 16);

async function reference(prompt) {
  const r = await post(COLO, { prompt, max_tokens: MAX_TOKENS, temperature: 0, ignore_eos: true });
  assert.equal(r.status, 200, r.text);
  return r.json.choices[0].text;
}

// The three hops. Returns D's text.
async function disagg(P, D, dKv, prompt, streaming) {
  const pre = await post(P, { prompt, max_tokens: 1, temperature: 0, kv_transfer_params: { remote_kv_addr: dKv } });
  assert.equal(pre.status, 200, `prefill: ${pre.text}`);
  const kv = pre.json.kv_transfer_params;
  assert.ok(kv && typeof kv.remote_request_id === 'string' && typeof kv.remote_kv_addr === 'string',
    `prefill returned kv_transfer_params: ${JSON.stringify(kv)}`);
  assert.equal(kv.num_tokens, prompt.length);
  const body = { prompt, max_tokens: MAX_TOKENS, temperature: 0, ignore_eos: true, kv_transfer_params: kv };
  if (streaming) {
    const r = await stream(D, body);
    assert.equal(r.status, 200, r.text);
    return sseText(r.text);
  }
  const dec = await post(D, body);
  assert.equal(dec.status, 200, `decode: ${dec.text}`);
  return dec.json.choices[0].text;
}

let REF;
test.before(async () => { REF = await pool(PROMPTS, 8, reference); });

for (const st of ['PUT', 'PUT_ASYNC', 'GET']) {
  test(`${st}: ${PROMPTS.length} prompts, streaming and not, equal the colocated output; D skips the prompt`, async () => {
    const P = E[`URL_p_${st}`], D = E[`URL_d_${st}`], dKv = E[`KV_d_${st}`];
    const m0 = await metrics(D);
    const got = await pool(PROMPTS, 8, (p, i) => disagg(P, D, dKv, p, i % 2 === 1));
    for (let i = 0; i < PROMPTS.length; i++)
      assert.equal(got[i], REF[i], `${st} prompt ${i} (${PROMPTS[i].length} tokens, ${i % 2 ? 'streaming' : 'not streaming'})`);
    const m1 = await metrics(D);
    const computed = m1.sum('pdserve:prompt_tokens_computed_total') - m0.sum('pdserve:prompt_tokens_computed_total');
    const prompt = m1.sum('vllm:prompt_tokens_total') - m0.sum('vllm:prompt_tokens_total');
    const total = PROMPTS.reduce((a, p) => a + p.length, 0);
    assert.equal(prompt, total, 'D counts every prompt token');
    assert.equal(computed, PROMPTS.length, 'D computed only the last token of each prompt');
    assert.ok(m1.sum('pdserve:kv_loads_total', 'result="ok"') - m0.sum('pdserve:kv_loads_total', 'result="ok"') >=
      PROMPTS.filter((p) => p.length > 1).length, 'D loaded remote KV');
  });
}

test('32 concurrent disaggregated requests: no loss, no cross-talk', async () => {
  const idx = Array.from({ length: 32 }, (_, i) => 30 + i);
  const got = await Promise.all(idx.map((i) => disagg(E.URL_p_PUT_ASYNC, E.URL_d_PUT_ASYNC, E.KV_d_PUT_ASYNC, PROMPTS[i], i % 2 === 0)));
  idx.forEach((i, k) => assert.equal(got[k], REF[i], `concurrent prompt ${i}`));
});

test('malformed kv_transfer_params get 400 on both sides', async () => {
  const bad = [
    'not an object', [1, 2], { remote_kv_addr: 5 }, { remote_kv_addr: 'no-port' }, { remote_kv_addr: 'h:99999' },
    { remote_request_id: 7, remote_kv_addr: '127.0.0.1:1' }, { remote_request_id: 'x' },
    { do_remote_decode: 'yes', remote_kv_addr: '127.0.0.1:1' }, { num_tokens: -3, remote_kv_addr: '127.0.0.1:1' },
    { do_remote_decode: true }, { do_remote_prefill: true, remote_kv_addr: '127.0.0.1:1' },
  ];
  for (const base of [E.URL_p_PUT, E.URL_d_PUT]) {
    for (const kv of bad) {
      const r = await post(base, { prompt: 'x', max_tokens: 2, kv_transfer_params: kv });
      assert.equal(r.status, 400, `${JSON.stringify(kv)} -> ${r.status} ${r.text}`);
      assert.ok(r.json && r.json.error && r.json.error.message, r.text);
    }
  }
  // A streamed prefill request could not hand its kv_transfer_params on.
  const st = await post(E.URL_p_PUT, { prompt: 'x', max_tokens: 1, stream: true, kv_transfer_params: { do_remote_decode: true, remote_kv_addr: E.KV_d_PUT } });
  assert.equal(st.status, 400, st.text);
  assert.match(st.json.error.message, /needs stream false/);
  // And after them, a disaggregated request goes through as before.
  assert.equal(await disagg(E.URL_p_PUT, E.URL_d_PUT, E.KV_d_PUT, PROMPTS[5], false), REF[5]);
});

async function stillServes(base) {
  const r = await post(base, { prompt: [50256, 10, 20], max_tokens: 3, temperature: 0 });
  assert.equal(r.status, 200, r.text);
}

test('prefill gone: decode fails that request by its deadline with a JSON error and keeps serving', async () => {
  // A transfer the (dead or never-sending) prefill will never deliver.
  const t0 = Date.now();
  const r = await post(E.URL_d_fault, {
    prompt: LONG[0], max_tokens: 4, kv_transfer_params: {
      do_remote_prefill: true, remote_kv_addr: '127.0.0.1:9', remote_request_id: 'xfer-never-sent-1', num_tokens: LONG[0].length,
    },
  });
  const dt = Date.now() - t0;
  assert.equal(r.status, 504, r.text);
  assert.match(r.json.error.message, /timed out/);
  assert.equal(r.json.error.type, 'GatewayTimeoutError');
  assert.ok(dt >= 1500 && dt < 6000, `failed after ${dt} ms with a 2 s deadline`);
  await stillServes(E.URL_d_fault);
  // GET mode pulls from a prefill that is not there: fails by the deadline too.
  const g = await post(E.URL_d_GET, {
    prompt: LONG[1], max_tokens: 4, kv_transfer_params: { remote_kv_addr: '127.0.0.1:9', remote_request_id: 'xfer-nobody-2' },
  });
  assert.ok(g.status >= 500 && g.status < 600 && g.json && g.json.error, g.text);
  await stillServes(E.URL_d_GET);
});

test(
    'kv_load_failure_policy recompute: KV that never comes is computed here, the output as colocated',
    async () => {
        const i = PROMPTS.findIndex((p) => p.length >= 40);
        const m0 = await metrics(E.URL_d_recompute);
        const t0 = Date.now();
        const r = await post(E.URL_d_recompute, {
            prompt : PROMPTS[i],
            max_tokens : MAX_TOKENS,
            temperature : 0,
            ignore_eos : true,
            kv_transfer_params : {
                do_remote_prefill : true,
                remote_kv_addr : '127.0.0.1:9',
                remote_request_id : 'xfer-never-sent-3',
                num_tokens : PROMPTS[i].length,
            },
        });
        const dt = Date.now() - t0;
        assert.equal(r.status, 200, r.text);
        assert.equal(r.json.choices[0].text, REF[i],
                     'computed here, as the colocated instance does');
        assert.ok(dt >= 1500, `gave up on the KV after ${dt} ms with a 2 s deadline`);
        const m1 = await metrics(E.URL_d_recompute);
        const d = (name, label) => m1.sum(name, label) - m0.sum(name, label);
        assert.equal(d('pdserve:prompt_tokens_computed_total'), PROMPTS[i].length,
                     'the whole prompt computed here');
        assert.equal(d('pdserve:kv_loads_total', 'result="failed"'), 1,
                     'the failed load is counted');
        // KV that does come is still used: one prompt token computed.
        const j = i + 1;
        const n0 = (await metrics(E.URL_d_recompute)).sum('pdserve:prompt_tokens_computed_total');
        assert.equal(
            await disagg(E.URL_p_fault, E.URL_d_recompute, E.KV_d_recompute, PROMPTS[j], false),
            REF[j]);
        const n1 = (await metrics(E.URL_d_recompute)).sum('pdserve:prompt_tokens_computed_total');
        assert.equal(n1 - n0, 1, 'with its KV, only the last prompt token computed');
    });

test('prefill killed after answering, its KV not yet pulled: decode fails by the deadline, keeps serving', async () => {
  const prompt = LONG[2];
  const pre = await post(E.URL_pg_kill, { prompt, max_tokens: 1, temperature: 0, kv_transfer_params: { remote_kv_addr: E.KV_dg_fault } });
  assert.equal(pre.status, 200, pre.text);
  process.kill(Number(E.PID_pg_kill), 'SIGKILL');
  await new Promise((r) => setTimeout(r, 200));
  const t0 = Date.now();
  const dec = await post(E.URL_dg_fault, { prompt, max_tokens: 4, kv_transfer_params: pre.json.kv_transfer_params });
  const dt = Date.now() - t0;
  assert.ok(dec.status >= 500 && dec.status < 600 && dec.json && dec.json.error, dec.text);
  assert.ok(dt < 6000, `failed after ${dt} ms with a 2 s deadline`);
  await stillServes(E.URL_dg_fault);
  const m = await metrics(E.URL_dg_fault);
  assert.equal(m.sum('pdserve:kv_buffered_bytes'), 0);
});

test('decode killed while KV is in flight: prefill stays healthy and frees the send', async () => {
  process.kill(Number(E.PID_d_kill), 'SIGKILL');
  await new Promise((r) => setTimeout(r, 200));
  const m0 = await metrics(E.URL_pa_fault);
  const pre = await post(E.URL_pa_fault, { prompt: PROMPTS[50], max_tokens: 1, kv_transfer_params: { remote_kv_addr: E.KV_d_kill } });
  assert.equal(pre.status, 200, pre.text); // PUT_ASYNC answers at once; the send fails behind it
  let failed = false;
  for (let i = 0; i < 60 && !failed; i++) {
    await new Promise((r) => setTimeout(r, 100));
    const m = await metrics(E.URL_pa_fault);
    failed = m.sum('pdserve:kv_sends_total', 'result="failed"') > m0.sum('pdserve:kv_sends_total', 'result="failed"') &&
      m.sum('pdserve:kv_buffered_bytes') === 0;
  }
  assert.ok(failed, 'the send to the dead decode failed and its buffer was freed');
  await stillServes(E.URL_pa_fault);
  // The synchronous PUT to a dead decode answers with a clear 5xx JSON error.
  const put = await post(E.URL_p_fault, { prompt: PROMPTS[51], max_tokens: 1, kv_transfer_params: { remote_kv_addr: E.KV_d_kill } });
  assert.ok(put.status >= 500 && put.json && put.json.error, put.text);
  await stillServes(E.URL_p_fault);
});

test('kv buffer too small for one request: clear error, nothing leaks, next request works', async () => {
  const pre = await post(E.URL_p_fault, { prompt: PROMPTS[60], max_tokens: 1, kv_transfer_params: { remote_kv_addr: E.KV_d_small } });
  assert.ok(pre.status >= 500 && pre.json && pre.json.error, pre.text);
  assert.match(pre.json.error.message, /kv_buffer_size/);
  // param tells a proxy that the decode side could not take the KV (docs/protocol.md)
  assert.equal(pre.status, 502, pre.text);
  assert.equal(pre.json.error.param, 'kv_transfer_params', pre.text);
  assert.equal(pre.json.error.type, 'BadGatewayError');
  const m = await metrics(E.URL_d_small);
  assert.equal(m.sum('pdserve:kv_buffered_bytes'), 0);
  await stillServes(E.URL_p_fault);
  await stillServes(E.URL_d_small);
  // And the same producer still works with a consumer that has room.
  const text = await disagg(E.URL_p_fault, E.URL_d_fault, E.KV_d_fault, PROMPTS[61], false);
  assert.equal(text, REF[61]);
});
