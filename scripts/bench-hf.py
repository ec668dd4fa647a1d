#!/usr/bin/env python3
"""Reference speed of Hugging Face transformers on the GPU machine, for
docs/benchmarks.md: batch-1 greedy decode ms/token and prefill time of one
prompt, OPTForCausalLM in fp16 on cuda:0, same weights as pdserve (a
`pdserve make-model` directory).

    python3 scripts/bench-hf.py MODEL_DIR [--prompt-len 2000] [--decode 64]
"""
import argparse
import time

import torch
from transformers import OPTForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--decode", type=int, default=64)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    m = OPTForCausalLM.from_pretrained(a.model, torch_dtype=torch.float16).cuda().eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50000, (1, a.prompt_len), generator=g).cuda()
    for _ in range(2):  # warm-up
        m(ids)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    m(ids)
    torch.cuda.synchronize()
    prefill = time.perf_counter() - t0
    short = ids[:, :16]
    m.generate(short, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    m.generate(short, max_new_tokens=a.decode, min_new_tokens=a.decode, do_sample=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print("hf transformers %s, torch %s, %s" % (__import__("transformers").__version__, torch.__version__,
                                               torch.cuda.get_device_name(0)))
    print("hf prefill %d tokens: %.2f ms" % (a.prompt_len, prefill * 1e3))
    print("hf decode batch 1: %.3f ms/token (generate, %d tokens)" % (dt / a.decode * 1e3, a.decode))


if __name__ == "__main__":
    main()
