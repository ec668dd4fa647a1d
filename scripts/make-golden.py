#!/usr/bin/env python3
"""Make golden reference data for pdserve's forward pass and tokenizer with
Hugging Face transformers (the independent implementation).

Run on a machine with torch + transformers (the GPU machine), on model
directories written by `pdserve make-model`:

    python3 scripts/make-golden.py OUT_DIR MODEL_DIR [MODEL_DIR ...]

For each model it writes OUT_DIR/<name>/golden.json and logits.f32:
  * prompts: token-id lists (BOS first) of lengths chosen to start, end and
    cross KV-block boundaries (block sizes 16 and 5 in the tests), plus
    prompts made by HF's GPT2Tokenizer from text;
  * greedy: 32 greedy tokens after each prompt, from OPTForCausalLM with its
    KV cache (checked against model.generate(do_sample=False));
  * logits.f32: little-endian float32 [n_prompts, 2, vocab]: row 0 = logits
    at the last prompt position, row 1 = logits of the 32nd greedy step;
  * weights_fnv1a64: hash of model.safetensors, so the test knows it
    regenerated exactly these weights.
It also writes OUT_DIR/tokenizer_hf.json: texts and GPT2Tokenizer ids (with
and without the BOS), as a second tokenizer reference.
Computation is fp32 on the CPU of that machine (deterministic, no TF32).
"""
import json
import os
import random
import struct
import sys

import torch
import transformers
from transformers import GPT2Tokenizer, OPTForCausalLM

STEPS = 32
LENGTHS = [1, 2, 3, 4, 5, 6, 10, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 65, 100, 129, 200, 333, 450]
TEXTS = [
    "Hello, my name is",
    "The capital of France is Paris, and the capital of Italy is",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "  leading spaces, trailing spaces  ",
    "I'm sure they'll say we've done it. DON'T!",
    "café naïve 日本語 🤖 emoji 👩‍👩‍👧 and ½ ² Ⅻ ٣",
    "tabs\tand\nnewlines\r\n\n  mixed   runs",
    "a\u0085b next-line, nbsp\u00a0x, ideographic\u3000space, zwsp\u200bword",
    "<|endoftext|>special inside<|endoftext|> text",
    "3.14159 + 2.71828 = 5.85987; 1,000,000 items",
]


def fnv1a64(path):
    h = 0xCBF29CE484222325
    with open(path, "rb") as f:
        data = f.read()
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return "%016x" % h


def greedy_run(model, prompt):
    ids = torch.tensor([prompt], dtype=torch.long)
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True)
    first = out.logits[0, -1].float().clone()
    past = out.past_key_values
    gen, last = [], first
    nxt = int(torch.argmax(first))
    for step in range(STEPS):
        gen.append(nxt)
        if step == STEPS - 1:
            break
        total = len(prompt) + len(gen)
        out = model(input_ids=torch.tensor([[nxt]]), attention_mask=torch.ones(1, total, dtype=torch.long),
                    past_key_values=past, use_cache=True)
        past = out.past_key_values
        last = out.logits[0, -1].float().clone()
        nxt = int(torch.argmax(last))
    return first, last, gen


def main():
    out_dir, model_dirs = sys.argv[1], sys.argv[2:]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_grad_enabled(False)
    os.makedirs(out_dir, exist_ok=True)
    made_by = "scripts/make-golden.py with torch %s, transformers %s, fp32 on CPU" % (
        torch.__version__, transformers.__version__)
    for mdir in model_dirs:
        name = os.path.basename(os.path.normpath(mdir))
        model = OPTForCausalLM.from_pretrained(mdir, torch_dtype=torch.float32)
        model.eval()
        tok = GPT2Tokenizer.from_pretrained(mdir)
        cfg = model.config
        rng = random.Random(1234)
        prompts = []
        for n in LENGTHS:
            p = [cfg.bos_token_id] + [rng.randrange(0, 50257) for _ in range(n - 1)]
            prompts.append(p)
        prompts.append([rng.randrange(0, 50257)])  # a 1-token prompt without BOS
        for t in TEXTS[:4]:
            prompts.append(tok(t)["input_ids"])
        rows, greedy, agree = [], [], 0
        for p in prompts:
            first, last, gen = greedy_run(model, p)
            ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                                 pad_token_id=cfg.pad_token_id)[0, len(p):].tolist()
            if ref == gen:
                agree += 1
            else:
                print("%s: manual loop and generate() differ for a %d-token prompt" % (name, len(p)))
            rows += [first, last]
            greedy.append(gen)
        d = os.path.join(out_dir, name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "logits.f32"), "wb") as f:
            f.write(torch.stack(rows).contiguous().numpy().astype("<f4").tobytes())
        meta = {
            "made_by": made_by,
            "model_dir": name,
            "weights_fnv1a64": fnv1a64(os.path.join(mdir, "model.safetensors")),
            "vocab_size": cfg.vocab_size,
            "steps": STEPS,
            "generate_agrees": agree,
            "prompts": prompts,
            "greedy": greedy,
        }
        with open(os.path.join(d, "golden.json"), "w") as f:
            json.dump(meta, f)
        print("%s: %d prompts, generate() agreed on %d" % (name, len(prompts), agree))
    tok = GPT2Tokenizer.from_pretrained(model_dirs[0])
    cases = [{"text": t, "ids": tok(t)["input_ids"],
              "ids_no_special": tok(t, add_special_tokens=False)["input_ids"]} for t in TEXTS]
    with open(os.path.join(out_dir, "tokenizer_hf.json"), "w") as f:
        json.dump({"made_by": made_by.replace("fp32 on CPU", "GPT2Tokenizer (slow)"), "cases": cases}, f,
                  ensure_ascii=False, indent=1)


if __name__ == "__main__":
    main()
