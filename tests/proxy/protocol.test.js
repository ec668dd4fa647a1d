// The proxy's side of docs/protocol.md and its failure handling, checked
// against fake prefill/decode instances (small Node HTTP servers that record
// what they receive and misbehave on request): the exact hop bodies and
// headers, SSE relayed as it arrives, prefill retry, 502/503/504 JSON errors
// naming the instance, cancellation on client disconnect, --api-key.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const http = require('node:http');
const net = require('node:net');
const fs = require('node:fs');
const { post, get, parseSSE, isErrorShape, startProxy, stopProc, sleep, waitFor, metrics } = require('./lib');

// A fake instance. mode(): 'ok' | 'null' | 'fail500' | 'hang' | 'break' | 'forever' | 'slow'
function fake(name) {
  const f = { name, mode: 'ok', got: [], closed: [], sentAt: [], n: 0 };
  f.server = http.createServer((req, res) => {
    let body = '';
    req.on('data', (d) => { body += d; });
    req.on('end', () => {
      const n = ++f.n;
      const rec = { path: req.url, headers: req.headers, body, json: JSON.parse(body || 'null'), closedAt: 0 };
      f.got.push(rec);
      res.on('close', () => { rec.closedAt = Date.now(); f.closed.push(rec); });
      const mode = f.mode;
      if (mode === 'hang') return; // never answers
      if (mode === 'fail500') {
        res.writeHead(500, { 'Content-Type': 'application/json' });
        return res.end(JSON.stringify({ error: { message: 'engine exploded', type: 'InternalServerError', param: null, code: 500 } }));
      }
      if (mode === 'kvfail') { // as a pdserve prefill answers when D cannot take the KV
        res.writeHead(502, { 'Content-Type': 'application/json' });
        return res.end(JSON.stringify({ error: { message: 'generation failed: consumer 127.0.0.1:7777 has no room', type: 'BadGatewayError', param: 'kv_transfer_params', code: 502 } }));
      }
      if (mode === 'huge' && !(rec.json && rec.json.max_tokens === 1)) { // a decode answer over 64 MiB
        res.writeHead(200, { 'Content-Type': 'application/json' });
        return res.end(JSON.stringify({ choices: [{ index: 0, text: 'x'.repeat(65 << 20) }] }));
      }
      if (mode === 'fail503') { // as a draining pdserve answers
        res.writeHead(503, { 'Content-Type': 'application/json' });
        return res.end(JSON.stringify({ error: { message: 'the server is shutting down', type: 'ServiceUnavailableError', param: null, code: 503 } }));
      }
      if (rec.json && rec.json.stream) { // a decode stream
        res.writeHead(200, { 'Content-Type': 'text/event-stream' });
        const ev = (i, fin) => `data: ${JSON.stringify({ object: 'text_completion', choices: [{ index: 0, text: ` t${i}`, finish_reason: fin ? 'length' : null }] })}\n\n`;
        let i = 0;
        const tick = () => {
          if (res.destroyed) return;
          f.sentAt.push(Date.now());
          if (mode === 'break' && i === 2) return res.socket.destroy();
          if (mode !== 'forever' && i === 3) { res.write(ev(i, true)); return res.end('data: [DONE]\n\n'); }
          res.write(ev(i++, false));
          setTimeout(tick, mode === 'slow' ? 400 : mode === 'forever' ? 100 : 5);
        };
        return tick();
      }
      const kv = mode === 'null' ? null : { do_remote_prefill: true, remote_kv_addr: '127.0.0.1:7777', remote_request_id: `${name}-xfer-${n}`, num_tokens: 3 };
      res.writeHead(200, { 'Content-Type': 'application/json' });
      res.end(JSON.stringify({ id: `cmpl-${name}-${n}`, object: 'text_completion', choices: [{ index: 0, text: ` from ${name}`, finish_reason: 'length' }], usage: { prompt_tokens: 3, completion_tokens: 1, total_tokens: 4 }, kv_transfer_params: kv }));
    });
  });
  return new Promise((resolve) => f.server.listen(0, '127.0.0.1', () => {
    f.addr = `127.0.0.1:${f.server.address().port}`;
    resolve(f);
  }));
}

