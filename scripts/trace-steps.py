#!/usr/bin/env python3
"""trace-steps: where the time of a decode step goes, from a timeline written
by scripts/cupti-trace.c (start_ns,duration_ns,name).

A decode step replayed as a CUDA graph begins with its metadata copy (host
to device) or its embedding kernel, so the timeline is cut there, and the pieces with
the most common number of nodes are the decode steps. `pdserve bench-cpu`
runs them two ways: one at a time as the server does (the host waits for
each), and, halfway, one graph replayed back to back (the device alone).
For the back-to-back ones, per node of the step (medians):
  end+   how much later this node ends than every node before it: its share
         of the step's critical path (the column sums to the step's time);
  early  how long before the previous node's end it started (PDL lets a
         kernel start, and load its weights, while the one before runs;
         negative: it started after);
  dur    its own start to end (under PDL this includes its wait).
Then the same summed by kernel name, and the host's gap between one-at-a-
time steps. CUPTI's own cost makes every figure a little larger.

    python3 scripts/trace-steps.py cupti-trace.csv
"""
import csv
import re
import statistics as st
import sys


def short(name):
    m = re.match(r"_Z(\d+)", name)  # an Itanium-mangled function: its bare name
    if m:
        return name[m.end():m.end() + int(m.group(1))]
    return re.sub(r"[<(].*", "", name)[:44]


def end(e):
    return e[0] + e[1]


def main():
    ev = []
    with open(sys.argv[1]) as f:
        for r in csv.DictReader(f):
            ev.append((int(r["start_ns"]), int(r["duration_ns"]), r["name"]))
    ev.sort()
    segs, cur = [], None
    prev = None
    for e in ev:
        # a step starts at its metadata copy, or, where the recording reads
        # the metadata in place (PDSERVE_GRAPH_META=host), at its embedding
        first = e[2] == "[memcpy HtoD]" or (
            short(e[2]).startswith("embedding") and (prev is None or prev[2] != "[memcpy HtoD]"))
        if first:
            cur = [e]
            segs.append(cur)
        elif cur is not None:
            cur.append(e)
        prev = e
    if len(segs) < 3:
        print("fewer than 3 steps in the trace")
        return
    L = st.mode(len(s) for s in segs[:-1])
    full = [i for i in range(1, len(segs) - 1) if len(segs[i]) == L and len(segs[i - 1]) == L]
    # back to back: the step began less than 5 us after the previous one ended
    gap = {i: segs[i][0][0] - max(end(e) for e in segs[i - 1]) for i in full}
    bb = [i for i in full if gap[i] < 5000]
    alone = [i for i in full if gap[i] >= 5000]
    print(f"{len(ev)} records; steps of {L} nodes: {len(bb)} back to back, {len(alone)} one at a time")
    if not bb:
        return
    span = st.median(max(end(e) for e in segs[i]) - segs[i][0][0] for i in bb)
    print(f"back to back: first node start to last node end, median {span / 1e3:.2f} us; "
          f"gap between steps {st.median(gap[i] for i in bb) / 1e3:.2f} us")
    if alone:
        print(f"one at a time: the gap before a step (the host's: wait, read, write, launch), "
              f"median {st.median(gap[i] for i in alone) / 1e3:.2f} us")
    print(f"{'#':>3} {'kernel':44} {'end+':>6} {'early':>6} {'dur':>6}")
    agg, total = {}, 0.0
    for k in range(L):
        inc = [end(segs[i][k]) - (max(end(e) for e in segs[i][:k]) if k else segs[i][0][0])
               for i in bb]
        early = [end(segs[i][k - 1]) - segs[i][k][0] for i in bb] if k else [0]
        dur = [segs[i][k][1] for i in bb]
        mi, me, md = st.median(inc) / 1e3, st.median(early) / 1e3, st.median(dur) / 1e3
        total += mi
        nm = short(segs[bb[-1]][k][2])
        a = agg.setdefault(nm, [0, 0.0])
        a[0] += 1
        a[1] += mi
        print(f"{k:3} {nm:44} {mi:6.2f} {me:6.2f} {md:6.2f}")
    print(f"sum of end+: {total:.2f} us")
    print(f"{'by kernel':44} {'n':>3} {'end+ us':>8}")
    for nm, (c, d) in sorted(agg.items(), key=lambda x: -x[1][1]):
        print(f"{nm:44} {c:3} {d:8.2f}")


if __name__ == "__main__":
    main()
