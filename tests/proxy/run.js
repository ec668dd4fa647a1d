// Runs the proxy suites in one process, one after another (the last one
// kills instances of the 2P2D stack). Used by test_proxy.sh.
'use strict';
const only = process.argv.slice(2);
const suites = ['equal', 'sdk', 'protocol', 'churn'];
for (const s of suites) if (!only.length || only.includes(s)) require(`./${s}.test.js`);
