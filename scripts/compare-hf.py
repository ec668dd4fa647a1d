#!/usr/bin/env python3
"""pdserve against Hugging Face transformers on the same weights, same GPU.

    python3 scripts/compare-hf.py MODEL_DIR --backend cuda-fp16|cuda|cuda-bf16
        [--prompts 50] [--tokens 64] [--pdserve BIN] [--json SUMMARY.json]

Makes --prompts prompts (token-id lists of lengths --min-len..--max-len from
a seeded RNG, BOS first; every fifth one real text through `pdserve
tokenize` when the model directory has a tokenizer), runs `pdserve score`
on them (logits of every prompt position, the prefill's last-position
logits, --tokens greedy tokens with their top-k logits), runs
OPTForCausalLM in the same dtype on the same device over the same ids (one
forward for every position's logits; a manual greedy loop with the KV
cache for the continuation, so EOS never stops it), and reports

  * max |logit diff| over every prompt position and the prefill row, overall
    and per prompt, also relative to max |logit|; and at the greedy steps
    (pdserve's top-k ids, while the two continuations still agree);
  * how many greedy continuations are identical, and for the others the
    first divergent step with both sides' top-two logits there, and whether
    that is a near tie (gap within 2 x tolerance: logits that are each
    within tolerance may flip such a pair).

Acceptance (exit status 1 when missed): fp32 (`--backend cuda`) logits
within 1e-4 max abs, fp16 within 2e-2 (bf16: 1e-1, not an acceptance
figure of the project), and identical continuations on >= 95% of prompts.

`--reference pdserve:BACKEND` replaces Hugging Face by another pdserve
backend (e.g. pdserve:cpu) — for checking this script where torch is not
installed, and for comparing backends with each other.

Needs python3; the HF reference needs torch + transformers (and numpy,
which transformers requires). Without numpy the comparison runs in pure
Python (only sensible for small runs).
"""
import argparse
import array
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

try:
    import numpy as np
except ImportError:  # the CPU self-test machine may lack it
    np = None

TOLERANCE = {"cuda": 1e-4, "cpu": 1e-4, "cuda-fp16": 2e-2, "cuda-bf16": 1e-1}
TEXTS = [
    "The history of the city begins with a small fishing village on the river, where traders from the north "
    "came every spring to exchange furs for salt, grain and iron tools.",
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))\n"
    "    return out + a + b\n",
    "Q: What is the boiling point of water at sea level?\nA: 100 degrees Celsius, or 212 degrees Fahrenheit.\n",
    "In 1905 Einstein published four papers: on the photoelectric effect, Brownian motion, special relativity "
    "and the equivalence of mass and energy.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2014 \u65e5\u672c\u8a9e\u306e\u6587 and emoji \U0001f916 mixed with "
    "ASCII; tabs\tand\nnewlines.",
]


def backend_dtype(backend):
    b = backend.split(":")[0]
    return {"cuda": "float32", "cpu": "float32", "cuda-fp16": "float16", "cuda-bf16": "bfloat16"}[b]


def find_pdserve(given):
    if given:
        return given
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for cand in (os.path.join(root, ".devpack/bin/pdserve"), os.path.join(root, "build/pdserve")):
        if os.path.exists(cand):
            return cand
    sys.exit("compare-hf: no pdserve binary found (give --pdserve)")


def pdserve_env(binary):
    """LD_LIBRARY_PATH with the devpack's lib/ beside bin/, when there is one."""
    env = dict(os.environ)
    lib = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(binary))), "lib")
    if os.path.isdir(lib):
        env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


