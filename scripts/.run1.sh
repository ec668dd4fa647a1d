set -x
export LD_LIBRARY_PATH=$PWD/.devpack/lib
B=.devpack/bin
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 120 $B/cuda_test_cuda_forward 2>&1 | tail -15
timeout 120 $B/cuda_test_cuda_ops 2>&1 | tail -5
W=/tmp/w; mkdir -p $W
$B/pdserve make-model $W/m125 --preset opt-125m --dtype float16 >/dev/null 2>&1
for be in cuda-fp16; do
 for e in "" "--enforce-eager"; do
  timeout 60 $B/pdserve bench-cpu $W/m125 --backend $be --prompt-len 16 --decode-tokens 200 $e 2>&1 | tail -5
 done
 timeout 60 $B/pdserve bench-cpu $W/m125 --backend $be --prompt-len 1984 --decode-tokens 64 2>&1 | tail -5
 timeout 60 $B/pdserve bench-cpu $W/m125 --backend $be --prompt-len 2048 --decode-tokens 0 2>&1 | tail -5
done
timeout 120 env PDSERVE_TEST_BACKEND=cuda $B/model_test_golden 2>&1 | tail -3