let pA, pB, dA, px;
test.before(async () => {
  pA = await fake('pA');
  pB = await fake('pB');
  dA = await fake('dA');
  px = await startProxy(['--discovery-port', '0', '--prefill', `${pA.addr},127.0.0.1:7001`, pB.addr,
    '--decode', `${dA.addr},127.0.0.1:7002`, '--timeout', '2', '--failure-backoff', '0.3',
    '--upstream-api-key', 'up-key'], 'proxy-fake');
});
test.after(async () => {
  await px.stop();
  for (const f of [pA, pB, dA]) { f.server.closeAllConnections(); f.server.close(); }
});
const reset = () => { for (const f of [pA, pB, dA]) { f.mode = 'ok'; f.got = []; f.closed = []; f.sentAt = []; } };

test('the three hops: prefill body, decode body, headers, stream relayed intact', async () => {
  reset();
  const client = { model: 'm', prompt: 'Hi there', max_tokens: 5, stream: true, stream_options: { include_usage: true }, min_tokens: 2, seed: 5, temperature: 0 };
  const raw = JSON.stringify(client);
  const r = await post(px.url, '/v1/completions', raw, { headers: { 'X-Request-Id': 'my-id-1', Authorization: 'Bearer client-key' } });
  assert.equal(r.status, 200, r.text);
  assert.equal(r.headers.get('x-request-id'), 'my-id-1');
  const p = [...pA.got, ...pB.got];
  assert.equal(p.length, 1);
  const pj = p[0].json;
  assert.equal(p[0].path, '/v1/completions');
  assert.equal(pj.max_tokens, 1);
  assert.equal(pj.stream, false);
  assert.ok(!('stream_options' in pj) && !('min_tokens' in pj));
  assert.deepEqual(pj.kv_transfer_params, { do_remote_decode: true, remote_kv_addr: '127.0.0.1:7002' });
  for (const k of ['model', 'prompt', 'seed', 'temperature']) assert.deepEqual(pj[k], client[k]);
  assert.equal(p[0].headers['x-request-id'], 'my-id-1');
  assert.equal(p[0].headers.authorization, 'Bearer up-key');
  assert.equal(dA.got.length, 1);
  const d = dA.got[0];
  const pf = pA.got.length ? pA : pB;
  const prefillAnswer = { do_remote_prefill: true, remote_kv_addr: '127.0.0.1:7777', remote_request_id: `${pf.name}-xfer-${pf.n}`, num_tokens: 3 };
  assert.deepEqual(d.json, { ...client, kv_transfer_params: prefillAnswer });
  assert.ok(d.body.startsWith(raw.slice(0, -1)), 'the decode body keeps the client bytes');
  assert.equal(d.headers['x-request-id'], 'my-id-1');
  const s = parseSSE(r.text);
  assert.ok(s.wellFormed && s.done);
  assert.deepEqual(s.events.map((e) => e.choices[0].text), [' t0', ' t1', ' t2', ' t3']);
});

test('prefill without kv_transfer_params: decode gets the original body, byte for byte', async () => {
  reset();
  pA.mode = pB.mode = 'null';
  const raw = '{"model":"m", "prompt":"x",  "max_tokens":3}';
  const r = await post(px.url, '/v1/completions', raw);
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.choices[0].text, ' from dA');
  assert.equal(dA.got[0].body, raw);
});

test('SSE chunks are forwarded as they arrive', async () => {
  reset();
  dA.mode = 'slow';
  const res = await fetch(px.url + '/v1/completions', { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ prompt: 'x', stream: true }) });
  assert.equal(res.status, 200);
  const reader = res.body.getReader();
  const first = await reader.read();
  const firstAt = Date.now();
  assert.ok(new TextDecoder().decode(first.value).includes(' t0'));
  while (!(await reader.read()).done) { /* drain */ }
  assert.equal(dA.sentAt.length, 4);
  assert.ok(firstAt < dA.sentAt[1], `first chunk reached the client at ${firstAt}, after the second was sent at ${dA.sentAt[1]}`);
});

