// Helpers for the pdproxy tests: the shared ones of tests/common/http.js, plus
// reading a completion's text and starting extra pdproxy / pdserve processes.
// The stacks themselves are started by test_proxy.sh; their URLs come in env.
'use strict';
const { spawn } = require('node:child_process');
const fs = require('node:fs');
const { after } = require('node:test');
const http = require('../common/http');

const { waitFor } = http;

const env = {
  ref: process.env.PD_URL_REF, // colocated pdserve
  one: process.env.PD_URL_ONE, // proxy of the 1P1D stack
  two: process.env.PD_URL_TWO, // proxy of the 2P2D stack
  discoveryTwo: Number(process.env.PD_DISCOVERY_TWO),
  killPids: (process.env.PD_KILL_PIDS || '').split(',').filter(Boolean).map(Number),
  spare: (process.env.PD_SPARE_PORTS || '').split(' ').filter(Boolean).map(Number),
  modelDir: process.env.PD_MODEL_DIR,
  proxyBin: process.env.PDPROXY_BIN,
  serveBin: process.env.PDSERVE_BIN,
  tmp: process.env.PD_TMP || '/tmp',
  model: 'tiny',
};

// The text and finish reason of a completion, streamed or not.
function completionOf(r, streamed) {
  if (!streamed) {
    const c = r.json && r.json.choices && r.json.choices[0];
    return c ? { text: c.text, finish: c.finish_reason } : null;
  }
  let text = '', finish = null;
  for (const e of r.events) {
    if (e.error) return null;
    for (const c of e.choices || []) { text += c.text; if (c.finish_reason) finish = c.finish_reason; }
  }
  return { text, finish };
}

// Every process a suite starts, killed when the run ends: a test that fails
// before its own stop() would otherwise leave a live child, and node would
// wait for it until ctest's timeout instead of reporting the failure.
const live = new Set();
function track(proc) {
  live.add(proc);
  proc.once('exit', () => live.delete(proc));
  return proc;
}
after(() => { for (const p of live) p.kill('SIGKILL'); });

// Start a pdproxy with extra flags on a free port; resolves to { url, proc, log }.
async function startProxy(args, name) {
  const log = `${env.tmp}/${name}.log`;
  const out = fs.openSync(log, 'w');
  const proc = track(spawn(env.proxyBin, ['--host', '127.0.0.1', '--port', '0', ...args], { stdio: ['ignore', out, out] }));
  let url = null;
  await waitFor(() => {
    const m = /pdproxy on http:\/\/[^:]+:(\d+) /.exec(fs.readFileSync(log, 'utf8'));
    if (m) url = `http://127.0.0.1:${m[1]}`;
    return !!url || proc.exitCode !== null;
  }, 10000);
  if (!url) throw new Error(`${name} did not start: ${fs.readFileSync(log, 'utf8')}`);
  return { url, proc, log, stop: () => stopProc(proc) };
}

function stopProc(proc, sig = 'SIGTERM') {
  return new Promise((resolve) => {
    if (proc.exitCode !== null || proc.signalCode !== null) return resolve(proc.exitCode);
    proc.once('exit', (code) => resolve(code));
    proc.kill(sig);
  });
}

// A pdserve instance announcing itself to the proxy discovering on dport.
function startInstance(name, role, dport, httpPort, kvPort) {
  const cfg = {
    kv_connector: 'P2pNcclConnector', kv_role: role, kv_port: kvPort, kv_ip: '127.0.0.1',
    kv_connector_extra_config: { proxy_ip: '127.0.0.1', proxy_port: String(dport), http_port: String(httpPort) },
  };
  const out = fs.openSync(`${env.tmp}/${name}.log`, 'w');
  const proc = track(spawn(env.serveBin, ['serve', env.modelDir, '--host', '127.0.0.1', '--port', String(httpPort),
    '--threads', '1', '--served-model-name', env.model, '--kv-transfer-config', JSON.stringify(cfg)],
  { stdio: ['ignore', out, out], env: { ...process.env, PDSERVE_ANNOUNCE_INTERVAL_MS: '200' } }));
  return { proc, http: `127.0.0.1:${httpPort}` };
}

// Deterministic prompts of varied length from a seeded generator.
function prompts(n, seed = 7) {
  const words = ['the', 'quick', 'brown', 'fox', 'jumps', 'over', 'lazy', 'dog', 'Paris', 'is',
    'a', 'city', 'in', 'France', 'and', 'numbers', 'like', '42', 'or', '3.14', 'matter', 'to',
    'people', 'who', 'write', 'code', 'every', 'day', 'Hello,', 'my', 'name', 'what?', 'ünïcödé', '日本'];
  let s = seed >>> 0;
  const rnd = () => { s = (s * 1664525 + 1013904223) >>> 0; return s / 2 ** 32; };
  return Array.from({ length: n }, () => {
    const len = 1 + Math.floor(rnd() * 40);
    return Array.from({ length: len }, () => words[Math.floor(rnd() * words.length)]).join(' ');
  });
}

module.exports = { ...http, env, completionOf, startProxy, stopProc, startInstance, prompts };