def make_prompts(model_dir, cfg, n, lo, hi, seed, binary):
    rng = random.Random(seed)
    lengths = [lo, hi] + [rng.randint(lo, hi) for _ in range(max(0, n - 2))]
    lengths = lengths[:n]
    has_tok = all(os.path.exists(os.path.join(model_dir, f)) for f in ("vocab.json", "merges.txt"))
    bos = cfg.get("bos_token_id", 2)
    top = min(cfg["vocab_size"], 50257)  # ids the GPT-2 tokenizer can produce
    prompts, kinds = [], []
    for i, length in enumerate(lengths):
        ids = None
        if has_tok and i % 5 == 4:
            text = " ".join(TEXTS[(i // 5 + k) % len(TEXTS)] for k in range(1 + length // 20))
            r = subprocess.run([binary, "tokenize", model_dir], input=text.encode(), capture_output=True,
                               env=pdserve_env(binary))
            if r.returncode == 0:
                toks = json.loads(r.stdout)
                if len(toks) >= length:
                    ids = toks[:length]
        if ids is None:
            ids = [bos] + [rng.randrange(3, top) for _ in range(length - 1)]
            kinds.append("ids")
        else:
            kinds.append("text")
        prompts.append(ids)
    return prompts, kinds


def run_score(binary, model_dir, backend, prompts, tokens, work, tag, top_k):
    inp = os.path.join(work, "prompts.json")
    with open(inp, "w") as f:
        json.dump(prompts, f)
    out_json = os.path.join(work, tag + ".json")
    out_bin = os.path.join(work, tag + ".f32")
    cmd = [binary, "score", model_dir, "--backend", backend, "--input", inp, "--output", out_json,
           "--logits", out_bin, "--max-tokens", str(tokens), "--top-k", str(top_k)]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, env=pdserve_env(binary))
    if r.returncode != 0:
        sys.stderr.write(r.stderr)
        raise RuntimeError("pdserve score failed (exit %d): %s" % (r.returncode, " ".join(cmd)))
    with open(out_json) as f:
        res = json.load(f)
    res["wall_seconds"] = time.time() - t0
    res["stderr"] = r.stderr.strip()
    return res, out_bin


class Rows:
    """Reads float32 rows of a `pdserve score --logits` file."""

    def __init__(self, path, vocab):
        self.path, self.vocab = path, vocab

    def get(self, row0, n):
        if np is not None:
            return np.fromfile(self.path, dtype="<f4", count=n * self.vocab,
                               offset=row0 * self.vocab * 4).reshape(n, self.vocab)
        with open(self.path, "rb") as f:
            f.seek(row0 * self.vocab * 4)
            a = array.array("f")
            a.frombytes(f.read(n * self.vocab * 4))
        return [a[i * self.vocab:(i + 1) * self.vocab] for i in range(n)]


def max_abs_diff(a, b):
    """Max |a - b| (NaN counts as infinite) and max |b| over rows."""
    if np is not None:
        d = np.abs(np.asarray(a, dtype=np.float32) - np.asarray(b, dtype=np.float32))
        md = float("inf") if np.isnan(d).any() else float(d.max())
        return md, float(np.abs(np.asarray(b)).max())
    md, mb = 0.0, 0.0
    for ra, rb in zip(a, b):
        for x, y in zip(ra, rb):
            d = abs(x - y)
            if not d <= md:
                md = d if d == d else float("inf")
            if abs(y) > mb:
                mb = abs(y)
    return md, mb



class HFReference:
    """OPTForCausalLM in the backend's dtype, on cuda when there is a GPU."""

    def __init__(self, model_dir, dtype_name, device, attn):
        import torch
        import transformers
        from transformers import OPTForCausalLM

        self.torch = torch
        self.batch_dropped = False  # run_all fell back to one prompt at a time
        torch.set_grad_enabled(False)
        # The reference as exact as its dtype allows: fp32 without TF32, and
        # 16-bit GEMMs without reduced-precision (16-bit) split-K reductions,
        # as pdserve accumulates in fp32.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        for flag in ("allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction"):
            if hasattr(torch.backends.cuda.matmul, flag):
                setattr(torch.backends.cuda.matmul, flag, False)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        dt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype_name]
        kw = {"attn_implementation": attn} if attn else {}
        # Load, then cast: the weights are exactly the checkpoint's in any dtype
        # it may load in (transformers 5 loads "auto" by default, 4.x float32).
        self.model = OPTForCausalLM.from_pretrained(model_dir, **kw).to(device=self.device, dtype=dt).eval()
        self.desc = "HF transformers %s, torch %s, %s, %s, attention %s" % (
            transformers.__version__, torch.__version__, dtype_name,
            torch.cuda.get_device_name(0) if self.device.startswith("cuda") else "cpu",
            getattr(self.model.config, "_attn_implementation", "?"))

    def run(self, ids, tokens):
        torch = self.torch
        m = self.model
        x = torch.tensor([ids], device=self.device)
        out = m(input_ids=x, attention_mask=torch.ones_like(x), use_cache=True)
        rows = out.logits[0].float()
        past, cur = out.past_key_values, rows[-1]
        greedy, steps = [], []
        for s in range(tokens):
            steps.append(cur)
            tok = int(torch.argmax(cur))  # lowest index among equal maxima, as pdserve
            greedy.append(tok)
            if s == tokens - 1:
                break
            total = len(ids) + len(greedy)
            out = m(input_ids=torch.tensor([[tok]], device=self.device),
                    attention_mask=torch.ones(1, total, dtype=torch.long, device=self.device),
                    past_key_values=past, use_cache=True)
            past, cur = out.past_key_values, out.logits[0, -1].float()
        steps = torch.stack(steps).cpu().numpy() if steps else None
        return {"rows": rows.cpu().numpy(), "greedy": greedy, "step_rows": steps}


    def logits(self, ids):
        """Every position's logits of one prompt, as float32 rows."""
        torch = self.torch
        x = torch.tensor([ids], device=self.device)
        return self.model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0].float().cpu().numpy()

    def run_all(self, prompts, tokens, tol):
        """All prompts in one left-padded batch: one forward for every
        position's logits, then `tokens` batched greedy steps, with explicit
        positions (OPT's learned positions must skip the padding). The first
        two prompts are checked against run(); on a mismatch beyond tol/4
        (a transformers version that handles padding otherwise) the batch is
        dropped and every prompt runs alone."""
        torch = self.torch
        m = self.model
        B, L = len(prompts), max(map(len, prompts))
        pad = m.config.pad_token_id if m.config.pad_token_id is not None else 1
        x = torch.full((B, L), pad, dtype=torch.long, device=self.device)
        mask = torch.zeros((B, L), dtype=torch.long, device=self.device)
        for i, ids in enumerate(prompts):
            x[i, L - len(ids):] = torch.tensor(ids, device=self.device)
            mask[i, L - len(ids):] = 1
        pos = (torch.cumsum(mask, 1) - 1).clamp(min=0)
        out = m(input_ids=x, attention_mask=mask, position_ids=pos, use_cache=True)
        rows = [out.logits[i, L - len(ids):].float().cpu().numpy() for i, ids in enumerate(prompts)]
        past, cur = out.past_key_values, out.logits[:, -1].float()
        greedy = [[] for _ in prompts]
        steps = [[] for _ in prompts]
        for s in range(tokens):
            tok = torch.argmax(cur, dim=-1)
            for i in range(B):
                steps[i].append(cur[i].cpu())
                greedy[i].append(int(tok[i]))
            if s == tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long, device=self.device)], 1)
            step_pos = (mask.sum(1, keepdim=True) - 1)
            out = m(input_ids=tok[:, None], attention_mask=mask, position_ids=step_pos,
                    past_key_values=past, use_cache=True)
            past, cur = out.past_key_values, out.logits[:, -1].float()
        results = [{"rows": rows[i], "greedy": greedy[i],
                    "step_rows": torch.stack(steps[i]).numpy() if steps[i] else None} for i in range(B)]
        for i in range(min(2, B)):
            one = self.run(prompts[i], tokens)
            d, _ = max_abs_diff(one["rows"], results[i]["rows"])
            if not d <= tol / 4:
                print("note: batched HF logits differ from single-prompt ones by %.3g; running prompts one by one" % d)
                self.batch_dropped = True
                return [self.run(ids, tokens) for ids in prompts]
        return results


