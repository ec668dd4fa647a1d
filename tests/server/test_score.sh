#!/usr/bin/env bash
# test_score: `pdserve score` on the tiny model (CPU). Checks the output's
# shapes against the input; that the all-position pass and the chunked
# prefill agree on the last position; that the all-position logits of a
# prompt extended by its own greedy tokens pick those tokens again (so every
# row is the right position's); that score's greedy tokens are exactly what
# `pdserve generate --temperature 0` prints; that block size and prefill
# chunking do not change the result; the one-line errors; and
# scripts/compare-hf.py's comparison logic against another pdserve backend.
set -u
bin=${PDSERVE_BIN:?}
. "$(dirname "$0")/../common/checks.sh"
command -v python3 >/dev/null || { echo "FAIL: python3 not installed (scripts/setup-deps.sh installs it)"; exit 1; }

expect_rc 0 "make-model" "$bin" make-model "$tmp/m" --preset tiny --seed 5
expect_rc 0 "make-model post-LN" "$bin" make-model "$tmp/mp" --preset tiny-postln --seed 6

# Prompts: BOS + random ids, lengths across block boundaries and past one
# all-position step (128 positions), plus a 1-token prompt.
python3 - "$tmp/in.json" <<'EOF'
import json, random, sys
r = random.Random(7)
lens = [1, 2, 15, 16, 17, 40, 129, 200]
json.dump([[50256] + [r.randrange(50257) for _ in range(n - 1)] for n in lens], open(sys.argv[1], "w"))
EOF

# check.py: shapes and self-consistency of one score run (all-position mode).
cat >"$tmp/check.py" <<'EOF'
import array, json, os, sys
inp, out, logits, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
prompts = json.load(open(inp))
j = json.load(open(out))
V = j["vocab_size"]
errors = []
def need(cond, msg):
    if not cond: errors.append(msg)
rows_total = sum(len(p) + 1 for p in prompts)
need(os.path.getsize(logits) == rows_total * V * 4, "logits file has %d bytes, want %d rows x %d x 4" %
     (os.path.getsize(logits), rows_total, V))
need(len(j["prompts"]) == len(prompts), "%d results for %d prompts" % (len(j["prompts"]), len(prompts)))
f = open(logits, "rb")
def row(i):
    f.seek(i * V * 4)
    a = array.array("f")
    a.frombytes(f.read(V * 4))
    return a
def argmax(a):
    m = max(a)
    return a.index(m)
row0 = 0
for p, (ids, res) in enumerate(zip(prompts, j["prompts"])):
    n = len(ids)
    need(res["prompt_len"] == n, "prompt %d: prompt_len %s" % (p, res["prompt_len"]))
    need(res["logits_row"] == row0, "prompt %d: logits_row %s, want %d" % (p, res["logits_row"], row0))
    g, ti, tv = res["greedy"], res["top_ids"], res["top_logits"]
    need(len(g) == max_tokens and len(ti) == max_tokens and len(tv) == max_tokens, "prompt %d: lengths" % p)
    for s in range(len(g)):
        need(len(ti[s]) == j["top_k"] and ti[s][0] == g[s], "prompt %d step %d: top_ids %s, greedy %d" % (p, s, ti[s], g[s]))
        need(all(tv[s][i] >= tv[s][i + 1] for i in range(len(tv[s]) - 1)), "prompt %d step %d: top_logits not sorted" % (p, s))
    last_all, prefill = row(row0 + n - 1), row(row0 + n)
    d = max(abs(a - b) for a, b in zip(last_all, prefill))
    need(d <= 1e-4, "prompt %d: all-position pass and prefill differ at the last position by %g" % (p, d))
    need(argmax(prefill) == g[0], "prompt %d: prefill row's argmax %d, greedy[0] %d" % (p, argmax(prefill), g[0]))
    need(abs(max(prefill) - tv[0][0]) <= 1e-6 * max(1, abs(tv[0][0])), "prompt %d: top logit %g vs row max %g" % (p, tv[0][0], max(prefill)))
    row0 += n + 1
print("\n".join(errors) if errors else "ok")
sys.exit(1 if errors else 0)
EOF

for m in m mp; do
  expect_rc 0 "score $m" "$bin" score "$tmp/$m" --input "$tmp/in.json" --output "$tmp/$m.json" \
    --logits "$tmp/$m.f32" --max-tokens 10 --threads 2
  python3 "$tmp/check.py" "$tmp/in.json" "$tmp/$m.json" "$tmp/$m.f32" 10 >"$tmp/chk" 2>&1 && ok ||
    bad "score $m output: $(head -c 600 "$tmp/chk")"
done
grep -q 'decode steps' "$tmp/err" && ok || bad "score prints timings to stderr: $(cat "$tmp/err")"

