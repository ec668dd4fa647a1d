export LD_LIBRARY_PATH=$PWD/.devpack/lib; B=.devpack/bin; O=${OUT:-/tmp/out}; mkdir -p $O
t0=$(date +%s)
timeout 90 $B/cuda_test_cuda_ops > $O/ops.txt 2>&1; echo "ops rc=$? $(( $(date +%s)-t0 ))s"
grep -E "passed,|CHECK|ms per layer|linear T=1 |sample:" $O/ops.txt | grep -v "^.*INFO" | head -60
timeout 60 $B/cuda_test_cuda_forward > $O/fwd.txt 2>&1; echo "fwd rc=$?"; grep -E "passed,|CHECK" $O/fwd.txt | head -12
timeout 60 $B/cuda_test_cuda_kv_sizing > $O/kvs.txt 2>&1; echo "kvs rc=$?"; grep -vE " INFO " $O/kvs.txt | tail -6
PDSERVE_TEST_BACKEND=cuda timeout 60 $B/model_test_golden > $O/golden.txt 2>&1; echo "golden rc=$?"; grep -E "passed,|CHECK" $O/golden.txt | head -5
echo "tests done $(( $(date +%s)-t0 ))s"
W=/tmp/w; mkdir -p $W; $B/pdserve make-model $W/m125 --preset opt-125m --dtype float16 >/dev/null 2>&1
for a in "2048 0" "16 256" "1984 64"; do set -- $a
 timeout 40 $B/pdserve bench-cpu $W/m125 --backend cuda-fp16 --prompt-len $1 --decode-tokens $2 2>&1 | grep -E "^(prefill|decode|device|graphs)"; done
timeout 40 $B/pdserve bench-cpu $W/m125 --backend cuda-fp16 --prompt-len 16 --decode-tokens 256 --enforce-eager 2>&1 | grep -E "^decode"
timeout 60 $B/pdserve bench-throughput $W/m125 --device cuda --dtype float16 --num-prompts 256 --input-len 128 --output-len 128 2>&1 | grep -vE " INFO " | tail -8
echo "all done $(( $(date +%s)-t0 ))s"
