#!/usr/bin/env bash
# test_cli: the pdserve command line end to end — make-model, tokenize /
# detokenize round trip, generate (greedy is deterministic; seeded sampling is
# reproducible; --device/--dtype/--backend), bench-kv's table, and one-line errors
# with exit status 2 for bad flags/values.
set -u
bin=${PDSERVE_BIN:?}
. "$(dirname "$0")/../common/checks.sh"

expect_rc 0 "make-model tiny" "$bin" make-model "$tmp/m" --preset tiny --seed 3
[ -f "$tmp/m/config.json" ] && [ -f "$tmp/m/model.safetensors" ] && [ -f "$tmp/m/vocab.json" ] && ok || bad "model files"

text=$'Hello world, caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac  spaces\tand tabs\n'
printf '%s' "$text" | "$bin" tokenize "$tmp/m" >"$tmp/ids" 2>"$tmp/err" && ok || bad "tokenize: $(cat "$tmp/err")"
grep -q '^\[50256, ' "$tmp/ids" && ok || bad "tokenize should prepend BOS 50256: $(cat "$tmp/ids")"
"$bin" detokenize "$tmp/m" <"$tmp/ids" >"$tmp/back" 2>"$tmp/err" && ok || bad "detokenize: $(cat "$tmp/err")"
[ "$(cat "$tmp/back"; echo x)" = "$(printf '%s' "$text"; echo x)" ] && ok || bad "round trip differs: $(cat "$tmp/back")"
printf '%s' "$text" | "$bin" tokenize "$tmp/m" --no-special >"$tmp/ids2" && ! grep -q '50256' "$tmp/ids2" && ok || bad "--no-special"

expect_rc 0 "generate greedy" "$bin" generate "$tmp/m" --prompt "The quick brown fox" --max-tokens 12 --ignore-eos
cp "$tmp/out" "$tmp/g1"
grep -q 'decode' "$tmp/err" || grep -q 'output:' "$tmp/err" && ok || bad "generate prints timings to stderr"
"$bin" generate "$tmp/m" --prompt "The quick brown fox" --max-tokens 12 --ignore-eos >"$tmp/g2" 2>/dev/null
cmp -s "$tmp/g1" "$tmp/g2" && ok || bad "greedy generate is not deterministic"
"$bin" generate "$tmp/m" --prompt "Once" --max-tokens 12 --temperature 1 --seed 7 --ignore-eos >"$tmp/s1" 2>/dev/null
"$bin" generate "$tmp/m" --prompt "Once" --max-tokens 12 --temperature 1 --seed 7 --ignore-eos --threads 1 >"$tmp/s2" 2>/dev/null
cmp -s "$tmp/s1" "$tmp/s2" && ok || bad "seeded sampling is not reproducible"

# --device / --dtype: the CPU computes in float32 whatever --dtype says, so
# greedy output is the same; --backend is the alternative spelling.
"$bin" generate "$tmp/m" --prompt "The quick brown fox" --max-tokens 12 --ignore-eos --device cpu --dtype float16 >"$tmp/g3" 2>"$tmp/err"
cmp -s "$tmp/g1" "$tmp/g3" && ok || bad "--dtype float16 on the CPU changed the output"
grep -q 'dtype float16 -> float32 (checkpoint float32; the CPU backend computes in float32)' "$tmp/err" && ok || bad "dtype log: $(cat "$tmp/err")"
"$bin" generate "$tmp/m" --prompt "The quick brown fox" --max-tokens 12 --ignore-eos --backend cpu >"$tmp/g4" 2>/dev/null
cmp -s "$tmp/g1" "$tmp/g4" && ok || bad "--backend cpu changed the output"
expect_rc 2 "backend and device" "$bin" generate "$tmp/m" --prompt x --backend cpu --device cpu
grep -q -- '--backend' "$tmp/err" && ok || bad "backend+device message: $(cat "$tmp/err")"
expect_rc 2 "bad device" "$bin" generate "$tmp/m" --prompt x --device tpu
grep -q -- "--device.*'tpu'" "$tmp/err" && ok || bad "device message: $(cat "$tmp/err")"
expect_rc 2 "bad dtype" "$bin" bench-cpu "$tmp/m" --dtype int4
grep -q -- "--dtype.*'int4'" "$tmp/err" && ok || bad "dtype message: $(cat "$tmp/err")"