# Each prompt extended by its first 6 greedy tokens: position n-1+k of the
# extension must pick greedy token k again (all-position rows are positions).
python3 - "$tmp/in.json" "$tmp/m.json" "$tmp/ext.json" <<'EOF'
import json, sys
prompts, res = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))["prompts"]
json.dump([p + r["greedy"][:6] for p, r in zip(prompts, res)], open(sys.argv[3], "w"))
EOF
expect_rc 0 "score extended prompts" "$bin" score "$tmp/m" --input "$tmp/ext.json" --output "$tmp/ext.out.json" \
  --logits "$tmp/ext.f32" --max-tokens 0
python3 - "$tmp/in.json" "$tmp/m.json" "$tmp/ext.f32" >"$tmp/chk" 2>&1 <<'EOF' && ok || bad "extended prompts: $(head -c 600 "$tmp/chk")"
import array, json, sys
prompts, res = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
V = res["vocab_size"]
f = open(sys.argv[3], "rb")
row0, errors = 0, []
for p, r in zip(prompts, res["prompts"]):
    n, g = len(p), r["greedy"]
    for k in range(6):
        f.seek((row0 + n - 1 + k) * V * 4)
        a = array.array("f"); a.frombytes(f.read(V * 4))
        got = a.index(max(a))
        if got != g[k]:
            errors.append("prompt of %d tokens: position %d picks %d, greedy step %d was %d" % (n, n - 1 + k, got, k, g[k]))
    row0 += n + 6 + 1
print("\n".join(errors) or "ok"); sys.exit(1 if errors else 0)
EOF

# Block size 5 and 7-token prefill chunks: the same greedy tokens; --prompt-logits last:
# one row per prompt, equal to the prefill rows of the full run.
expect_rc 0 "score bs 5 chunk 7" "$bin" score "$tmp/m" --input "$tmp/in.json" --output "$tmp/c.json" \
  --logits "$tmp/c.f32" --max-tokens 10 --block-size 5 --max-num-batched-tokens 7 --prompt-logits last
python3 - "$tmp/in.json" "$tmp/m.json" "$tmp/m.f32" "$tmp/c.json" "$tmp/c.f32" >"$tmp/chk" 2>&1 <<'EOF' && ok || bad "chunked: $(head -c 600 "$tmp/chk")"
import array, json, os, sys
prompts = json.load(open(sys.argv[1]))
a, b = json.load(open(sys.argv[2])), json.load(open(sys.argv[4]))
V = a["vocab_size"]
errors = []
if os.path.getsize(sys.argv[5]) != len(prompts) * V * 4:
    errors.append("--prompt-logits last wrote %d bytes" % os.path.getsize(sys.argv[5]))
fa, fb = open(sys.argv[3], "rb"), open(sys.argv[5], "rb")
for i, (p, ra, rb) in enumerate(zip(prompts, a["prompts"], b["prompts"])):
    if ra["greedy"] != rb["greedy"]:
        errors.append("prompt %d: greedy differs with block size 5 / chunks of 7" % i)
    if rb["logits_row"] != i:
        errors.append("prompt %d: logits_row %s in last mode" % (i, rb["logits_row"]))
    fa.seek((ra["logits_row"] + len(p)) * V * 4); fb.seek(i * V * 4)
    x, y = array.array("f"), array.array("f")
    x.frombytes(fa.read(V * 4)); y.frombytes(fb.read(V * 4))
    d = max(abs(u - v) for u, v in zip(x, y))
    if d > 1e-4:
        errors.append("prompt %d: prefill rows differ by %g" % (i, d))
print("\n".join(errors) or "ok"); sys.exit(1 if errors else 0)
EOF

# score's greedy tokens == generate --temperature 0 (text through tokenize/detokenize).
for m in m mp; do
  printf 'The quick brown fox jumps over' | "$bin" tokenize "$tmp/$m" >"$tmp/ids" 2>/dev/null
  echo "[$(cat "$tmp/ids")]" >"$tmp/one.json"
  expect_rc 0 "score one $m" "$bin" score "$tmp/$m" --input "$tmp/one.json" --output "$tmp/one.out.json" --max-tokens 24
  python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["prompts"][0]["greedy"]))' \
    "$tmp/one.out.json" | "$bin" detokenize "$tmp/$m" >"$tmp/score.txt" 2>/dev/null
  "$bin" generate "$tmp/$m" --prompt 'The quick brown fox jumps over' --max-tokens 24 --temperature 0 \
    --ignore-eos >"$tmp/gen.txt" 2>/dev/null
  [ "$(cat "$tmp/score.txt"; echo x)" = "$(head -c -1 "$tmp/gen.txt"; echo x)" ] && ok ||
    bad "$m: score greedy '$(cat "$tmp/score.txt")' != generate '$(cat "$tmp/gen.txt")'"