class PdserveReference:
    """Another pdserve backend as the reference (no torch needed)."""

    def __init__(self, binary, model_dir, backend, prompts, tokens, work, top_k):
        self.res, path = run_score(binary, model_dir, backend, prompts, tokens, work, "reference", top_k)
        self.rows = Rows(path, self.res["vocab_size"])
        self.desc = "pdserve score --backend %s" % backend
        self.i = 0

    def run(self, ids, tokens):
        r = self.res["prompts"][self.i]
        self.i += 1
        n = len(ids)
        rows = self.rows.get(r["logits_row"], n)
        # Only the top-k of each greedy step are known: a sparse row.
        steps = [dict(zip(t, v)) for t, v in zip(r["top_ids"], r["top_logits"])]
        return {"rows": rows, "greedy": r["greedy"], "step_rows": steps}


def step_value(step_row, i):
    if isinstance(step_row, dict):
        return step_row.get(i)
    return float(step_row[i])


def top_two(step_row):
    if isinstance(step_row, dict):
        items = sorted(step_row.items(), key=lambda kv: (-kv[1], kv[0]))
    else:
        if np is not None:
            idx = np.argsort(-np.asarray(step_row), kind="stable")[:2]
            items = [(int(i), float(step_row[i])) for i in idx]
        else:
            items = sorted(enumerate(step_row), key=lambda kv: (-kv[1], kv[0]))
    return items[:2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--backend", default="cuda-fp16", help="pdserve backend: cuda, cuda-fp16, cuda-bf16 (or cpu)")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--top-k", type=int, default=5, help="top logits pdserve reports per greedy step")
    ap.add_argument("--tol", type=float, default=None, help="max abs logit tolerance (default by dtype)")
    ap.add_argument("--min-identical", type=float, default=0.95, help="fraction of identical continuations")
    ap.add_argument("--pdserve", default=None, help="pdserve binary (default .devpack/bin or build/)")
    ap.add_argument("--reference", default="hf", help="hf, or pdserve:BACKEND")
    ap.add_argument("--reference-model", default=None,
                    help="model directory of the reference (default MODEL; e.g. the same weights in another dtype)")
    ap.add_argument("--hf-device", default=None, help="torch device of the HF model (default cuda if any)")
    ap.add_argument("--attn", default=None, help="HF attn_implementation (default: transformers' own)")
    ap.add_argument("--work", default=None, help="directory for the logits files (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--one-by-one", action="store_true",
                    help="run the HF prompts one at a time instead of in one padded batch")
    ap.add_argument("--hf-self-check", action="store_true",
                    help="also run HF one prompt at a time and report how often HF's batched and "
                         "one-by-one continuations agree (the reference's own noise at fp16 ties)")
    ap.add_argument("--hf-attn-check", default=None, metavar="IMPL",
                    help="also run HF with attn_implementation IMPL (e.g. eager), one prompt at a time, and "
                         "report how often its continuations agree with the reference's: how far a legitimate "
                         "change of attention arithmetic alone moves them")
    ap.add_argument("--fp32-check", action="store_true",
                    help="also run HF in fp32 on the same weights and report how far pdserve's and the "
                         "reference's 16-bit logits each are from it (which side of a logit difference the "
                         "rounding is on)")
    ap.add_argument("--json", default=None, help="write a summary JSON here")
    a = ap.parse_args()

    binary = find_pdserve(a.pdserve)
    with open(os.path.join(a.model, "config.json")) as f:
        cfg = json.load(f)
    name = os.path.basename(os.path.normpath(a.model))
    tol = a.tol if a.tol is not None else TOLERANCE.get(a.backend.split(":")[0], 2e-2)
    work = a.work or tempfile.mkdtemp(prefix="compare-hf-")
    os.makedirs(work, exist_ok=True)
    try:
        summary = compare(a, binary, cfg, name, tol, work)
    finally:
        if not a.keep and not a.work:
            shutil.rmtree(work, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    sys.exit(0 if summary["passed"] else 1)


def compare(a, binary, cfg, name, tol, work):
    prompts, kinds = make_prompts(a.model, cfg, a.prompts, a.min_len, a.max_len, a.seed, binary)
    V = cfg["vocab_size"]
    pd, pd_path = run_score(binary, a.model, a.backend, prompts, a.tokens, work, "pdserve", a.top_k)
    pd_rows = Rows(pd_path, V)
    t0 = time.time()
    ref_model = a.reference_model or a.model
    if a.reference == "hf":
        ref = HFReference(ref_model, backend_dtype(a.backend), a.hf_device, a.attn)
    elif a.reference.startswith("pdserve:"):
        ref = PdserveReference(binary, ref_model, a.reference.split(":", 1)[1], prompts, a.tokens, work, a.top_k)
    else:
        sys.exit("compare-hf: --reference must be hf or pdserve:BACKEND, got %r" % a.reference)
    shape = "pre-LN" if cfg.get("do_layer_norm_before", True) else "post-LN"
    if cfg.get("word_embed_proj_dim", cfg["hidden_size"]) != cfg["hidden_size"]:
        shape += " with project_in/out"
    print("## compare-hf: %s (%s, %d layers, hidden %d), pdserve --backend %s vs %s" % (
        name, shape, cfg["num_hidden_layers"], cfg["hidden_size"], a.backend, ref.desc))
    print("%d prompts (%d of real text), lengths %d..%d, %d greedy tokens; tolerance %g max abs" % (
        len(prompts), kinds.count("text"), min(map(len, prompts)), max(map(len, prompts)), a.tokens, tol))
    print()
    print("| # | kind | len | max abs (positions) | max abs (prefill row) | rel | max abs (greedy steps) "
          "| continuation |")
    print("|---|---|---|---|---|---|---|---|")
    worst_pos = worst_pre = worst_step = worst_rel = 0.0
    identical, diverged = 0, []
    per_prompt = []
    batched = ref.run_all(prompts, a.tokens, tol) if hasattr(ref, "run_all") and not a.one_by_one else None
    exact = None
    if a.fp32_check and a.reference == "hf" and backend_dtype(a.backend) != "float32":
        exact = HFReference(ref_model, "float32", a.hf_device, a.attn)
        exact_sums = {"pdserve": [0.0, 0.0], "reference": [0.0, 0.0], "count": 0}
    for p, ids in enumerate(prompts):
        n = len(ids)
        r = pd["prompts"][p]
        rows = pd_rows.get(r["logits_row"], n)
        prefill = pd_rows.get(r["logits_row"] + n, 1)
        ref_out = batched[p] if batched else ref.run(ids, a.tokens)
        d_pos, m_ref = max_abs_diff(rows, ref_out["rows"])
        if exact is not None:
            fp32_rows = exact.logits(ids)
            for side, got in (("pdserve", rows), ("reference", ref_out["rows"])):
                d = np.abs(np.asarray(got, dtype=np.float32) - fp32_rows)
                exact_sums[side][0] = max(exact_sums[side][0], float(d.max()))
                exact_sums[side][1] += float(d.sum())
            exact_sums["count"] += fp32_rows.size
        d_pre, _ = max_abs_diff(prefill, ref_out["rows"][n - 1:n])
        rel = max(d_pos, d_pre) / m_ref if m_ref > 0 else float("inf")
        g_pd, g_ref = r["greedy"], ref_out["greedy"]
        first = next((s for s in range(min(len(g_pd), len(g_ref))) if g_pd[s] != g_ref[s]), None)
        if first is None and len(g_pd) != len(g_ref):
            first = min(len(g_pd), len(g_ref))
        # Greedy-step logits at pdserve's top-k ids while both histories agree
        # (the step that diverges still has the same history: include it).
        d_step = 0.0
        agree = len(g_pd) if first is None else first + 1
        for s in range(min(agree, len(g_pd))):
            for i, v in zip(r["top_ids"][s], r["top_logits"][s]):
                rv = step_value(ref_out["step_rows"][s], i)
                if rv is not None:
                    d = abs(v - rv)
                    d_step = d if (d > d_step or d != d) else d_step
        worst_pos, worst_pre = max(worst_pos, d_pos), max(worst_pre, d_pre)
        worst_step, worst_rel = max(worst_step, d_step), max(worst_rel, rel)
        info = {"prompt": p, "kind": kinds[p], "len": n, "max_abs_positions": d_pos, "max_abs_prefill": d_pre,
                "rel": rel, "max_abs_steps": d_step, "first_divergence": first}
        if first is None:
            identical += 1
            cont = "identical"
        else:
            info.update(divergence(first, g_pd, g_ref, r, ref_out, tol))
            diverged.append(info)
            cont = "differs at step %d%s" % (first, " (near tie)" if info.get("near_tie") else "")
        per_prompt.append(info)
        print("| %d | %s | %d | %.3g | %.3g | %.2g | %.3g | %s |" % (p, kinds[p], n, d_pos, d_pre, rel, d_step,
                                                                 cont))
    ref_seconds = time.time() - t0
    need = math.ceil(a.min_identical * len(prompts) - 1e-9)
    logits_ok = max(worst_pos, worst_pre, worst_step) <= tol
    greedy_ok = identical >= need
    print()
    print("max abs logit diff: %.3g over every prompt position, %.3g on the prefill rows, %.3g at greedy steps "
          "(pdserve's top-%d ids); worst relative %.3g" % (worst_pos, worst_pre, worst_step, a.top_k, worst_rel))
    near_ties = sum(1 for d in diverged if d["near_tie"])
    print("greedy %d-token continuations identical: %d/%d (need %d); %d more differ first at a near tie" % (
        a.tokens, identical, len(prompts), need, near_ties))
    for d in diverged:
        print("  prompt %d (%s, %d tokens): first divergent step %d: pdserve %d, reference %d; reference top-2 %s "
              "(gap %.3g), pdserve top-2 %s (gap %s) -> %s" % (
                  d["prompt"], d["kind"], d["len"], d["first_divergence"], d["pdserve_token"], d["ref_token"],
                  d["ref_top2"], d["ref_gap"], d["pd_top2"],
                  "%.3g" % d["pd_gap"] if d["pd_gap"] is not None else "?",
                  "near tie (gap <= 2 x tolerance)" if d["near_tie"] else "NOT a near tie"))
    secs = pd.get("seconds", {})
    print("pdserve score: %.1f s wall (all-position pass %.2f s, prefill %.2f s, decode %.2f s); reference %.1f s" % (
        pd["wall_seconds"], secs.get("all_positions", 0), secs.get("prefill", 0), secs.get("decode", 0),
        ref_seconds))
    fp32_check = None
    if exact is not None:
        fp32_check = {side: {"max_abs": exact_sums[side][0], "mean_abs": exact_sums[side][1] / exact_sums["count"]}
                      for side in ("pdserve", "reference")}
        print("against HF in float32 on the same weights (every prompt position): pdserve %s max abs %.3g, "
              "mean abs %.3g; the reference (HF %s) max abs %.3g, mean abs %.3g" % (
                  a.backend, fp32_check["pdserve"]["max_abs"], fp32_check["pdserve"]["mean_abs"],
                  backend_dtype(a.backend), fp32_check["reference"]["max_abs"],
                  fp32_check["reference"]["mean_abs"]))
        del exact
    self_check = None
    if a.hf_self_check and batched and getattr(ref, "batch_dropped", False):
        print("HF against itself: not measured (the padded batch was dropped, so the reference already ran "
              "one prompt at a time)")
    elif a.hf_self_check and batched:
        self_check = hf_self_check(ref, prompts, a.tokens, batched, pd)
    attn_check = None
    if a.hf_attn_check and a.reference == "hf":
        attn_check = hf_attn_check(a, ref_model, prompts, batched, ref, pd, tol)
    passed = logits_ok and greedy_ok
    print("RESULT: %s (logits %s tolerance %g; continuations %d/%d %s %d)" % (
        "PASS" if passed else "FAIL", "within" if logits_ok else "NOT within", tol, identical, len(prompts),
        ">=" if greedy_ok else "<", need))
    return {"model": name, "shape": shape, "backend": a.backend, "reference": ref.desc, "tolerance": tol,
            "prompts": len(prompts), "tokens": a.tokens, "max_abs_positions": worst_pos,
            "max_abs_prefill": worst_pre, "max_abs_steps": worst_step, "max_rel": worst_rel,
            "identical": identical, "identical_needed": need, "near_ties": near_ties,
            "passed": passed, "hf_self_check": self_check, "hf_attn_check": attn_check, "fp32_check": fp32_check,
            "per_prompt": per_prompt}


def agreement(runs, base, pd):
    """Two reference runs over the same prompts: identical continuations,
    the prompts that part, the largest logit difference over prompt
    positions, and how many of runs' continuations pdserve's equal."""
    same = same_pd = 0
    worst = 0.0
    parted = []
    for p, (one, other) in enumerate(zip(runs, base)):
        d, _ = max_abs_diff(one["rows"], other["rows"])
        worst = max(worst, d)
        if one["greedy"] == other["greedy"]:
            same += 1
        else:
            parted.append(p)
        same_pd += one["greedy"] == pd["prompts"][p]["greedy"]
    return same, parted, worst, same_pd


def hf_self_check(ref, prompts, tokens, batched, pd):
    """HF against itself: the same prompts one at a time (other GEMM shapes,
    no padding mask, so other summation orders) against the padded batch.
    Where those two disagree, the continuation hangs on a tie that fp16
    rounding decides, and no other implementation can be held to either."""
    same, parted, worst, same_pd = agreement(
        [ref.run(ids, tokens) for ids in prompts], batched, pd)
    n = len(prompts)
    print("HF against itself (one prompt at a time vs the padded batch): %d/%d continuations identical "
          "(differing: %s), max abs logit diff %.3g over prompt positions; pdserve against HF one at a "
          "time: %d/%d identical" % (same, n, ", ".join(map(str, parted)) or "none", worst, same_pd, n))
    return {"identical": same, "differing": parted, "max_abs_positions": worst, "pdserve_identical": same_pd}


def hf_attn_check(a, model_dir, prompts, batched, ref, pd, tol):
    """HF against HF with another attention implementation, one prompt at a
    time: the same weights, dtype and GEMMs, only the attention's arithmetic
    differs. The share of identical continuations is what an exact
    implementation of the same model can expect against the reference on
    this model; pdserve's share is printed beside it."""
    other = HFReference(model_dir, backend_dtype(a.backend), a.hf_device, a.hf_attn_check)
    base = batched or [ref.run(ids, a.tokens) for ids in prompts]
    same, parted, worst, same_pd = agreement([other.run(ids, a.tokens) for ids in prompts], base, pd)
    n = len(prompts)
    print("HF with attention %s against the reference (%s): %d/%d continuations identical (differing: %s), "
          "max abs logit diff %.3g over prompt positions (tolerance %g); pdserve against it: %d/%d identical" % (
              a.hf_attn_check, ref.desc.split("attention ")[-1], same, n, ", ".join(map(str, parted)) or "none",
              worst, tol, same_pd, n))
    return {"attn": a.hf_attn_check, "identical": same, "differing": parted, "max_abs_positions": worst,
            "pdserve_identical": same_pd}


def divergence(s, g_pd, g_ref, r, ref_out, tol):
    """Both sides' top-two logits at the first divergent step s."""
    if s >= len(g_pd) or s >= len(g_ref):
        return {"pdserve_token": None, "ref_token": None, "ref_top2": [], "pd_top2": [], "ref_gap": float("inf"),
                "pd_gap": None, "near_tie": False}
    q, h = g_pd[s], g_ref[s]
    row = ref_out["step_rows"][s]
    rq, rh = step_value(row, q), step_value(row, h)
    ref_gap = (rh - rq) if rq is not None else float("inf")
    pd_vals = dict(zip(r["top_ids"][s], r["top_logits"][s]))
    # h outside pdserve's top-k: the gap is at least top-1 minus the k-th.
    pd_gap = pd_vals[q] - pd_vals[h] if h in pd_vals else pd_vals[q] - min(pd_vals.values())
    pd_top2 = sorted(pd_vals.items(), key=lambda kv: (-kv[1], kv[0]))[:2]
    near = ref_gap <= 2 * tol and pd_gap <= 2 * tol and h in pd_vals
    fmt = lambda items: "[%s]" % ", ".join("%d: %.4g" % (i, v) for i, v in items)
    return {"pdserve_token": q, "ref_token": h, "ref_top2": fmt(top_two(row)), "pd_top2": fmt(pd_top2),
            "ref_gap": ref_gap, "pd_gap": pd_gap, "near_tie": near}


if __name__ == "__main__":
    main()
