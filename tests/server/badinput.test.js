// Bad-input corpus: malformed requests of every kind each get a 4xx JSON
// error, and the server stays healthy afterwards.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const { env, post, get, rawRequest, isErrorShape } = require('./lib');

const A = env.main;
const json = (o) => JSON.stringify(o);
const big = (n) => 'x'.repeat(n);

// [description, body (string or Buffer), expected status (default 400)]
const corpus = [
  ['empty body', ''],
  ['truncated object', '{"prompt": "hel'],
  ['truncated after key', '{"prompt"'],
  ['truncated array', '{"prompt": [1, 2, 3'],
  ['trailing garbage', '{"prompt": "x"} {"prompt": "y"}'],
  ['just a number', '42'],
  ['just a string', '"prompt"'],
  ['array body', '[{"prompt":"x"}]'],
  ['null body', 'null'],
  ['single quotes', "{'prompt': 'x'}"],
  ['unquoted key', '{prompt: "x"}'],
  ['trailing comma', '{"prompt": "x",}'],
  ['NaN literal', '{"prompt": "x", "temperature": NaN}'],
  ['comment', '{"prompt": "x" /* hi */}'],
  ['lone surrogate escape', '{"prompt": "\\ud800"}'],
  ['bad escape', '{"prompt": "\\q"}'],
  ['invalid UTF-8 bytes in string', Buffer.concat([Buffer.from('{"prompt": "a'), Buffer.from([0xff, 0xfe, 0xc3]), Buffer.from('"}')])],
  ['overlong UTF-8', Buffer.concat([Buffer.from('{"prompt": "'), Buffer.from([0xc0, 0xaf]), Buffer.from('"}')])],
  ['UTF-8 surrogate bytes', Buffer.concat([Buffer.from('{"prompt": "'), Buffer.from([0xed, 0xa0, 0x80]), Buffer.from('"}')])],
  ['binary garbage', Buffer.from(Array.from({ length: 300 }, (_, i) => (i * 37) % 256))],
  ['missing prompt', json({ max_tokens: 3 })],
  ['null prompt', json({ prompt: null })],
  ['empty prompt', json({ prompt: '' })],
  ['empty prompt list', json({ prompt: [] })],
  ['empty inner list', json({ prompt: [[]] })],
  ['negative token id', json({ prompt: [1, -5] })],
  ['float token id', json({ prompt: [1, 2.5] })],
  ['token id out of vocabulary', json({ prompt: [1, 10000000] })],
  ['token id 2^31', json({ prompt: [2147483648] })],
  ['token id huge', json({ prompt: [1e300] })],
  ['mixed prompt list', json({ prompt: ['a', 1] })],
  ['mixed nested list', json({ prompt: [[1], 'a'] })],
  ['nested garbage', json({ prompt: [[[1]]] })],
  ['prompt object', json({ prompt: { text: 'x' } })],
  ['prompt number', json({ prompt: 7 })],
  ['prompt bool', json({ prompt: true })],
  ['1 MB prompt (too long for the model)', json({ prompt: big(1 << 20) })],
  ['1 MB of ids', json({ prompt: Array(200000).fill(5) })],
  ['negative max_tokens', json({ prompt: 'x', max_tokens: -1 })],
  ['zero max_tokens', json({ prompt: 'x', max_tokens: 0 })],
  ['huge max_tokens', json({ prompt: 'x', max_tokens: 1e12 })],
  ['max_tokens 2^31', json({ prompt: 'x', max_tokens: 2147483648 })],
  ['max_tokens over context', json({ prompt: 'x', max_tokens: 1000000 })],
  ['max_tokens string', json({ prompt: 'x', max_tokens: '5' })],
  ['max_tokens float', json({ prompt: 'x', max_tokens: 2.5 })],
  ['huge exponent number', '{"prompt": "x", "max_tokens": 1e999}'],
  ['huge integer literal', '{"prompt": "x", "max_tokens": 123456789012345678901234567890}'],
  ['negative temperature', json({ prompt: 'x', temperature: -0.1 })],
  ['temperature string', json({ prompt: 'x', temperature: 'hot' })],
  ['top_p zero', json({ prompt: 'x', top_p: 0 })],
  ['top_p above 1', json({ prompt: 'x', top_p: 1.0001 })],
  ['top_k -2', json({ prompt: 'x', top_k: -2 })],
  ['min_p 1.5', json({ prompt: 'x', min_p: 1.5 })],
  ['presence_penalty 3', json({ prompt: 'x', presence_penalty: 3 })],
  ['frequency_penalty -3', json({ prompt: 'x', frequency_penalty: -3 })],
  ['repetition_penalty 0', json({ prompt: 'x', repetition_penalty: 0 })],
  ['n zero', json({ prompt: 'x', n: 0 })],
  ['n negative', json({ prompt: 'x', n: -3 })],
  ['n huge', json({ prompt: 'x', n: 1e9 })],
  ['logprobs 21', json({ prompt: 'x', logprobs: 21 })],
  ['logprobs string', json({ prompt: 'x', logprobs: '3' })],
  ['logprobs -5', json({ prompt: 'x', logprobs: -5 })],
  ['stream string', json({ prompt: 'x', stream: 'yes' })],
  ['stream_options without stream', json({ prompt: 'x', stream_options: { include_usage: true } })],
  ['stream_options not an object', json({ prompt: 'x', stream: true, stream_options: 5 })],
  ['empty stop string', json({ prompt: 'x', stop: '' })],
  ['stop list with empty', json({ prompt: 'x', stop: ['a', ''] })],
  ['stop number', json({ prompt: 'x', stop: 5 })],
  ['stop list of numbers', json({ prompt: 'x', stop: [1, 2] })],
  ['stop_token_ids string', json({ prompt: 'x', stop_token_ids: 'a' })],
  ['stop_token_ids negative', json({ prompt: 'x', stop_token_ids: [-1] })],
  ['echo number', json({ prompt: 'x', echo: 1 })],
  ['ignore_eos string', json({ prompt: 'x', ignore_eos: 'true' })],
  ['min_tokens > max_tokens', json({ prompt: 'x', max_tokens: 2, min_tokens: 5 })],
  ['min_tokens negative', json({ prompt: 'x', min_tokens: -1 })],
  ['seed string', json({ prompt: 'x', seed: 'abc' })],
  ['seed too big', json({ prompt: 'x', seed: 1e40 })],
  ['seed 2^63', '{"prompt": "x", "seed": 9223372036854775808}'],
  ['NUL character in the prompt', '{"prompt": "a\\u0000b"}'],
  ['stream_options include_usage number', json({ prompt: 'x', stream: true, stream_options: { include_usage: 3 } })],
  ['model number', json({ prompt: 'x', model: 3 })],
  ['unknown model', json({ prompt: 'x', model: 'gpt-5' }), 404],
  ['kv_transfer_params string', json({ prompt: 'x', kv_transfer_params: 'x' })],
  ['kv_transfer_params array', json({ prompt: 'x', kv_transfer_params: [1] })],
  ['prompt_logprobs with stream', json({ prompt: 'x', prompt_logprobs: 1, stream: true })],
  ['user object', json({ prompt: 'x', user: {} })],
  ['deeply nested', '{"prompt": "x", "extra": ' + '['.repeat(5000) + ']'.repeat(5000) + '}'],
  ['body over the limit', json({ prompt: big(5 << 20) }), 413],
];

