// Runs the HTTP suites in one process, one after another (they share
// servers and compare /metrics before and after). Used by test_http.sh.
'use strict';
const only = process.argv.slice(2);
const suites = ['sdk', 'api', 'badinput', 'engine'];
for (const s of suites) if (!only.length || only.includes(s)) require(`./${s}.test.js`);
