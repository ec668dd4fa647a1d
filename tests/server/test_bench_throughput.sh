#!/usr/bin/env bash
# test_bench_throughput: `pdserve bench-throughput` on the tiny generated
# model. Every request must produce exactly --output-len tokens, so the
# reported output token count must be num_prompts * output_len, the prompt
# token count num_prompts * input_len — also when a small KV cache forces
# preemptions; the step count must be consistent with max_num_seqs; bad
# flags are one-line errors with exit status 2.
set -u
bin=${PDSERVE_BIN:?}
. "$(dirname "$0")/../common/checks.sh"
# json_num KEY: the number KEY has in the JSON line in $tmp/out.
json_num() { sed -n "s/.*\"$1\":\([0-9.e+-]*\).*/\1/p" "$tmp/out"; }

"$bin" make-model "$tmp/m" --preset tiny --seed 4 >/dev/null 2>&1 && ok || bad "make-model"

# 12 requests of 20 + 7 tokens, at most 5 sequences per step.
expect_rc 0 "bench --json" "$bin" bench-throughput "$tmp/m" --num-prompts 12 --input-len 20 --output-len 7 \
  --max-num-seqs 5 --seed 3 --json
[ "$(wc -l <"$tmp/out")" -eq 1 ] && ok || bad "--json prints one line on stdout: $(cat "$tmp/out")"
[ "$(json_num output_tokens)" = 84 ] && ok || bad "output_tokens $(json_num output_tokens), want 12 x 7 = 84"
[ "$(json_num prompt_tokens)" = 240 ] && ok || bad "prompt_tokens $(json_num prompt_tokens), want 12 x 20 = 240"
[ "$(json_num num_prompts)" = 12 ] && ok || bad "num_prompts"
steps=$(json_num engine_steps)
# Each step samples at most max_num_seqs tokens.
[ -n "$steps" ] && [ "$steps" -ge 17 ] && ok || bad "engine_steps $steps: at least 84 / 5"
# Prompt tokens plus every output but each request's last go through the model.
[ "$(json_num step_tokens)" = $((240 + 12 * 6)) ] && ok || bad "step_tokens $(json_num step_tokens), want 312"
awk -v r="$(json_num requests_per_s)" -v o="$(json_num output_tokens_per_s)" -v e="$(json_num elapsed_s)" \
  'BEGIN { exit !(r > 0 && e > 0 && (o / r - 7) ^ 2 < 1e-6) }' && ok || bad "rates: $(cat "$tmp/out")"
grep -q 'Throughput: .* requests/s, .* total tokens/s, .* output tokens/s' "$tmp/err" && ok || bad "report on stderr with --json"

# Without --json the report is on stdout.
expect_rc 0 "bench report" "$bin" bench-throughput "$tmp/m" --num-prompts 3 --input-len 5 --output-len 4
grep -q 'total num output tokens: 12,' "$tmp/out" && ok || bad "report: $(cat "$tmp/out")"
grep -q 'Engine: [0-9]* steps, mean' "$tmp/out" && ok || bad "steps line: $(cat "$tmp/out")"

# A KV cache of 6 blocks for 8 requests of 3+ blocks each: preemption, still exact counts.
expect_rc 0 "bench with preemption" "$bin" bench-throughput "$tmp/m" --num-prompts 8 --input-len 20 \
  --output-len 30 --max-num-seqs 4 --max-model-len 64 --num-gpu-blocks-override 6 --block-size 16 --json
[ "$(json_num output_tokens)" = 240 ] && ok || bad "output_tokens under preemption $(json_num output_tokens), want 240"
[ "$(json_num num_blocks)" = 6 ] && ok || bad "num_blocks $(json_num num_blocks)"
p=$(json_num preemptions)
[ -n "$p" ] && [ "$p" -gt 0 ] && ok || bad "expected preemptions with 6 blocks, got '$p'"

# Sampled (vLLM's benchmark samples at temperature 1): still every token.
expect_rc 0 "bench sampled" "$bin" bench-throughput "$tmp/m" --num-prompts 6 --input-len 10 --output-len 9 \
  --temperature 1.0 --top-p 0.9 --top-k 20 --json
[ "$(json_num output_tokens)" = 54 ] && ok || bad "sampled output_tokens $(json_num output_tokens), want 54"

# Help and bad input.
expect_rc 0 "help" "$bin" bench-throughput --help
grep -q -- '--num-prompts' "$tmp/out" && grep -q -- '--max-num-seqs' "$tmp/out" && grep -q -- '--gpu-memory-utilization' "$tmp/out" &&
  ! grep -q -- '--port' "$tmp/out" && ok || bad "help lists bench and engine flags, no HTTP ones"
expect_rc 2 "bad top-p" "$bin" bench-throughput "$tmp/m" --top-p 0
expect_rc 2 "http flag" "$bin" bench-throughput "$tmp/m" --port 8000
grep -q -- '--port' "$tmp/err" && ok || bad "http flag message: $(cat "$tmp/err")"
expect_rc 2 "zero output" "$bin" bench-throughput "$tmp/m" --output-len 0
grep -q -- 'output-len' "$tmp/err" && ok || bad "output-len message: $(cat "$tmp/err")"
expect_rc 2 "too long" "$bin" bench-throughput "$tmp/m" --input-len 40 --output-len 30 --max-model-len 64
grep -q 'exceeds max_model_len 64' "$tmp/err" && [ "$(wc -l <"$tmp/err")" -eq 1 ] && ok || bad "length message: $(cat "$tmp/err")"
expect_rc 2 "unknown flag" "$bin" bench-throughput "$tmp/m" --bogus 1
expect_rc 2 "bad dtype" "$bin" bench-throughput "$tmp/m" --dtype float8

checks_done
