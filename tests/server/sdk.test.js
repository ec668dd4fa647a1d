// The official OpenAI Node SDK against pdserve: completions, streamed and not.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const OpenAI = require('openai');
const { env } = require('./lib');

const client = new OpenAI({ baseURL: env.main + '/v1', apiKey: 'unused' });

test('OpenAI SDK: completions.create', async () => {
  const r = await client.completions.create({ model: env.model, prompt: 'Hello, my name is', max_tokens: 8, temperature: 0 });
  assert.equal(r.object, 'text_completion');
  assert.equal(r.choices.length, 1);
  assert.equal(typeof r.choices[0].text, 'string');
  assert.ok(['length', 'stop'].includes(r.choices[0].finish_reason));
  assert.ok(r.usage.completion_tokens >= 1 && r.usage.completion_tokens <= 8);
  const models = await client.models.list();
  assert.ok(models.data.some((m) => m.id === env.model));
});

test('OpenAI SDK: streaming completions.create', async () => {
  const full = await client.completions.create({ model: env.model, prompt: 'The sky is', max_tokens: 10, temperature: 0 });
  const s = await client.completions.create({ model: env.model, prompt: 'The sky is', max_tokens: 10, temperature: 0, stream: true, stream_options: { include_usage: true } });
  let text = '', usage = null, finish = null;
  for await (const chunk of s) {
    if (chunk.choices.length) {
      text += chunk.choices[0].text;
      if (chunk.choices[0].finish_reason) finish = chunk.choices[0].finish_reason;
    }
    if (chunk.usage) usage = chunk.usage;
  }
  assert.equal(text, full.choices[0].text);
  assert.equal(finish, full.choices[0].finish_reason);
  assert.equal(usage.completion_tokens, full.usage.completion_tokens);
});

test('OpenAI SDK: errors surface as APIError with the status', async () => {
  await assert.rejects(client.completions.create({ model: 'nope', prompt: 'x' }), (e) => e.status === 404);
  await assert.rejects(client.completions.create({ model: env.model, prompt: 'x', temperature: -1 }), (e) => e.status === 400);
});