test(`bad-input corpus (${corpus.length} requests) gets 4xx JSON errors`, async () => {
  assert.ok(corpus.length >= 50);
  for (const [what, body, want = 400] of corpus) {
    const r = await post(A, '/v1/completions', body, { raw: true });
    assert.equal(r.status, want, `${what}: status ${r.status} ${r.text.slice(0, 200)}`);
    assert.ok(isErrorShape(r.json, want), `${what}: error JSON ${r.text.slice(0, 200)}`);
  }
  assert.equal((await get(A, '/health')).status, 200);
});

test('a NUL character is refused, an escaped backslash before u0000 is not', async () => {
  const r = await post(A, '/v1/completions', '{"prompt": "a\\u0000b"}', { raw: true });
  assert.equal(r.status, 400);
  assert.match(r.json.error.message, /NUL character/);
  const ok = await post(A, '/v1/completions', '{"prompt": "a\\\\u0000b", "max_tokens": 1}', { raw: true });
  assert.equal(ok.status, 200, ok.text);
});

test('an error inside stream_options names the field once, readably', async () => {
  const r = await post(A, '/v1/completions', json({ prompt: 'x', stream: true, stream_options: { include_usage: 3 } }), { raw: true });
  assert.equal(r.status, 400);
  assert.match(r.json.error.message, /^stream_options: include_usage: Input should be a valid boolean/);
});

test('broken HTTP on raw sockets does not hurt the server', async () => {
  const u = new URL(A);
  // a body shorter than its Content-Length, then the client goes away
  await rawRequest(A, `POST /v1/completions HTTP/1.1\r\nHost: ${u.host}\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"prompt":`, { closeAfterMs: 100 });
  // garbage instead of HTTP
  await rawRequest(A, 'HELLO THERE\r\n\r\n', { closeAfterMs: 200 });
  // headers that never end
  await rawRequest(A, 'GET /health HTTP/1.1\r\nX-A: ' + 'a'.repeat(100000), { closeAfterMs: 200 });
  // bad tokenize / detokenize bodies
  for (const b of ['{', json({ prompt: 5 }), json({ tokens: 'x' }), json({ tokens: [-1] }), json({ tokens: [1e12] })]) {
    const t = await post(A, b.includes('tokens') ? '/detokenize' : '/tokenize', b, { raw: true });
    assert.equal(t.status, 400, b);
    assert.ok(isErrorShape(t.json, 400));
  }
  // half a UTF-16 surrogate pair is named as such; a whole pair, or an
  // escaped backslash before "ud800", is fine
  const lone = await post(A, '/v1/completions', '{"prompt":"a\\ud800b","max_tokens":1}', { raw: true });
  assert.equal(lone.status, 400, lone.text);
  assert.match(lone.json.error.message, /\\ud800 at byte 12 is half of a UTF-16 surrogate pair/);
  for (const ok of ['{"prompt":"a\\ud83d\\ude00b","max_tokens":1}', '{"prompt":"a\\\\ud800b","max_tokens":1}']) {
    const r = await post(A, '/v1/completions', ok, { raw: true });
    assert.equal(r.status, 200, `${ok}: ${r.text}`);
  }
  const nested = await post(A, '/detokenize', { tokens: [[1]] });
  assert.equal(nested.status, 400);
  assert.match(nested.json.error.message, /tokens\[0\] must be an integer/);
  const r = await post(A, '/v1/completions', { prompt: 'still fine', max_tokens: 2 });
  assert.equal(r.status, 200);
  assert.equal((await get(A, '/health')).status, 200);
});