test('a failed prefill is retried once on the other instance; both failing is a 502 naming them', async () => {
  reset();
  pA.mode = 'fail500';
  const before = (await metrics(px.url)).sum('pdproxy_prefill_retries_total');
  let ok = 0;
  for (let i = 0; i < 6 && pA.got.length === 0; i++) {
    const r = await post(px.url, '/v1/completions', { prompt: 'x', max_tokens: 2 });
    assert.equal(r.status, 200, r.text);
    ok++;
  }
  assert.ok(pA.got.length >= 1 && pB.got.length >= 1);
  assert.ok((await metrics(px.url)).sum('pdproxy_prefill_retries_total') >= before + 1);
  pB.mode = 'fail500';
  await sleep(350); // past the backoff
  const r = await post(px.url, '/v1/completions', { prompt: 'x', max_tokens: 2 });
  assert.equal(r.status, 502);
  assert.ok(isErrorShape(r.json, 502), r.text);
  assert.match(r.json.error.message, /prefill instance 127\.0\.0\.1:\d+ answered HTTP 500: engine exploded/);
  assert.equal(dA.got.length, ok); // decode only after a good prefill
});

test('a prefill that could not hand the KV to decode: 502 naming both, no retry, decode backed off', async () => {
  await sleep(350);
  reset();
  pA.mode = pB.mode = 'kvfail';
  const r = await post(px.url, '/v1/completions', { prompt: 'x', max_tokens: 2 });
  assert.equal(r.status, 502, r.text);
  assert.ok(isErrorShape(r.json, 502));
  assert.match(r.json.error.message, new RegExp(`could not hand the KV to decode instance ${dA.addr}: generation failed: consumer .* has no room`));
  assert.equal(pA.got.length + pB.got.length, 1, 'not retried on the other prefill instance');
  assert.equal(dA.got.length, 0);
  const h = await get(px.url, '/health');
  assert.ok(h.json.decode.some((d) => d.http_address === dA.addr && d.backoff), h.text);
  assert.ok(h.json.prefill.every((p) => !p.backoff), h.text);
  await sleep(350);
});

test('a whole decode answer over the 64 MiB limit: 502 saying so, the instance not backed off', async () => {
  await sleep(350);
  reset();
  dA.mode = 'huge';
  const r = await post(px.url, '/v1/completions', { prompt: 'x' });
  assert.equal(r.status, 502, r.text.slice(0, 300));
  assert.match(r.json.error.message, /more than \d+ bytes.*use stream true/);
  const h = await get(px.url, '/health');
  assert.ok(h.json.decode.every((d) => !d.backoff), h.text);
});

test('a body with data after its JSON object is a 400 before any prefill', async () => {
  reset();
  const r = await post(px.url, '/v1/completions', '{"prompt": "x", "max_tokens": 2}}');
  assert.equal(r.status, 400, r.text);
  assert.ok(isErrorShape(r.json, 400));
  assert.match(r.json.error.message, /data after its JSON object/);
  assert.equal(pA.got.length + pB.got.length, 0);
  const ok = await post(px.url, '/v1/completions', '{"prompt": "x", "max_tokens": 2}\n');
  assert.equal(ok.status, 200, ok.text);
});

test('a decode 503 (draining) is relayed and the instance backed off', async () => {
  await sleep(350);
  reset();
  const before = (await metrics(px.url)).sum('pdproxy_instance_errors_total', `instance="${dA.addr}"`);
  dA.mode = 'fail503';
  const r = await post(px.url, '/v1/completions', { prompt: 'x' });
  assert.equal(r.status, 503);
  assert.ok(isErrorShape(r.json, 503));
  assert.match(r.json.error.message, /shutting down/);
  const h = await get(px.url, '/health');
  assert.ok(h.json.decode.some((d) => d.http_address === dA.addr && d.backoff), h.text);
  assert.equal((await metrics(px.url)).sum('pdproxy_instance_errors_total', `instance="${dA.addr}"`), before + 1);
  await sleep(350);
});

