#!/usr/bin/env python3
"""Copy bandwidths of this GPU machine, measured with torch, as the links the
KV transfer runs over: host<->device with pinned and with pageable host
memory (the tcp data plane stages device KV through host memory), and
GPU 0 -> GPU 1 when two GPUs are visible (what the nccl data plane rides on).
Best of --reps copies of --mib MiB each, timed with CUDA events; a markdown
table on stdout.

    python3 scripts/gpu-link-bw.py [--mib 256] [--reps 5] [--json OUT.json]
"""
import argparse
import json
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("gpu-link-bw: torch is not installed")
        return 1

    if not torch.cuda.is_available():
        print("gpu-link-bw: no CUDA device visible to torch")
        return 1
    n = a.mib << 20

    def best(copy, device=0):
        torch.cuda.set_device(device)
        copy()  # warm-up
        torch.cuda.synchronize()
        top = 0.0
        for _ in range(a.reps):
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            copy()
            t1.record()
            t1.synchronize()
            top = max(top, n / (t0.elapsed_time(t1) / 1e3))
        return top

    dev = torch.empty(n, dtype=torch.uint8, device="cuda:0")
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(n, dtype=torch.uint8)
    pageable.fill_(1)  # fault the pages in
    rows = [
        ("host -> device, pinned", best(lambda: dev.copy_(pinned, non_blocking=True))),
        ("device -> host, pinned", best(lambda: pinned.copy_(dev, non_blocking=True))),
        ("host -> device, pageable", best(lambda: dev.copy_(pageable))),
        ("device -> host, pageable", best(lambda: pageable.copy_(dev))),
        ("device -> device (same GPU)", best(lambda: dev[n // 2:].copy_(dev[:n // 2])) / 2),
    ]
    if torch.cuda.device_count() >= 2:
        other = torch.empty(n, dtype=torch.uint8, device="cuda:1")
        rows.append(("GPU 0 -> GPU 1", best(lambda: other.copy_(dev, non_blocking=True))))
        peer = "GPU 0 -> GPU 1 measured"
    else:
        peer = "GPU 0 -> GPU 1: not run (one GPU)"
    print("%s, torch %s, %d MiB per copy, best of %d; %s" % (torch.cuda.get_device_name(0), torch.__version__,
                                                             a.mib, a.reps, peer))
    print()
    print("| copy | GB/s |")
    print("|---|---|")
    for name, bw in rows:
        print("| %s | %.1f |" % (name, bw / 1e9))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({name: bw for name, bw in rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
