// The official OpenAI Node SDK against the proxy.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const OpenAI = require('openai');
const { env } = require('./lib');

test('OpenAI SDK through the proxy: create, stream, models, errors', async () => {
  const client = new OpenAI({ baseURL: env.one + '/v1', apiKey: 'unused' });
  const direct = new OpenAI({ baseURL: env.ref + '/v1', apiKey: 'unused' });
  const req = { model: env.model, prompt: 'Hello, my name is', max_tokens: 12, temperature: 0 };
  const r = await client.completions.create(req);
  const w = await direct.completions.create(req);
  assert.equal(r.object, 'text_completion');
  assert.equal(r.choices[0].text, w.choices[0].text);
  assert.deepEqual(r.usage, w.usage);
  const s = await client.completions.create({ ...req, stream: true, stream_options: { include_usage: true } });
  let text = '', usage = null;
  for await (const chunk of s) {
    if (chunk.choices.length) text += chunk.choices[0].text;
    if (chunk.usage) usage = chunk.usage;
  }
  assert.equal(text, w.choices[0].text);
  assert.equal(usage.completion_tokens, w.usage.completion_tokens);
  const models = await client.models.list();
  assert.ok(models.data.some((m) => m.id === env.model));
  // The instances' own errors come back with their status.
  await assert.rejects(client.completions.create({ model: 'nope', prompt: 'x' }), (e) => e.status === 404);
  await assert.rejects(client.completions.create({ ...req, temperature: -1 }), (e) => e.status === 400);
});