test('SIGTERM: a kept-alive connection gets 503 with Connection: close, /health says draining', async () => {
  reset();
  const d = await startProxy(['--discovery-port', '0', '--prefill', pA.addr, '--decode', dA.addr,
    '--timeout', '5', '--shutdown-timeout', '4'], 'proxy-drain');
  const sock = net.connect(Number(new URL(d.url).port), '127.0.0.1');
  let buf = '';
  sock.on('data', (x) => { buf += x.toString('latin1'); });
  sock.on('error', () => {});
  await new Promise((resolve) => sock.once('connect', resolve));
  const raw = (path, body) => (body === undefined
    ? `GET ${path} HTTP/1.1\r\nHost: t\r\n\r\n`
    : `POST ${path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`);
  sock.write(raw('/v1/completions', JSON.stringify({ prompt: 'x', max_tokens: 2 })));
  assert.ok(await waitFor(() => buf.includes('from dA'), 3000), buf);
  assert.match(buf, /^HTTP\/1\.1 200/);
  // a slow stream on another connection keeps the drain going
  dA.mode = 'slow';
  const slow = fetch(d.url + '/v1/completions', { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ prompt: 'x', stream: true }) })
    .then((res) => res.text()).catch(() => null);
  assert.ok(await waitFor(() => dA.got.length >= 2, 3000));
  d.proc.kill('SIGTERM');
  assert.ok(await waitFor(() => fs.readFileSync(d.log, 'utf8').includes('stopping'), 3000));
  buf = '';
  sock.write(raw('/health'));
  assert.ok(await waitFor(() => buf.includes('"draining"'), 3000), buf);
  assert.match(buf, /^HTTP\/1\.1 503/);
  buf = '';
  sock.write(raw('/v1/completions', JSON.stringify({ prompt: 'x' })));
  assert.ok(await waitFor(() => buf.includes('shutting down'), 3000), buf);
  assert.match(buf, /^HTTP\/1\.1 503/);
  assert.match(buf, /\r\nconnection: close\r\n/i);
  const text = await slow; // the stream in flight still ends whole
  assert.ok(text && text.includes('[DONE]'), text);
  sock.destroy();
  assert.equal(await stopProc(d.proc), 0);
});

test('timeouts: a prefill that never answers is a 504 within the deadline', async () => {
  reset();
  pA.mode = pB.mode = 'hang';
  const t0 = Date.now();
  const r = await post(px.url, '/v1/completions', { prompt: 'x' });
  const dt = Date.now() - t0;
  assert.equal(r.status, 504, r.text);
  assert.ok(isErrorShape(r.json, 504));
  assert.match(r.json.error.message, /prefill instance 127\.0\.0\.1:\d+ did not answer/);
  assert.ok(dt >= 1800 && dt < 3500, `took ${dt} ms with --timeout 2`);
  await waitFor(() => pA.closed.length + pB.closed.length >= 1, 2000);
});

test('decode failures: its 5xx relayed naming it; a stream broken midway ends with an error event', async () => {
  reset();
  dA.mode = 'fail500';
  let r = await post(px.url, '/v1/completions', { prompt: 'x' });
  assert.equal(r.status, 500);
  assert.ok(isErrorShape(r.json, 500));
  assert.match(r.json.error.message, new RegExp(`^decode instance ${dA.addr}: engine exploded`));
  await sleep(350);
  reset();
  dA.mode = 'break';
  r = await post(px.url, '/v1/completions', { prompt: 'x', stream: true });
  assert.equal(r.status, 200);
  const s = parseSSE(r.text);
  assert.ok(s.wellFormed && s.done, r.text);
  const err = s.events.find((e) => e.error);
  assert.ok(isErrorShape(err, 502), r.text);
  assert.ok(err.error.message.includes(dA.addr));
  assert.deepEqual(s.events.filter((e) => e.choices).map((e) => e.choices[0].text), [' t0', ' t1']);
  const m = await metrics(px.url);
  assert.ok(m.sum('pdproxy_instance_errors_total', `instance="${dA.addr}"`) >= 1);
});

