#!/usr/bin/env python3
"""Turns mkbench JSON records (docs/benchmarks.md) into PNG plots.

    python3 benches/plot.py RECORD.json [RECORD.json ...] -o DIR
    python3 benches/plot.py --check RECORD.json [...]     (validate only; no matplotlib needed)

Per record: collectives (rows with "bytes") get nccl-tests style curves, bus bandwidth and
latency against size, one line per contender, one PNG per dtype; every other bench gets the
speedup of the op under test ("fused", "mk" for the GEMM engine, or the row's mkernel_*
contender in the Python benches) over each baseline per shape (baseline time / its time: above 1 ours wins; graph replays against our graph
replays, cold-L2 times against our cold-L2 time), and its time per contender. Every record
is validated first; a record that does not match the schema stops the run with the rule it
broke.
"""
import argparse
import json
import math
import os
import sys

SCHEMA = "mkbench/1"
TOP_KEYS = {"schema": str, "bench": str, "ok": bool, "command": list, "commit": str, "date": str,
            "machine": dict, "config": dict, "rows": list}
MACHINE_KEYS = ("gpu", "driver", "sm_clock_mhz", "max_sm_clock_mhz", "mem_clock_mhz", "gpu_count", "host")
STAT_KEYS = ("median_us", "p10_us", "p90_us", "min_us", "host_enqueue_us")
GRAPH_SUFFIX = "_graph"


class SchemaError(ValueError):
    pass


def _need(cond, where, rule):
    if not cond:
        raise SchemaError(f"{where}: {rule}")


def _number_or_null(v):
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))


def validate(rec, where="record"):
    """Raises SchemaError naming the first rule `rec` breaks (docs/benchmarks.md)."""
    _need(isinstance(rec, dict), where, "a record is a JSON object")
    for key, kind in TOP_KEYS.items():
        _need(key in rec, where, f'missing key "{key}"')
        _need(isinstance(rec[key], kind), where, f'"{key}" must be a {kind.__name__}')
    _need(rec["schema"] == SCHEMA, where, f'"schema" must be "{SCHEMA}", not {rec["schema"]!r}')
    _need(all(isinstance(a, str) for a in rec["command"]), where, '"command" is a list of strings')
    # A record transcribed from a dated results note (benches/records.py) holds only what
    # the note states: the day without a time, the GPU without its clocks.
    transcribed = "transcribed_from" in rec
    full_date = len(rec["date"]) == 20 and rec["date"].endswith("Z") and rec["date"][10] == "T"
    day = len(rec["date"]) == 10 and rec["date"][4] == "-" and rec["date"][7] == "-"
    _need(full_date or (transcribed and day), where, '"date" is ISO 8601 UTC, e.g. 2026-12-05T02:10:00Z'
          + (" (or the day, 2026-12-05, in a transcribed record)" if transcribed else ""))
    for key in ("gpu",) if transcribed else MACHINE_KEYS:
        _need(key in rec["machine"], f"{where}.machine", f'missing key "{key}"')
    for key in ("sm_clock_mhz", "max_sm_clock_mhz", "mem_clock_mhz"):
        _need(_number_or_null(rec["machine"].get(key)), f"{where}.machine", f'"{key}" is a number or null')
    for i, row in enumerate(rec["rows"]):
        w = f"{where}.rows[{i}]"
        _need(isinstance(row, dict), w, "a row is an object")
        _need(isinstance(row.get("shape"), dict) and row["shape"], w, '"shape" is a non-empty object')
        for k, v in row["shape"].items():
            _need(isinstance(v, (str, int, float)) and not isinstance(v, bool), w, f'shape "{k}" is a number or a string')
        cs = row.get("contenders")
        _need(isinstance(cs, list) and cs, w, '"contenders" is a non-empty list')
        names = set()
        for j, c in enumerate(cs):
            cw = f"{w}.contenders[{j}]"
            _need(isinstance(c, dict) and isinstance(c.get("name"), str) and c["name"], cw, '"name" is a non-empty string')
            _need(c["name"] not in names, cw, f'contender "{c["name"]}" appears twice in one row')
            names.add(c["name"])
            _need("median_us" in c, cw, 'missing key "median_us"')
            for k in STAT_KEYS:
                if k in c:
                    _need(_number_or_null(c[k]), cw, f'"{k}" is a number or null')
            if c.get("median_us") is not None:
                _need(c["median_us"] > 0, cw, '"median_us" is positive')
                if c.get("p10_us") is not None and c.get("p90_us") is not None:
                    _need(c["p10_us"] <= c["median_us"] <= c["p90_us"], cw, "p10_us <= median_us <= p90_us")
            if "samples" in c:
                _need(isinstance(c["samples"], int) and c["samples"] > 0, cw, '"samples" is a positive integer')
            if "graph_calls" in c:
                _need(isinstance(c["graph_calls"], int) and not isinstance(c["graph_calls"], bool)
                      and c["graph_calls"] > 0, cw, '"graph_calls" is a positive integer')
                _need(c["name"].endswith(GRAPH_SUFFIX), cw, f'a contender with "graph_calls" is named <x>{GRAPH_SUFFIX}')
    return rec


