#!/usr/bin/env python3
"""The Megatron proof's comparison (docs/megatron.md): loss curves of the mkernel spec against
Megatron's local spec, within a bound derived from the local spec's own bf16 spread, step
times side by side, and the checkpoint swap.

    python3 benches/megatron_compare.py steps.jsonl --out DIR [--command "..."]

Reads examples/megatron/train_gpt.py's step lines (as scripts/gpu-megatron.sh labels them)
and writes into DIR: megatron-gpt.json (an mkbench/1 record: one row per layout, the two
specs' step times as contenders, the loss verdicts in them and in config), loss-curves.png
(where matplotlib is installed) and comparison.md (a draft results note). Prints the
verdicts. Exit 0: every layout compared and within its bound, both checkpoint directions
within the bound; 1: something out of bound or not finite; 3: something missing (a run
that did not finish), nothing out of bound.

The bound. bf16 training is not bitwise reproducible across layouts: the same model with
the same data and seed, sharded differently, sums in another order, and the trajectories
drift apart. How far they drift is measured, not assumed: the local spec at TP=2 against
the local spec on one rank (dense-local-1; the same global batch, data-parallel size 1 in
both) differ only in that order, and for MoE the local spec at EP=2 against the local spec
on one rank with both sequences in one micro-batch (moe-local-1). The bound is twice the
largest loss difference of that reference pair over the steps compared (the mkernel-local
difference is one more draw of the same kind of drift, plus its own kernels' different
but equally exact rounding; a draw can exceed the one observed maximum, twice leaves room
for that), and never below 2^-8 of the median loss (bf16's relative resolution: nothing
finer can be claimed of a bf16 model's loss). Where the MoE reference did not run, the MoE
layout is judged against the dense bound and the verdict says so. A layout is within its
bound when |loss_mkernel(t) - loss_local(t)| <= bound at every step t both runs and the
reference pair have (the same batch index in each).
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_record  # noqa: E402

# layout -> (mkernel run, local run, its reference pair (two local runs), description)
LAYOUTS = {
    "tp2-sp": ("tp-mkernel", "tp-local", ("tp-local", "dense-local-1"),
               "TP=2, sequence parallel (the local spec without: its torch norm needs Apex for SP)"),
    "cp2": ("cp-mkernel", "dense-local-1", ("tp-local", "dense-local-1"),
            "CP=2 (the local spec at CP=1 on one rank: it cannot do CP)"),
    "ep2": ("ep-mkernel", "ep-local", ("ep-local", "moe-local-1"),
            "EP=2, 8 experts, top-2 (data-parallel 2)"),
}
DENSE_REFERENCE = ("tp-local", "dense-local-1")
# checkpoint run -> (the run whose checkpoint it loaded, the run of its own spec it stands beside)
CHECKPOINTS = {
    "ckpt-local-from-mkernel": "tp-mkernel",
    "ckpt-mkernel-from-local": "tp-local",
}
BF16_RESOLUTION = 2.0 ** -8
BOUND_FACTOR = 2.0
WARMUP_STEPS = 3  # left out of step times: the first steps load kernels and tune cuBLAS


def load_runs(lines):
    """{run: {"steps": {batch: (loss, step_s)}, "summary": dict or None}} from JSON lines."""
    runs = {}
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"line {number}: not JSON ({e})") from None
        run = runs.setdefault(d["run"], {"steps": {}, "summary": None})
        if d.get("summary"):
            run["summary"] = d
        else:
            run["steps"][int(d["batch"])] = (float(d["loss"]), float(d["step_s"]))
    return runs


def _median(values):
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def differences(a, b, batches=None):
    """{batch: loss_a - loss_b} over the batches both runs have (and `batches`, if given)."""
    common = set(a["steps"]) & set(b["steps"])
    if batches is not None:
        common &= set(batches)
    return {t: a["steps"][t][0] - b["steps"][t][0] for t in sorted(common)}


def reference_bound(reference, batches=None):
    """The bound from a reference pair of runs over `batches`: (bound, its largest |difference|, steps)."""
    diffs = differences(*reference, batches)
    if not diffs or not all(math.isfinite(d) for d in diffs.values()):
        return None, None, len(diffs)
    spread = max(abs(d) for d in diffs.values())
    losses = [reference[1]["steps"][t][0] for t in diffs]
    return max(BOUND_FACTOR * spread, BF16_RESOLUTION * _median(losses)), spread, len(diffs)


def step_time_stats(run):
    """mkbench/1 contender statistics of a run's step times (µs), the first steps left out."""
    times = [s for _, (_, s) in sorted(run["steps"].items())]
    kept = times[min(WARMUP_STEPS, len(times) // 4):] or times
    return bench_record.stats([t * 1e6 for t in kept])


def compare_layout(runs, layout):
    """The verdict of one layout: a dict with "verdict" in (within, OUT, missing)."""
    mk_name, local_name, reference_names, what = LAYOUTS[layout]
    out = {"layout": layout, "what": what, "mkernel_run": mk_name, "local_run": local_name}
    if mk_name not in runs or local_name not in runs or not runs[mk_name]["steps"] or not runs[local_name]["steps"]:
        out.update(verdict="missing", reason=f"{mk_name} or {local_name} logged no step")
        return out
    mk, local = runs[mk_name], runs[local_name]
    reference_note = None
    if all(r in runs and runs[r]["steps"] for r in reference_names):
        reference = reference_names
    else:
        reference = DENSE_REFERENCE
        reference_note = f"reference {' vs '.join(reference_names)} did not run: the dense reference's bound"
    out["reference"] = list(reference)
    if reference_note:
        out["reference_note"] = reference_note
    if not all(r in runs and runs[r]["steps"] for r in reference):
        out.update(verdict="missing", reason=f"no reference pair ({' vs '.join(reference)}) to derive the bound")
        return out
    pair = set(differences(runs[reference[0]], runs[reference[1]]))
    diffs = differences(mk, local, pair)
    if not all(math.isfinite(mk["steps"][t][0]) for t in mk["steps"]):
        out.update(verdict="OUT", reason="the mkernel run's loss is not finite")
        return out
    if not diffs:
        out.update(verdict="missing", reason="no step common to the runs and the reference pair")
        return out
    bound, spread, _ = reference_bound((runs[reference[0]], runs[reference[1]]), diffs)
    if bound is None:
        out.update(verdict="missing", reason="the reference pair's loss is not finite")
        return out
    worst = max(diffs, key=lambda t: abs(diffs[t]))
    half = sorted(diffs)[len(diffs) // 2:]
    out.update(
        steps_compared=len(diffs),
        reference_max_abs_diff=spread,
        bound=bound,
        max_abs_diff=abs(diffs[worst]),
        max_abs_diff_batch=worst,
        mean_diff_second_half=sum(diffs[t] for t in half) / len(half),
        first_loss={"mkernel": mk["steps"][min(diffs)][0], "local": local["steps"][min(diffs)][0]},
        last_loss={"mkernel": mk["steps"][max(diffs)][0], "local": local["steps"][max(diffs)][0]},
        step_time={"mkernel": step_time_stats(mk), "local": step_time_stats(local)},
        verdict="within" if abs(diffs[worst]) <= bound else "OUT",
    )
    out["step_time_ratio"] = out["step_time"]["mkernel"]["median_us"] / out["step_time"]["local"]["median_us"]
    return out


def compare_checkpoint(runs, name, bound):
    """One direction of the checkpoint swap: the loaded run's one loss against its source's on that batch."""
    source = CHECKPOINTS[name]
    out = {"run": name, "saved_by": source}
    if name not in runs or len(runs[name]["steps"]) != 1:
        out.update(verdict="missing", reason=f"{name} logged no step")
        return out
    (batch, (loss, _)), = runs[name]["steps"].items()
    if source not in runs or batch not in runs[source]["steps"]:
        out.update(verdict="missing", reason=f"{source} has no loss at batch {batch}")
        return out
    expected = runs[source]["steps"][batch][0]
    out.update(batch=batch, loss=loss, saving_run_loss=expected, abs_diff=abs(loss - expected), bound=bound)
    if bound is None:
        out.update(verdict="missing", reason="no dense bound (the reference pair did not run)")
    else:
        out["verdict"] = "within" if math.isfinite(loss) and abs(loss - expected) <= bound else "OUT"
    return out


def compare(runs):
    layouts = [compare_layout(runs, layout) for layout in LAYOUTS]
    dense = [runs.get(r) for r in DENSE_REFERENCE]
    dense_bound = reference_bound(dense)[0] if all(r and r["steps"] for r in dense) else None
    checkpoints = [compare_checkpoint(runs, name, dense_bound) for name in CHECKPOINTS]
    verdicts = [c["verdict"] for c in layouts + checkpoints]
    status = 1 if "OUT" in verdicts else 3 if "missing" in verdicts else 0
    return layouts, checkpoints, status


def _runs_summary(runs):
    out = {}
    for name, run in sorted(runs.items()):
        s = run["summary"] or {}
        out[name] = {"steps_logged": len(run["steps"]), "steps_asked": s.get("steps_asked"),
                     "stopped": s.get("stopped"), "world_size": s.get("world_size"),
                     "data_parallel_size": s.get("data_parallel_size")}
    return out


def record(runs, layouts, checkpoints, status, command):
    rows = []
    model = None
    for c in layouts:
        mk = runs.get(c["mkernel_run"], {}).get("summary") or {}
        model = model or (mk.get("args") or None)
        contenders = []
        for spec in ("mkernel", "local"):
            timed = c.get("step_time", {}).get(spec)
            base = {"name": f"{spec}_spec", "run": c[f"{spec}_run"]}
            contenders.append({**base, **timed} if timed else {**base, "median_us": None})
        contenders[0].update({k: c[k] for k in ("verdict", "max_abs_diff", "bound") if k in c})
        rows.append({"shape": {"layout": c["layout"], "ranks": (mk.get("world_size") or 0) or "?",
                               "dtype": "bf16"}, "contenders": contenders})
    keys = ("layers", "hidden", "heads", "ffn", "seq", "vocab", "data", "branch", "seed", "lr", "micro_batch")
    config = {
        "model": {k: model[k] for k in keys if model and k in model},
        "bound_rule": f"{BOUND_FACTOR:g} x the reference pair's largest |loss difference|, at least "
                      f"{BF16_RESOLUTION:g} x its median loss",
        "layouts": layouts,
        "checkpoints": checkpoints,
        "runs": _runs_summary(runs),
        "step_time_warmup_steps_left_out": WARMUP_STEPS,
    }
    rec = bench_record.record("megatron_gpt", status == 0, config, rows)
    rec["command"] = command.split() if command else rec["command"]
    return rec


def plot(runs, layouts, path):
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, c in zip(axes.flat, layouts):
        for spec, style in (("mkernel", "-"), ("local", "--")):
            run = runs.get(c[f"{spec}_run"])
            if run and run["steps"]:
                xs = sorted(run["steps"])
                ax.plot(xs, [run["steps"][t][0] for t in xs], style, label=f"{spec} spec ({c[f'{spec}_run']})")
        ax.set_title(f"{c['layout']}: {c['verdict']}" + (f" (max |diff| {c['max_abs_diff']:.4f}, bound {c['bound']:.4f})"
                                                          if "bound" in c else ""), fontsize=9)
        ax.set_xlabel("step (batch)")
        ax.set_ylabel("loss")
        ax.legend(fontsize=8)
    ax = axes.flat[3]
    for c in layouts:
        if "bound" not in c:
            continue
        d = differences(runs[c["mkernel_run"]], runs[c["local_run"]])
        xs = sorted(d)
        (line,) = ax.plot(xs, [d[t] for t in xs], label=f"{c['layout']} mkernel - local")
        ax.axhline(c["bound"], color=line.get_color(), linestyle=":", linewidth=0.8)
        ax.axhline(-c["bound"], color=line.get_color(), linestyle=":", linewidth=0.8)
    for ref in {tuple(c["reference"]) for c in layouts if "reference" in c}:
        if all(r in runs for r in ref):
            d = differences(runs[ref[0]], runs[ref[1]])
            xs = sorted(d)
            ax.plot(xs, [d[t] for t in xs], color="gray", linewidth=0.8, label=f"reference {ref[0]} - {ref[1]}")
    ax.set_title("loss differences (dotted: each layout's bound)", fontsize=9)
    ax.set_xlabel("step (batch)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def note(rec, layouts, checkpoints, plotted):
    m = rec["machine"]
    lines = [
        f"# Megatron-core GPT: mkernel spec beside the local spec on one {m.get('gpu') or 'GPU'} (DRAFT)",
        "",
        f"Commit {rec['commit']}, {rec['date']}, driver {m.get('driver')}; `{' '.join(rec['command'])}`. "
        "Ranks are processes under MPS sharing one GPU; torch.distributed's nccl backend is "
        "libmkernel-nccl in standalone mode. Model: " + ", ".join(f"{k} {v}" for k, v in rec["config"]["model"].items())
        + ", bf16. Record: megatron-gpt.json; per-step losses and times: steps.jsonl"
        + ("; curves: loss-curves.png." if plotted else "."),
        "",
        f"Bound: {rec['config']['bound_rule']} (benches/megatron_compare.py says why).",
        "",
        "| layout | steps compared | max abs loss diff (batch) | bound (reference max diff) | verdict | "
        "step ms mkernel / local (ratio) |",
        "|---|---|---|---|---|---|",
    ]
    for c in layouts:
        if "bound" not in c:
            lines.append(f"| {c['layout']} | - | - | - | {c['verdict']}: {c.get('reason', '')} | - |")
            continue
        t = c["step_time"]
        lines.append(
            f"| {c['layout']} | {c['steps_compared']} | {c['max_abs_diff']:.4f} ({c['max_abs_diff_batch']}) | "
            f"{c['bound']:.4f} ({c['reference_max_abs_diff']:.4f}) | {c['verdict']}"
            + (f" ({c['reference_note']})" if c.get("reference_note") else "")
            + f" | {t['mkernel']['median_us'] / 1e3:.1f} / {t['local']['median_us'] / 1e3:.1f} "
            f"({c['step_time_ratio']:.2f}) |")
    lines += ["", "| checkpoint | batch | loss | saving run's loss | abs diff | bound | verdict |", "|---|---|---|---|---|---|---|"]
    for c in checkpoints:
        if "loss" not in c:
            lines.append(f"| {c['run']} | - | - | - | - | - | {c['verdict']}: {c.get('reason', '')} |")
            continue
        bound = "-" if c["bound"] is None else f"{c['bound']:.4f}"
        lines.append(f"| {c['run']} (from {c['saved_by']}) | {c['batch']} | {c['loss']:.4f} | "
                     f"{c['saving_run_loss']:.4f} | {c['abs_diff']:.4f} | {bound} | {c['verdict']} |")
    cut = {n: r for n, r in rec["config"]["runs"].items() if r.get("stopped")}
    lines += ["", "Runs cut short: " + ("; ".join(f"{n}: {r['stopped']}" for n, r in cut.items()) if cut else "none") + "."]
    lines += ["", "One GPU shows correctness and the cost of the Python-side path, not NVLink overlap: the step "
              "times are reported, with no speed target."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("steps", help="train_gpt.py's JSON lines (scripts/gpu-megatron.sh's steps.jsonl)")
    ap.add_argument("--out", required=True, help="folder for megatron-gpt.json, loss-curves.png, comparison.md")
    ap.add_argument("--command", default="", help="the command line the record names (the GPU script's)")
    args = ap.parse_args(argv)
    with open(args.steps) as f:
        runs = load_runs(f)
    layouts, checkpoints, status = compare(runs)
    os.makedirs(args.out, exist_ok=True)
    rec = record(runs, layouts, checkpoints, status, args.command)
    with open(os.path.join(args.out, "megatron-gpt.json"), "w") as f:
        json.dump(rec, f, indent=1)
        f.write("\n")
    plotted = plot(runs, layouts, os.path.join(args.out, "loss-curves.png"))
    with open(os.path.join(args.out, "comparison.md"), "w") as f:
        f.write(note(rec, layouts, checkpoints, plotted))
    print("comparison:")
    for c in layouts:
        detail = (f"max |diff| {c['max_abs_diff']:.4f} at batch {c['max_abs_diff_batch']} over {c['steps_compared']} steps, "
                  f"bound {c['bound']:.4f}; step time mkernel/local {c['step_time_ratio']:.2f}") if "bound" in c else c["reason"]
        print(f"  {c['layout']}: {c['verdict']}: {detail}")
    for c in checkpoints:
        detail = f"loss {c['loss']:.4f} vs {c['saving_run_loss']:.4f}" if "loss" in c else c["reason"]
        print(f"  {c['run']}: {c['verdict']}: {detail}")
    return status


if __name__ == "__main__":
    sys.exit(main())