test('a client that goes away cancels the upstream request (prefill and decode)', async () => {
  await sleep(350);
  reset();
  dA.mode = 'forever';
  const ac = new AbortController();
  const res = await fetch(px.url + '/v1/completions', { method: 'POST', signal: ac.signal, headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ prompt: 'x', stream: true }) });
  const reader = res.body.getReader();
  await reader.read();
  const t0 = Date.now();
  ac.abort();
  assert.ok(await waitFor(() => dA.closed.length === 1, 3000), 'decode request not cancelled');
  assert.ok(dA.closed[0].closedAt - t0 < 1500);
  const sent = dA.sentAt.length;
  await sleep(300);
  assert.equal(dA.sentAt.length, sent, 'the fake decode kept streaming');
  reset();
  pA.mode = pB.mode = 'hang';
  const ac2 = new AbortController();
  const p = fetch(px.url + '/v1/completions', { method: 'POST', signal: ac2.signal, headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ prompt: 'x' }) }).catch(() => null);
  assert.ok(await waitFor(() => pA.got.length + pB.got.length === 1, 2000));
  ac2.abort();
  await p;
  assert.ok(await waitFor(() => pA.closed.length + pB.closed.length === 1, 1500), 'prefill request not cancelled');
  assert.equal(dA.got.length, 0);
  assert.ok(await waitFor(async () => (await metrics(px.url)).sum('pdproxy_requests_total', 'status="499"') >= 2, 3000));
});

test('no live instance is a 503; a dead static decode is a 502 naming it; front errors', async () => {
  const empty = await startProxy(['--discovery-port', '0'], 'proxy-empty');
  let r = await post(empty.url, '/v1/completions', { prompt: 'x' });
  assert.equal(r.status, 503);
  assert.ok(isErrorShape(r.json, 503));
  assert.match(r.json.error.message, /no decode instance/);
  assert.equal((await get(empty.url, '/health')).status, 503);
  assert.equal((await get(empty.url, '/v1/models')).status, 503);
  await empty.stop();
  reset();
  const dead = await startProxy(['--discovery-port', '0', '--prefill', pA.addr, '--decode', '127.0.0.1:1'], 'proxy-dead');
  r = await post(dead.url, '/v1/completions', { prompt: 'x' });
  assert.equal(r.status, 502);
  assert.ok(isErrorShape(r.json, 502));
  assert.match(r.json.error.message, /decode instance 127\.0\.0\.1:1 failed: connect failed/);
  r = await post(dead.url, '/v1/completions', '{"prompt": ');
  assert.equal(r.status, 400);
  assert.ok(isErrorShape(r.json, 400));
  assert.equal((await get(dead.url, '/v1/completions')).status, 405);
  assert.equal((await get(dead.url, '/nope')).status, 404);
  // Each completion request counts once by its final status, also those
  // refused before the flow (405); other paths are not client requests.
  const m = await metrics(dead.url);
  for (const [code, n] of [[502, 1], [400, 1], [405, 1], [404, 0]])
    assert.equal(m.sum('pdproxy_requests_total', `status="${code}"`), n, `status ${code}`);
  assert.equal(m.sum('pdproxy_request_duration_seconds_count'), 2); // the 405 was not served
  await dead.stop();
});

test('--api-key guards /v1 on the front and is not passed on', async () => {
  reset();
  const k = await startProxy(['--discovery-port', '0', '--prefill', pA.addr, '--decode', dA.addr, '--api-key', 'sekrit'], 'proxy-key');
  let r = await post(k.url, '/v1/completions', { prompt: 'x' });
  assert.equal(r.status, 401);
  assert.ok(isErrorShape(r.json, 401));
  r = await post(k.url, '/v1/completions', { prompt: 'x' }, { headers: { Authorization: 'Bearer wrong' } });
  assert.equal(r.status, 401);
  r = await post(k.url, '/v1/completions', { prompt: 'x' }, { headers: { Authorization: 'Bearer sekrit' } });
  assert.equal(r.status, 200, r.text);
  assert.equal(pA.got[0].headers.authorization, undefined);
  assert.equal((await get(k.url, '/health')).status, 200);
  const m = await metrics(k.url);
  assert.equal(m.sum('pdproxy_requests_total', 'status="401"'), 2);
  assert.equal(m.sum('pdproxy_requests_total', 'status="200"'), 1);
  await k.stop();
});
