#!/usr/bin/env python3
"""Disaggregated prefill/decode end to end on one machine (one GPU), Python only.

    python3 scripts/gpu-disagg.py [MODEL] [--device cuda|cpu] [--dtype float16]
        [--check-dtype float32] [--requests 32] [--max-tokens 32]
        [--bench-lengths 128,512,2016] [--concurrency 1,8] [--bench-requests 16]
        [--send-type PUT_ASYNC] [--transport tcp] [--json SUMMARY.json]
        [--prefill-device cuda:0 --decode-device cuda:1]   (nccl: two GPUs)

Starts pdproxy (discovery on), a prefill instance (kv_producer), a decode
instance (kv_consumer) — both announcing themselves to the proxy — and a
colocated instance, all `pdserve serve --device DEVICE` on the same device
(or prefill and decode on --prefill-device / --decode-device: the nccl
transport wants them on two different GPUs, as NCCL puts one rank per GPU).
With --transport nccl and both on one GPU, the two instances get different
NCCL_HOSTIDs (and NCCL_SOCKET_IFNAME=lo), so NCCL takes them for two hosts
and joins them through its socket transport over loopback: the whole nccl
path of pdserve runs (device buffers, ready events, ncclSend/ncclRecv), at
socket speed, not NVLink's. A check of correctness, not a benchmark.

1. Correctness (instances in --check-dtype, default float32 so that rounding
   cannot flip a greedy near tie): --requests completions (temperature 0,
   prompts of token ids with lengths up to ~2k, including 512 and the
   longest that fits) through the proxy and to the colocated instance must
   give the same text, token count and finish reason; a quarter of them
   are streamed through the proxy and must give the same text too. The
   decode instance must have computed exactly one prompt token per request
   (the rest came over the KV transfer), the prefill instance must have
   sent KV for each.
2. Speed (instances in --dtype): TTFT and TPOT from streamed completions
   (SSE read line by line) for 1P1D through the proxy and for the
   colocated instance, per prompt length and concurrency; a markdown table.

Every process is stopped on exit, also on failure or Ctrl-C; on failure the
tails of the server logs are printed. Exit status 0 when the check passed.
MODEL defaults to a random-weight opt-125m made with `pdserve make-model
--preset PRESET --dtype float16` under $PDSERVE_BENCH_DIR (default
/tmp/pdserve-bench-gpu). Binaries: .devpack/bin (with .devpack/lib) when
present, else build/; or --pdserve / --pdproxy.
"""
import argparse
import concurrent.futures as futures
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_binary(given, name):
    if given:
        return os.path.abspath(given)
    for cand in (os.path.join(ROOT, ".devpack/bin", name), os.path.join(ROOT, "build", name)):
        if os.path.exists(cand):
            return cand
    raise SystemExit("gpu-disagg: no %s binary found (give --%s)" % (name, name))


