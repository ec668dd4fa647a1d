#!/usr/bin/env python3
"""Trains an OPT model of a generated model's shapes for a few minutes with
Hugging Face transformers, so that its greedy continuations are decisive the
way a released checkpoint's are.

    python3 scripts/make-trained.py SRC_DIR OUT_DIR [--seconds 120] [--steps 2000]
        [--seq 512] [--batch 16] [--lr 6e-4] [--corpus-mb 12] [--seed 0]

SRC_DIR is a `pdserve make-model` directory: its config.json gives the
shapes and its GPT-2 vocab.json/merges.txt the tokenizer. OUT_DIR gets the
trained weights (float16 safetensors, HF names, lm_head tied), the config
and the tokenizer files, so pdserve and transformers both load it.

Why this exists: the correctness check compares pdserve's and transformers'
greedy continuations in fp16. Generated (random) weights give an almost flat
next-token distribution, so most steps are near ties that fp16 rounding can
flip either way; transformers against itself (eager against sdpa attention)
agrees on only about 41 of 50 such continuations. A released checkpoint such
as facebook/opt-125m would have peaked distributions, but the GPU machine has
no network. This makes a stand-in with the same architecture and shapes.

The text is what the machine already has: the sources of Python's standard
library (sorted paths, read until --corpus-mb), tokenized by transformers'
own GPT-2 tokenizer from SRC_DIR's files. Training starts from transformers'
initialisation (init_std), AdamW with warm-up and cosine decay, bf16
autocast, windows drawn by a seeded generator. The run stops at --steps or
--seconds, whichever comes first, and prints the loss as it goes; the last
line is a JSON summary.
"""
import argparse
import glob
import json
import math
import os
import shutil
import sys
import time

TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def read_corpus(limit_bytes):
    """Concatenated standard-library sources, in sorted path order."""
    root = os.path.dirname(os.__file__)
    paths = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    parts, total = [], 0
    for p in paths:
        if "site-packages" in p or "dist-packages" in p:
            continue
        try:
            with open(p, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        parts.append(text)
        total += len(text)
        if total >= limit_bytes:
            break
    return parts, total, root


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--seconds", type=float, default=120.0, help="stop training after this long")
    ap.add_argument("--steps", type=int, default=2000, help="stop training after this many steps")
    ap.add_argument("--seq", type=int, default=512,
                    help="tokens per training window (compare-hf reaches position 264: train past it)")
    ap.add_argument("--batch", type=int, default=16, help="windows per step")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--corpus-mb", type=float, default=12.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    try:
        import torch
        from transformers import OPTConfig, OPTForCausalLM
        try:  # transformers 4 has a slow and a fast class; 5 keeps one (the fast one)
            from transformers import GPT2TokenizerFast as GPT2Tok
        except ImportError:
            from transformers import GPT2Tokenizer as GPT2Tok
    except ImportError as e:
        sys.exit("make-trained: needs torch and transformers (%s)" % e)
    if not torch.cuda.is_available():
        sys.exit("make-trained: needs a CUDA GPU (a CPU run would take hours)")
    for f in ("config.json", "vocab.json", "merges.txt"):
        if not os.path.exists(os.path.join(args.src, f)):
            sys.exit("make-trained: %s has no %s (make it with pdserve make-model)" % (args.src, f))

    config = OPTConfig.from_json_file(os.path.join(args.src, "config.json"))
    config.dropout = 0.0
    config.attention_dropout = 0.0
    config.activation_dropout = 0.0
    config.layerdrop = 0.0
    if args.seq > config.max_position_embeddings:
        sys.exit("make-trained: --seq %d exceeds max_position_embeddings %d" % (args.seq, config.max_position_embeddings))

    t0 = time.time()
    files, n_chars, root = read_corpus(int(args.corpus_mb * 1e6))
    n_files = len(files)
    tok = GPT2Tok.from_pretrained(args.src)
    # A batch call tokenizes the files in parallel; EOS (id 2 in OPT) parts them.
    eos = config.eos_token_id if config.eos_token_id is not None else 2
    ids = []
    for piece in tok(files, return_attention_mask=False)["input_ids"]:
        ids.extend(piece)
        ids.append(eos)
    data = torch.tensor(ids, dtype=torch.long)
    print("corpus: %d files under %s, %.1f MB, %d tokens (tokenized in %.1f s)" %
          (n_files, root, n_chars / 1e6, len(ids), time.time() - t0), flush=True)
    if len(ids) < 4 * (args.seq + 1):
        sys.exit("make-trained: corpus too small (%d tokens)" % len(ids))

    torch.manual_seed(args.seed)
    dev = torch.device("cuda")
    model = OPTForCausalLM(config).float().to(dev)  # fp32 master weights whatever config says
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    bos = config.bos_token_id if config.bos_token_id is not None else 2

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    t_train = time.time()
    step, losses = 0, []
    while step < args.steps and time.time() - t_train < args.seconds:
        starts = torch.randint(0, len(ids) - args.seq, (args.batch,), generator=gen)
        x = torch.stack([data[s:s + args.seq] for s in starts.tolist()])
        # BOS first, as OPT's tokenizer and pdserve's prompts have it.
        x = torch.cat([torch.full((args.batch, 1), bos, dtype=torch.long), x[:, :-1]], dim=1).to(dev)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step == 1 or step % 100 == 0:
            print("step %5d  loss %.3f  lr %.2e  %.0f s" % (step, losses[-1], lr_at(step - 1), time.time() - t_train),
                  flush=True)
    train_s = time.time() - t_train
    tail = losses[-50:]
    final = sum(tail) / len(tail)

    os.makedirs(args.out, exist_ok=True)
    model.eval()
    model.half()  # save_pretrained records the parameters' dtype in config.json
    model.save_pretrained(args.out)  # safetensors: the default since transformers 4.35
    for f in TOKENIZER_FILES:
        src = os.path.join(args.src, f)
        if os.path.exists(src):
            shutil.copyfile(src, os.path.join(args.out, f))
    summary = {"steps": step, "train_seconds": round(train_s, 1), "tokens_seen": step * args.batch * args.seq,
               "final_loss_mean_last_50": round(final, 4), "corpus_tokens": len(ids), "corpus_files": n_files,
               "seq": args.seq, "batch": args.batch, "lr": args.lr, "seed": args.seed, "out": args.out}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