done
# score --output - prints the JSON on stdout.
"$bin" score "$tmp/m" --input "$tmp/one.json" --output - --max-tokens 3 2>/dev/null |
  python3 -c 'import json,sys; j=json.load(sys.stdin); assert len(j["prompts"][0]["greedy"]) == 3' && ok ||
  bad "--output -"

# Errors: one line naming the problem.
echo '[[1, 2, 99999999]]' >"$tmp/bad.json"
expect_rc 1 "bad token id" "$bin" score "$tmp/m" --input "$tmp/bad.json" --output "$tmp/x.json"
grep -q 'prompt 0 token 2 is 99999999' "$tmp/err" && ok || bad "bad id message: $(cat "$tmp/err")"
echo '[[1, 2], []]' >"$tmp/bad.json"
expect_rc 1 "empty prompt" "$bin" score "$tmp/m" --input "$tmp/bad.json" --output "$tmp/x.json"
grep -q 'prompt 1 ' "$tmp/err" && ok || bad "empty prompt message: $(cat "$tmp/err")"
echo '{"prompts": [[1, 2.5]]}' >"$tmp/bad.json"
expect_rc 1 "fractional id" "$bin" score "$tmp/m" --input "$tmp/bad.json" --output "$tmp/x.json"
echo 'not json' >"$tmp/bad.json"
expect_rc 1 "not json" "$bin" score "$tmp/m" --input "$tmp/bad.json" --output "$tmp/x.json"
grep -q 'not valid JSON' "$tmp/err" && ok || bad "not json message: $(cat "$tmp/err")"
expect_rc 1 "too long" "$bin" score "$tmp/m" --input "$tmp/one.json" --output "$tmp/x.json" --max-tokens 100000
grep -q 'maximum length' "$tmp/err" && ok || bad "too long message: $(cat "$tmp/err")"
expect_rc 2 "missing --input" "$bin" score "$tmp/m" --output "$tmp/x.json"
expect_rc 2 "missing --output" "$bin" score "$tmp/m" --input "$tmp/one.json"
expect_rc 2 "bad --prompt-logits" "$bin" score "$tmp/m" --input "$tmp/one.json" --output "$tmp/x.json" --prompt-logits some
grep -q "prompt-logits.*'some'" "$tmp/err" && ok || bad "--prompt-logits message: $(cat "$tmp/err")"
expect_rc 2 "bad --dtype" "$bin" score "$tmp/m" --input "$tmp/one.json" --output "$tmp/x.json" --dtype float8
expect_rc 2 "--backend and --device" "$bin" score "$tmp/m" --input "$tmp/one.json" --output "$tmp/x.json" \
  --backend cpu --device cpu
expect_rc 1 "bad --device" "$bin" score "$tmp/m" --input "$tmp/one.json" --output "$tmp/x.json" --device tpu
grep -q "device.*'tpu'" "$tmp/err" && ok || bad "--device message: $(cat "$tmp/err")"
expect_rc 0 "--device cpu --dtype float32" "$bin" score "$tmp/m" --input "$tmp/one.json" --output "$tmp/x.json" \
  --device cpu --dtype float32 --max-tokens 2
expect_rc 1 "missing input file" "$bin" score "$tmp/m" --input "$tmp/nope.json" --output "$tmp/x.json"

# scripts/compare-hf.py's own logic, with another pdserve backend as the
# reference (no torch here): the SSE2 kernels agree within 1e-4 and every
# continuation matches; a model with other weights fails, with divergences
# reported step by step.
src=${PDSERVE_SRC:-$(cd "$(dirname "$0")/../.." && pwd)}
expect_rc 0 "compare-hf, cpu vs cpu-baseline" python3 "$src/scripts/compare-hf.py" "$tmp/m" --backend cpu \
  --reference pdserve:cpu-baseline --prompts 5 --min-len 8 --max-len 24 --tokens 6 --pdserve "$bin" \
  --json "$tmp/cmp.json"
grep -q '^RESULT: PASS' "$tmp/out" && grep -q 'identical: 5/5' "$tmp/out" && ok || bad "compare-hf pass: $(tail -5 "$tmp/out")"
python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); assert j["passed"] and j["identical"] == 5 and j["max_abs_positions"] <= 1e-4' \
  "$tmp/cmp.json" && ok || bad "compare-hf summary json"
expect_rc 0 "make-model other seed" "$bin" make-model "$tmp/m9" --preset tiny --seed 9
expect_rc 1 "compare-hf, other weights" python3 "$src/scripts/compare-hf.py" "$tmp/m" --backend cpu \
  --reference pdserve:cpu --reference-model "$tmp/m9" --prompts 3 --min-len 8 --max-len 16 --tokens 4 --pdserve "$bin"
grep -q '^RESULT: FAIL' "$tmp/out" && grep -q 'first divergent step' "$tmp/out" && ok ||
  bad "compare-hf should fail on other weights: $(tail -5 "$tmp/out")"

checks_done