def load(path):
    with open(path) as f:
        return validate(json.load(f), path)


def _shape_label(shape, skip=("dtype", "ranks")):
    return " ".join(f"{k}={v}" for k, v in shape.items() if k not in skip)


def _constant_keys(rows):
    """The shape keys with one value in every row (named once in the title, not per shape)."""
    if len(rows) < 2:
        return set()
    first = rows[0]["shape"]
    return {k for k, v in first.items() if all(r["shape"].get(k) == v for r in rows[1:])}


def _under_test(medians):
    """The op under test, per row: "fused" in the fused-op benches, "mk" in the GEMM
    engine's, else the row's first contender named mkernel_* (the Python benches, whose op
    differs by row: mkernel_dispatch_gemm, mkernel_gemm_combine)."""
    for name in ("fused", "mk"):
        if any(name in m for m in medians):
            return [name] * len(medians)
    return [next((n for n in m if n.startswith("mkernel_")), None) for m in medians]


def _medians(row):
    return {c["name"]: c["median_us"] for c in row["contenders"] if c.get("median_us")}


def plot_record(rec, out_dir, stem, contenders=None):
    """Writes the record's PNGs into out_dir; returns their paths. `contenders`: the names
    to plot (all when None), e.g. a sweep's planned kernel and cuBLASLt without its variants."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpu = rec["machine"].get("gpu") or "unknown GPU"
    title = f'{rec["bench"]} on {gpu} ({rec["date"][:10]}, {rec["commit"][:10]})'
    rows = rec["rows"]
    written = []
    if rows and all("bytes" in r["shape"] for r in rows):
        factor = rec["config"].get("bus_factor", 1.0)
        dtypes = []
        for r in rows:
            d = r["shape"].get("dtype", rec["config"].get("dtype", ""))
            if d not in dtypes:
                dtypes.append(d)
        for dtype in dtypes:
            these = [r for r in rows if r["shape"].get("dtype", rec["config"].get("dtype", "")) == dtype]
            names = sorted({c["name"] for r in these for c in r["contenders"]})
            fig, (bw, lat) = plt.subplots(1, 2, figsize=(12, 4.5))
            for name in names:
                pts = [(r["shape"]["bytes"], _medians(r)[name]) for r in these if name in _medians(r)]
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                # A copy moves its bytes once: its bandwidth is not scaled by the bus factor.
                f = 1.0 if name == "d2d_copy" else factor
                bw.plot(xs, [b / t / 1e3 * f for b, t in pts], marker="o", label=name)
                lat.plot(xs, [t for _, t in pts], marker="o", label=name)
            for ax, ylabel in ((bw, "bus bandwidth (GB/s)"), (lat, "time (µs)")):
                ax.set_xscale("log", base=2)
                ax.set_xlabel("size (bytes)")
                ax.set_ylabel(ylabel)
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=8)
            lat.set_yscale("log")
            fig.suptitle(f"{title}, {dtype}" if dtype else title)
            name = f"{stem}-{dtype}-bandwidth-latency.png" if len(dtypes) > 1 else f"{stem}-bandwidth-latency.png"
            path = os.path.join(out_dir, name)
            fig.tight_layout()
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
        return written

    constant = _constant_keys(rows)
    labels = [_shape_label(r["shape"], skip=("dtype", "ranks", *constant)) for r in rows]
    if constant:
        title += "\n" + _shape_label(rows[0]["shape"], skip=tuple(k for k in rows[0]["shape"] if k not in constant))
    medians = [{n: t for n, t in _medians(r).items() if contenders is None or n in contenders} for r in rows]
    ours = _under_test(medians)
    ours_names = sorted({o for o in ours if o})
    ours_label = ours_names[0] if len(ours_names) == 1 else "mkernel"
    baselines = sorted({n for m in medians for n in m if n not in ours_names})
    fig, (sp, tm) = plt.subplots(2, 1, figsize=(max(8, 0.9 * len(rows) + 4), 9))
    xs = list(range(len(rows)))
    if ours_names:
        for name in baselines:
            # Cold-L2 baselines against the cold-L2 time of ours, graph replays against our
            # graph replays; those times of ours themselves are not baselines.
            refs = []
            for o in ours:
                if o is None:
                    refs.append(None)
                elif name.endswith("_cold_l2"):
                    refs.append(o + "_cold_l2")
                elif name.endswith(GRAPH_SUFFIX):
                    refs.append(o + GRAPH_SUFFIX)
                else:
                    refs.append(o)
            pts = [(x, m[name] / m[r]) for x, m, r in zip(xs, medians, refs) if r and r != name and r in m and name in m]
            if pts:
                ref = refs[pts[0][0]]
                shown = ref if len(ours_names) == 1 else ref.replace(ours[pts[0][0]], ours_label)
                sp.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{name} / {shown}")
        sp.axhline(1.0, color="black", linewidth=0.8)
        sp.set_ylabel(f"speedup of {ours_label} (baseline time / its time)")
        sp.legend(fontsize=8)
    sp.set_xticks(xs)
    sp.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    sp.grid(True, alpha=0.3)
    width = 0.8 / max(1, len(baselines) + 1)
    ours_times = [m.get(o, 0.0) if o else 0.0 for m, o in zip(medians, ours)]
    for i, (name, vals) in enumerate([(ours_label, ours_times)] + [(n, [m.get(n, 0.0) for m in medians]) for n in baselines]):
        if any(vals):
            tm.bar([x + i * width for x in xs], vals, width=width, label=name)
    tm.set_xticks([x + 0.4 for x in xs])
    tm.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    tm.set_ylabel("median time (µs)")
    tm.set_yscale("log")
    tm.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{stem}-speedup.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("records", nargs="+", help="mkbench --json files")
    ap.add_argument("-o", "--out", default=".", help="folder for the PNGs")
    ap.add_argument("--check", action="store_true", help="validate the records only")
    ap.add_argument("--contenders", help="comma-separated names to plot (default: every contender)")
    a = ap.parse_args(argv)
    try:
        recs = [(p, load(p)) for p in a.records]
    except (SchemaError, json.JSONDecodeError, OSError) as e:
        print(f"plot.py: {e}", file=sys.stderr)
        return 1
    if a.check:
        print(f"plot.py: {len(recs)} record(s) valid")
        return 0
    os.makedirs(a.out, exist_ok=True)
    for path, rec in recs:
        stem = os.path.splitext(os.path.basename(path))[0]
        only = set(a.contenders.split(",")) if a.contenders else None
        for png in plot_record(rec, a.out, stem, only):
            print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
