"""What the Python benches share with mkbench: its measurement protocol and its JSON record.

- `stats(samples)`: median, nearest-rank p10 / p90, min and count, as measure.rs.
- `interleaved(calls, ...)`: mkbench's protocol (docs/benchmarks.md) for callables on the
  current CUDA stream: -w warm-up calls each, then blocks in which every contender, in an
  order rotated by one per block, makes -n calls, each timed by its own pair of CUDA
  events, with the host's time to enqueue it; one synchronisation per block.
- `record(bench, ok, config, rows)`: the run's record in mkbench's schema (mkbench/1),
  with the machine as nvidia-smi reports it and the commit (MK_COMMIT, else git).

Everything but `interleaved` runs without torch (scripts/test-bench.sh checks the records
on a CPU).
"""

import datetime
import math
import os
import subprocess
import sys
import time

SCHEMA = "mkbench/1"


def stats(samples):
    """Median, nearest-rank p10 / p90, min and count of `samples` (µs), as measure.rs."""
    v = sorted(samples)
    n = len(v)
    median = v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2

    def pct(q):
        return v[min(max(math.ceil(q * n), 1), n) - 1]

    return {"median_us": median, "p10_us": pct(0.10), "p90_us": pct(0.90), "min_us": v[0], "samples": n}


def contender(name, timed):
    """A record's contender from `timed` = (GPU µs samples, host µs samples), or None where
    it did not run (its median is then null)."""
    if timed is None:
        return {"name": name, "median_us": None}
    gpu, host = timed
    return {"name": name, **stats(gpu), "host_enqueue_us": stats(host)["median_us"]}


def interleaved(calls, warmup, blocks, iters):
    """Times every callable of `calls` (name -> fn) by the protocol above. Returns name ->
    (GPU µs samples, host µs samples), or None for a contender whose warm-up raised (it
    does not take the case), with the reason printed."""
    import torch

    results, usable = {}, []
    for name, fn in calls.items():
        try:
            for _ in range(warmup):
                fn()
            torch.cuda.synchronize()
            usable.append(name)
            results[name] = ([], [])
        except Exception as e:  # noqa: BLE001 -- a backend that refuses this shape
            results[name] = None
            print(f"  {name}: unavailable: {type(e).__name__}: {e}")
    for block in range(blocks):
        for i in range(len(usable)):
            name = usable[(i + block) % len(usable)]
            pairs = []
            for _ in range(iters):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                t = time.perf_counter()
                calls[name]()
                results[name][1].append((time.perf_counter() - t) * 1e6)
                b.record()
                pairs.append((a, b))
            torch.cuda.synchronize()
            results[name][0].extend(a.elapsed_time(b) * 1e3 for a, b in pairs)
    return results


def add_protocol_args(ap):
    """The protocol's options (-w, -n, --blocks) and --json, as mkbench names them."""
    ap.add_argument("-w", dest="warmup", type=int, default=3)
    ap.add_argument("-n", dest="iters", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--json", help="write the run's record (mkbench/1) here")


def protocol_config(args):
    return {"warmup": args.warmup, "blocks": args.blocks, "iters": args.iters}


def row(shape, results, notes=None):
    """A record's row: `shape` (the case's keys) and one contender per entry of `results`
    (name -> timed, as `interleaved` returns), with `notes[name]` (a dict) added to it."""
    notes = notes or {}
    return {"shape": shape, "contenders": [{**contender(name, t), **notes.get(name, {})} for name, t in results.items()]}


def print_timed(label, results, flops, notes=None, no_flops=()):
    """One line per contender that ran: `label`, its name, median ms, TF/s for `flops`
    ("-" for the contenders in `no_flops`, which do no math: a copy), p10 / p90 ms, host
    µs, and `notes[name]` (text) if given."""
    for name, timed in results.items():
        if timed is None:
            continue
        s, host = stats(timed[0]), stats(timed[1])
        ms = s["median_us"] / 1e3
        note = (notes or {}).get(name, "")
        tf = "-" if name in no_flops else f"{flops / ms / 1e9:.1f}"
        print(f"  {label} | {name:>28} {ms:>8.3f} {tf:>7} {s['p10_us'] / 1e3:>8.3f} "
              f"{s['p90_us'] / 1e3:>8.3f} {host['median_us']:>8.1f} {note:>8}")


def write(path, bench, ok, config, rows):
    """Writes the record (below) as one JSON line to `path`."""
    import json

    with open(path, "w") as f:
        json.dump(record(bench, ok, config, rows), f)
        f.write("\n")


def machine():
    """The GPU as nvidia-smi reports it now (null fields where it is missing)."""
    fields = {k: None for k in ("gpu", "driver", "sm_clock_mhz", "max_sm_clock_mhz", "mem_clock_mhz")}
    count = 0
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem",
             "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
        lines = [line for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []
    except (OSError, subprocess.SubprocessError):
        lines = []
    if lines:
        count = len(lines)
        f = [x.strip() for x in lines[0].split(",")]
        for i, key in enumerate(fields):
            if i < len(f) and f[i]:
                if i < 2:
                    fields[key] = f[i]
                else:
                    try:
                        fields[key] = float(f[i])
                    except ValueError:
                        pass
    try:
        host = open("/proc/sys/kernel/hostname").read().strip()
    except OSError:
        host = None
    return {**fields, "gpu_count": count, "host": host}


def commit():
    if os.environ.get("MK_COMMIT"):
        return os.environ["MK_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=20)
        if out.returncode == 0:
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def record(bench, ok, config, rows):
    """The whole record (docs/benchmarks.md)."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"schema": SCHEMA, "bench": bench, "ok": ok, "command": list(sys.argv), "commit": commit(),
            "date": date, "machine": machine(), "config": config, "rows": rows}