# Bad input: exit 2 (usage) or 1 (runtime) with a one-line message naming the problem.
expect_rc 2 "unknown flag" "$bin" generate "$tmp/m" --prompt x --bogus 1
grep -q -- '--bogus' "$tmp/err" && ok || bad "unknown flag message: $(cat "$tmp/err")"
# argparse (vLLM) takes an unambiguous beginning of a flag's name: so do we.
"$bin" generate "$tmp/m" --prompt "The quick brown fox" --max-tok 12 --ignore >"$tmp/g5" 2>/dev/null
cmp -s "$tmp/g1" "$tmp/g5" && ok || bad "--max-tok / --ignore as abbreviations"
expect_rc 2 "ambiguous flag" "$bin" generate "$tmp/m" --prompt x --m 3
grep -q -- 'ambiguous flag --m: --' "$tmp/err" && ok || bad "ambiguous flag message: $(cat "$tmp/err")"
expect_rc 2 "short flag" "$bin" serve "$tmp/m" -tp 1
grep -q -- 'unknown flag -tp' "$tmp/err" && ok || bad "short flag message: $(cat "$tmp/err")"
expect_rc 0 "-h is --help" "$bin" serve -h
grep -q '^usage: pdserve serve' "$tmp/out" && ok || bad "serve -h: $(head -c 200 "$tmp/out")"
expect_rc 2 "MODEL taken by --served-model-name" "$bin" serve --port 0 --served-model-name x "$tmp/m"
grep -q -- "--served-model-name took '$tmp/m' as a name" "$tmp/err" && ok || bad "served-model-name message: $(cat "$tmp/err")"
# A config that claims more layers than the checkpoint has: named, not "out of memory".
cp -r "$tmp/m" "$tmp/mlayers"
sed -i 's/"num_hidden_layers":[[:space:]]*[0-9][0-9]*/"num_hidden_layers": 2000000000/' "$tmp/mlayers/config.json"
expect_rc 1 "more layers than the checkpoint" "$bin" generate "$tmp/mlayers" --prompt x --max-tokens 1
grep -q 'num_hidden_layers 2000000000, but the checkpoint has no decoder.layers.1999999999' "$tmp/err" && ok ||
  bad "layers message: $(cat "$tmp/err")"
expect_rc 2 "kv_buffer_size too big" "$bin" serve "$tmp/m" --port 0 \
  --kv-transfer-config '{"kv_connector":"P2pNcclConnector","kv_role":"kv_producer","kv_buffer_size":1e30}'
grep -q 'kv_buffer_size must be a byte count' "$tmp/err" && ok || bad "kv_buffer_size message: $(cat "$tmp/err")"
expect_rc 2 "bad number" "$bin" generate "$tmp/m" --prompt x --max-tokens abc
grep -q -- 'max-tokens' "$tmp/err" && ok || bad "bad value message: $(cat "$tmp/err")"
expect_rc 2 "out of range" "$bin" generate "$tmp/m" --prompt x --top-p 1.5
expect_rc 2 "missing prompt" "$bin" generate "$tmp/m"
expect_rc 1 "missing model" "$bin" generate "$tmp/nope" --prompt x
[ "$(wc -l <"$tmp/err")" -le 2 ] && ok || bad "error should be short: $(cat "$tmp/err")"
expect_rc 1 "too long" "$bin" generate "$tmp/m" --prompt x --max-tokens 100000
expect_rc 2 "bad preset value" "$bin" make-model "$tmp/m2" --dtype float8
expect_rc 1 "unknown preset" "$bin" make-model "$tmp/m3" --preset gigantic
grep -q gigantic "$tmp/err" && ok || bad "preset error names the preset: $(cat "$tmp/err")"
echo '[1, "x"]' | "$bin" detokenize "$tmp/m" >/dev/null 2>"$tmp/err"; [ $? -eq 1 ] && ok || bad "detokenize bad ids"
expect_rc 2 "unknown command" "$bin" frobnicate

# bench-kv: one markdown row per (length, send type); nccl says why it did not run here.
expect_rc 0 "bench-kv" "$bin" bench-kv --tokens 16,33 --layers 2 --reps 1 --dtype float16 --transport tcp,nccl
[ "$(grep -c '^| [0-9]* | tcp | host -> host | ' "$tmp/out")" -eq 6 ] && ok || bad "bench-kv rows: $(cat "$tmp/out")"
grep -Eq '^link, tcp: .*: [0-9.]+ GB/s .*cache-hot.*; [0-9.]+ GB/s .*cache-cold' "$tmp/out" && ok || bad "bench-kv link line: $(cat "$tmp/out")"
grep -q '^nccl: not run' "$tmp/out" || grep -q '^| 16 | nccl ' "$tmp/out" && ok || bad "bench-kv nccl line: $(cat "$tmp/out")"
expect_rc 2 "bench-kv bad dtype" "$bin" bench-kv --dtype float8
grep -q float8 "$tmp/err" && ok || bad "bench-kv dtype message: $(cat "$tmp/err")"
expect_rc 2 "bench-kv bad transport" "$bin" bench-kv --transport udp

# Default model: created on first use under $PDSERVE_HOME.
PDSERVE_HOME="$tmp/home" "$bin" generate --prompt "hi" --max-tokens 4 >"$tmp/d" 2>"$tmp/err" && ok || bad "default model: $(cat "$tmp/err")"
ls "$tmp"/home/models/default-*/config.json >/dev/null 2>&1 && ok || bad "default model directory"

checks_done