def env_for(binary):
    env = dict(os.environ)
    lib = os.path.join(os.path.dirname(os.path.dirname(binary)), "lib")
    if os.path.isdir(lib):
        env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:  # all bound at once, so the ports are distinct
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Stack:
    """The processes of one run; stop() ends every one of them."""

    def __init__(self, log_dir):
        self.log_dir = log_dir
        self.procs = []  # (name, Popen, log path)

    def start(self, name, argv, env):
        path = os.path.join(self.log_dir, name + ".log")
        log = open(path, "w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
        log.close()
        self.procs.append((name, p, path))
        return p

    def check_alive(self):
        for name, p, path in self.procs:
            if p.poll() is not None:
                raise RuntimeError("%s exited with status %s (log %s)" % (name, p.returncode, path))

    def stop(self):
        for _, p, _ in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.time() + 15
        for _, p, _ in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []

    def tails(self, lines=25):
        out = []
        for name, _, path in self.procs:
            try:
                with open(path, errors="replace") as f:
                    tail = f.readlines()[-lines:]
            except OSError:
                tail = []
            out.append("--- %s (%s), last %d lines ---\n%s" % (name, path, len(tail), "".join(tail)))
        return "\n".join(out)


def http_json(url, body=None, timeout=300):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, text


def http_text(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode(errors="replace")


def wait_healthy(stack, url, what, timeout):
    t0 = time.time()
    last = None
    while time.time() - t0 < timeout:
        stack.check_alive()
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.time() - t0
        except (urllib.error.URLError, OSError, ValueError) as e:
            last = e
        time.sleep(0.2)
    raise RuntimeError("%s at %s not healthy after %.0f s (%s)" % (what, url, timeout, last))


def metric_sum(text, name):
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        key = line.split("{", 1)[0].split(" ", 1)[0]
        if key == name:
            total += float(line.rsplit(" ", 1)[1])
    return total


def kv_config(role, kv_port, disc_port, http_port, a):
    extra = {"recv_into_pinned": True} if a.recv_into_pinned else {}
    if a.tcp_streams > 1:
        extra["tcp_streams"] = a.tcp_streams
    return json.dumps({
        "kv_connector": "P2pNcclConnector",
        "kv_role": role,
        "kv_ip": "127.0.0.1",
        "kv_port": kv_port,
        "kv_buffer_size": "4e9",
        "kv_connector_extra_config": {
            "proxy_ip": "127.0.0.1",
            "proxy_port": str(disc_port),
            "http_port": str(http_port),
            "send_type": a.send_type,
            "transport": a.transport,
            "nccl_num_channels": "8",
            "timeout_s": 60,
            **extra,
        },
    })


def start_stack(a, dtype, model, pdserve, pdproxy, log_dir, tag):
    stack = Stack(log_dir)
    px, disc, p_http, d_http, c_http, p_kv, d_kv = free_ports(7)
    common = [model, "--host", "127.0.0.1", "--served-model-name", "m",
              "--dtype", dtype, "--max-model-len", str(a.max_model_len), "--log-level", a.log_level]
    dev = {"prefill": a.prefill_device or a.device, "decode": a.decode_device or a.device, "colocated": a.device}
    if a.device != "cpu":
        # Three instances share one GPU: each takes a share of its memory, as
        # vLLM instances side by side must (the default 0.9 fits only one).
        common += ["--gpu-memory-utilization", str(a.gpu_memory_utilization)]
    env_p, env_d = env_for(pdserve), env_for(pdserve)
    if a.transport == "nccl" and dev["prefill"] == dev["decode"]:
        for env, host in ((env_p, "pdserve-prefill"), (env_d, "pdserve-decode")):
            env.update(NCCL_HOSTID=host, NCCL_SOCKET_IFNAME="lo")
        if tag == "check":
            print("nccl with prefill and decode on one GPU (%s): NCCL_HOSTID differs per instance, so NCCL "
                  "joins them through its socket transport (loopback), not GPU to GPU" % dev["prefill"])
    try:
        stack.start(tag + "-proxy", [pdproxy, "--host", "127.0.0.1", "--port", str(px), "--discovery-port",
                                     str(disc), "--discovery-host", "127.0.0.1", "--log-level", a.log_level],
                    env_for(pdproxy))
        stack.start(tag + "-prefill", [pdserve, "serve"] + common + [
            "--device", dev["prefill"], "--port", str(p_http), "--kv-transfer-config", kv_config("kv_producer", p_kv, disc, p_http, a)],
            env_p)
        stack.start(tag + "-decode", [pdserve, "serve"] + common + [
            "--device", dev["decode"], "--port", str(d_http), "--block-size", str(a.decode_block_size),
            "--kv-transfer-config", kv_config("kv_consumer", d_kv, disc, d_http, a)], env_d)
        stack.start(tag + "-colocated", [pdserve, "serve"] + common + ["--device", dev["colocated"], "--port",
                                                                        str(c_http)], env_for(pdserve))
        urls = {k: "http://127.0.0.1:%d" % v for k, v in
                (("proxy", px), ("prefill", p_http), ("decode", d_http), ("colocated", c_http))}
        t = {k: wait_healthy(stack, urls[k], k, a.start_timeout) for k in ("prefill", "decode", "colocated")}
        # The proxy is healthy once both instances' announcements arrived.
        t["proxy"] = wait_healthy(stack, urls["proxy"], "pdproxy (waiting for both announcements)", 30)
        print("%s stack up (prefill on %s, decode on %s, colocated on %s; %s): %s; ready after %s" % (
            tag, dev["prefill"], dev["decode"], dev["colocated"], dtype, ", ".join("%s %s" % kv for kv in urls.items()),
            ", ".join("%s %.1f s" % kv for kv in t.items())))
    except BaseException:
        stack_failed(stack)
        raise
    return stack, urls


def stack_failed(stack):
    sys.stdout.flush()
    sys.stderr.write(stack.tails() + "\n")
    stack.stop()


def random_prompts(n_tokens_list, seed, vocab_top=50257, bos=50256):
    rng = random.Random(seed)
    return [[bos] + [rng.randrange(3, vocab_top) for _ in range(n - 1)] for n in n_tokens_list]


def completion(url, prompt, max_tokens, ignore_eos=False):
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": ignore_eos}
    status, j = http_json(url + "/v1/completions", body)
    if status != 200:
        raise RuntimeError("%s: HTTP %d: %s" % (url, status, str(j)[:300]))
    c = j["choices"][0]
    return {"text": c["text"], "finish": c.get("finish_reason"), "tokens": j["usage"]["completion_tokens"]}


def streamed(url, prompt, max_tokens, ignore_eos=True, timeout=300):
    """One streamed completion: text, TTFT (to the first chunk with text), TPOT."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = last = None
    text, chunks, usage, finish, done = [], 0, None, None, False
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            j = json.loads(data)
            if "error" in j:
                raise RuntimeError("%s: error in stream: %s" % (url, j["error"]))
            if j.get("usage"):
                usage = j["usage"]
            for c in j.get("choices", []):
                if c.get("text"):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    chunks += 1
                    text.append(c["text"])
                if c.get("finish_reason"):
                    finish = c["finish_reason"]
    end = time.perf_counter()
    if not done:
        raise RuntimeError("%s: stream ended without [DONE]" % url)
    n = usage["completion_tokens"] if usage else chunks
    ttft = (first if first is not None else end) - t0
    tpot = (last - first) / (n - 1) if first is not None and n > 1 else 0.0
    return {"text": "".join(text), "tokens": n, "finish": finish, "ttft": ttft, "tpot": tpot, "e2e": end - t0}


def correctness(a, urls):
    max_len = a.max_model_len - a.max_tokens
    wanted = [1, 2, 7, 16, 17, 100, 512, 2016, 1000, 33]
    lengths = [min(wanted[i % len(wanted)], max_len) for i in range(a.requests)]
    if max_len < 2016:
        print("note: prompt lengths capped at %d (max model length %d - %d output tokens)" % (
            max_len, a.max_model_len, a.max_tokens))
    prompts = random_prompts(lengths, seed=a.seed)
    before = {k: http_text(urls[k] + "/metrics") for k in ("prefill", "decode")}

    def one(i):
        ref = completion(urls["colocated"], prompts[i], a.max_tokens)
        got = completion(urls["proxy"], prompts[i], a.max_tokens)
        st = streamed(urls["proxy"], prompts[i], a.max_tokens, ignore_eos=False) if i % 4 == 3 else None
        return i, ref, got, st

    bad = []
    with futures.ThreadPoolExecutor(max_workers=4) as pool:
        for i, ref, got, st in pool.map(one, range(len(prompts))):
            same = (ref["text"], ref["tokens"], ref["finish"]) == (got["text"], got["tokens"], got["finish"])
            if st is not None and (st["text"], st["tokens"]) != (ref["text"], ref["tokens"]):
                bad.append("request %d (%d prompt tokens): streamed through the proxy %r (%d tokens), colocated "
                           "%r (%d tokens)" % (i, lengths[i], st["text"][:60], st["tokens"], ref["text"][:60],
                                               ref["tokens"]))
            if not same:
                bad.append("request %d (%d prompt tokens): proxy %r (%d tokens, %s), colocated %r (%d tokens, %s)" % (
                    i, lengths[i], got["text"][:60], got["tokens"], got["finish"], ref["text"][:60],
                    ref["tokens"], ref["finish"]))
    after = {k: http_text(urls[k] + "/metrics") for k in ("prefill", "decode")}
    d = lambda k, name: metric_sum(after[k], name) - metric_sum(before[k], name)
    computed = d("decode", "pdserve:prompt_tokens_computed_total")
    n_proxy = len(prompts) + sum(1 for i in range(len(prompts)) if i % 4 == 3)
    saves = d("prefill", "pdserve:kv_saves_total")
    loads = d("decode", "pdserve:kv_loads_total")
    sent = d("prefill", "pdserve:kv_bytes_sent_total")
    received = d("decode", "pdserve:kv_bytes_received_total")
    multi = sum(1 for i in range(len(prompts)) if lengths[i] > 1) + sum(
        1 for i in range(len(prompts)) if i % 4 == 3 and lengths[i] > 1)
    print("correctness: %d requests through pdproxy (%d of them streamed again) vs colocated: %d differ" % (
        len(prompts), n_proxy - len(prompts), len(bad)))
    print("  decode instance computed %d prompt tokens for %d proxied requests (1 each expected); "
          "KV: %d saves on P (%d expected), %d loads on D, %.1f MB sent, %.1f MB received" % (
              computed, n_proxy, saves, n_proxy, loads, sent / 1e6, received / 1e6))
    for b in bad:
        print("  MISMATCH " + b)
    problems = list(bad)
    if computed != n_proxy:
        problems.append("decode computed %d prompt tokens, expected %d" % (computed, n_proxy))
    if saves != n_proxy:
        problems.append("prefill saved KV %d times, expected %d" % (saves, n_proxy))
    if loads < multi:
        problems.append("decode loaded KV %d times, expected at least %d" % (loads, multi))
    return {"requests": len(prompts), "proxied": n_proxy, "mismatches": len(bad), "decode_prompt_tokens": computed,
            "kv_saves": saves, "kv_loads": loads, "kv_bytes_sent": sent, "problems": problems}


def pct(xs, q):
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def bench(a, urls):
    lengths = [min(int(x), a.max_model_len - a.max_tokens) for x in a.bench_lengths.split(",")]
    concs = [int(x) for x in a.concurrency.split(",")]
    rows, agree, total = [], 0, 0
    # Warm-up: a few requests of every length on both paths (allocations, cuBLAS heuristics).
    for L in lengths:
        for p in random_prompts([L] * 2, seed=10_000 + L):
            streamed(urls["proxy"], p, a.max_tokens)
            streamed(urls["colocated"], p, a.max_tokens)
    for L in lengths:
        for c in concs:
            prompts = random_prompts([L] * a.bench_requests, seed=L * 100 + c)
            res = {}
            for mode in ("1P1D", "colocated"):
                url = urls["proxy"] if mode == "1P1D" else urls["colocated"]
                t0 = time.perf_counter()
                with futures.ThreadPoolExecutor(max_workers=c) as pool:
                    out = list(pool.map(lambda p: streamed(url, p, a.max_tokens), prompts))
                wall = time.perf_counter() - t0
                res[mode] = out
                ttft = [o["ttft"] * 1e3 for o in out]
                tpot = [o["tpot"] * 1e3 for o in out if o["tokens"] > 1]
                toks = sum(o["tokens"] for o in out)
                rows.append({"prompt": L, "concurrency": c, "mode": mode, "requests": len(out),
                             "ttft_p50": pct(ttft, 0.5), "ttft_p90": pct(ttft, 0.9), "tpot_p50": pct(tpot, 0.5),
                             "tpot_p90": pct(tpot, 0.9), "tokens_per_s": toks / wall, "wall_s": wall})
            for x, y in zip(res["1P1D"], res["colocated"]):
                total += 1
                agree += x["text"] == y["text"]
    return rows, agree, total


def print_table(rows, a, dtype):
    print()
    print("### 1P1D through pdproxy vs colocated (%s, %s, send_type %s, transport %s, %d output tokens, "
          "ignore_eos)" % (a.device, dtype, a.send_type, a.transport, a.max_tokens))
    print()
    print("| prompt tokens | concurrency | setup | requests | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | TPOT p90 ms "
          "| output tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| %d | %d | %s | %d | %.1f | %.1f | %.2f | %.2f | %.0f |" % (
            r["prompt"], r["concurrency"], r["mode"], r["requests"], r["ttft_p50"], r["ttft_p90"], r["tpot_p50"],
            r["tpot_p90"], r["tokens_per_s"]))
    print()
    print("| prompt tokens | concurrency | TTFT 1P1D / colocated | TPOT 1P1D / colocated |")
    print("|---|---|---|---|")
    by = {(r["prompt"], r["concurrency"], r["mode"]): r for r in rows}
    for (L, c, mode), r in by.items():
        if mode != "1P1D":
            continue
        col = by[(L, c, "colocated")]
        ratio = lambda x, y: "%.2f" % (x / y) if y > 0 else "-"
        print("| %d | %d | %s | %s |" % (L, c, ratio(r["ttft_p50"], col["ttft_p50"]),
                                         ratio(r["tpot_p50"], col["tpot_p50"])))


def on_sigterm(signum, frame):
    # A timeout around us sends SIGTERM: unwind like Ctrl-C, so the servers are stopped.
    raise KeyboardInterrupt()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--preset", default="opt-125m", help="make-model preset when MODEL is not given")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16", help="dtype of the speed measurements")
    ap.add_argument("--check-dtype", default="float32", help="dtype of the correctness check")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--bench-lengths", default="128,512,2016")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--bench-requests", type=int, default=16, help="requests per (length, concurrency, setup)")
    ap.add_argument("--send-type", default="PUT_ASYNC", choices=["PUT", "PUT_ASYNC", "GET"])
    ap.add_argument("--transport", default="tcp", choices=["tcp", "nccl"])
    ap.add_argument("--prefill-device", default=None,
                    help="the prefill instance's --device (default --device); nccl needs two GPUs: cuda:0 ...")
    ap.add_argument("--decode-device", default=None, help="the decode instance's --device, e.g. cuda:1")
    ap.add_argument("--decode-block-size", type=int, default=16)
    ap.add_argument("--recv-into-pinned", action="store_true",
                    help="kv_connector_extra_config.recv_into_pinned: the decode instance receives KV into "
                         "page-locked memory (tcp)")
    ap.add_argument("--tcp-streams", type=int, default=1,
                    help="kv_connector_extra_config.tcp_streams: TCP connections per peer, layers spread over them")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.25,
                    help="each instance's share of the GPU (three run on one)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--start-timeout", type=float, default=180)
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--log-dir", default=None, help="server logs (default: a temp dir, kept on failure)")
    ap.add_argument("--pdserve", default=None)
    ap.add_argument("--pdproxy", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    signal.signal(signal.SIGTERM, on_sigterm)
    pdserve, pdproxy = find_binary(a.pdserve, "pdserve"), find_binary(a.pdproxy, "pdproxy")
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="gpu-disagg-")
    os.makedirs(log_dir, exist_ok=True)
    model = a.model
    if model is None:
        base = os.environ.get("PDSERVE_BENCH_DIR", "/tmp/pdserve-bench-gpu")
        model = os.path.join(base, "%s-fp16" % a.preset)
        if not os.path.exists(os.path.join(model, "config.json")):
            subprocess.run([pdserve, "make-model", model, "--preset", a.preset, "--dtype", "float16"], check=True,
                           env=env_for(pdserve), stdout=subprocess.DEVNULL)
    with open(os.path.join(model, "config.json")) as f:
        a.max_model_len = json.load(f)["max_position_embeddings"]
    print("gpu-disagg: model %s, pdserve %s, logs in %s" % (model, pdserve, log_dir))

    summary = {"model": model, "device": a.device, "prefill_device": a.prefill_device or a.device,
               "decode_device": a.decode_device or a.device, "transport": a.transport, "passed": False}
    ok = False
    try:
        stack, urls = start_stack(a, a.check_dtype, model, pdserve, pdproxy, log_dir, "check")
        try:
            chk = correctness(a, urls)
            summary["check"] = chk
            stack.check_alive()
            if chk["problems"]:
                raise RuntimeError("correctness check failed: " + "; ".join(chk["problems"][:5]))
            print("correctness: PASS (%s)" % a.check_dtype)
            if a.skip_bench or a.dtype != a.check_dtype:
                stack.stop()
        except BaseException:
            stack_failed(stack)
            raise
        if not a.skip_bench:
            if a.dtype != a.check_dtype:
                stack, urls = start_stack(a, a.dtype, model, pdserve, pdproxy, log_dir, "bench")
            try:
                rows, agree, total = bench(a, urls)
                px = http_text(urls["proxy"] + "/metrics")
                s, n = metric_sum(px, "pdproxy_overhead_seconds_sum"), metric_sum(px, "pdproxy_overhead_seconds_count")
                dm = http_text(urls["decode"] + "/metrics")
                layers = {k: int(metric_sum(dm, "pdserve:kv_layers_written%s_total" % k))
                          for k in ("", "_on_arrival", "_from_pinned")}
                stack.check_alive()
                stack.stop()
            except BaseException:
                stack_failed(stack)
                raise
            print_table(rows, a, a.dtype)
            print()
            print("proxy added latency: %.3f ms per request (pdproxy_overhead_seconds, %d requests)" % (
                1e3 * s / max(n, 1), n))
            print("decode instance: %d layers written into its cache, %d as they arrived, %d from page-locked "
                  "memory by a queued copy (recv_into_pinned)" % (layers[""], layers["_on_arrival"],
                                                                 layers["_from_pinned"]))
            print("speed-run outputs identical between 1P1D and colocated: %d/%d (%s; informational: in 16-bit "
                  "a near tie may flip)" % (agree, total, a.dtype))
            summary.update({"bench": rows, "bench_identical": agree, "bench_total": total,
                            "proxy_overhead_ms": 1e3 * s / max(n, 1), "decode_layers_written": layers})
        ok = True
        summary["passed"] = True
    except KeyboardInterrupt:
        print("gpu-disagg: interrupted")
    except Exception as e:  # report, clean up, fail
        print("gpu-disagg: FAIL: %s" % e)
        print("(logs kept in %s)" % log_dir)
    finally:
        if a.json:
            with open(a.json, "w") as f:
                json.dump(summary, f, indent=1)
    if ok and not a.log_dir:
        for f in os.listdir(log_dir):
            os.remove(os.path.join(log_dir, f))
        os.rmdir(log_dir)
    print("RESULT: %s" % ("PASS" if ok else "FAIL"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
