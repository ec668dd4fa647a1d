// Helpers for the pdserve HTTP tests: the shared ones of tests/common/http.js
// plus raw TCP requests. Servers are started by test_http.sh; their URLs
// come in env vars.
'use strict';
const net = require('node:net');
const http = require('../common/http');

const env = {
  main: process.env.PD_URL_MAIN,     // ordinary server
  auth: process.env.PD_URL_AUTH,     // --api-key
  small: process.env.PD_URL_SMALL,   // tiny KV budget
  busy: process.env.PD_URL_BUSY,     // --max-waiting 1 --max-num-seqs 1
  model: process.env.PD_MODEL_NAME || 'tiny',
  apiKey: process.env.PD_API_KEY || 'test-key',
};

// Raw bytes over TCP (for bodies fetch cannot send, e.g. a short body).
function rawRequest(base, bytes, { closeAfterMs = 0 } = {}) {
  const u = new URL(base);
  return new Promise((resolve) => {
    const sock = net.connect(Number(u.port), u.hostname);
    let out = '';
    sock.on('data', (d) => { out += d.toString('latin1'); });
    sock.on('error', () => resolve(out));
    sock.on('close', () => resolve(out));
    sock.write(bytes);
    if (closeAfterMs) setTimeout(() => sock.end(), closeAfterMs);
  });
}

module.exports = { ...http, env, rawRequest };
