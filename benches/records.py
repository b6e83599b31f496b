"""Every stored bench record, whatever its kind: read it, check it, say where it came from.

Three kinds of record live under benches/results/<date>-<topic>/:

- `mkbench/1`: mkbench's `--json` and the Python benches built on bench_record.py, checked
  by plot.validate (docs/benchmarks.md).
- `python_overhead`: benches/python_overhead.py's record: host µs per call of a 16 KB
  AllReduce and one tensor-parallel MLP step, each contender as median / p10 / p90 over
  blocks, with `gpu`, `command` (one string), `commit` and `date` at the top.
- transcribed: an `mkbench/1` record with `transcribed_from`, the dated results note it
  was written from, for a measurement whose run kept no JSON. It holds only what the note
  states: times it does not state are null, a ratio it states without the times is the
  contender's `time_over` (its time / the named contender's), and `date` may be the day
  alone (YYYY-MM-DD) where the note gives no time.

`provenance(rec)` gives, for any kind, the GPU, commit, date and command that
benches/figures.py prints beside every figure.
"""
import json
import os

import plot

MKBENCH = "mkbench/1"
PYTHON_OVERHEAD = "python_overhead"
PYTHON_OVERHEAD_PARTS = ("host_us_per_call_all_reduce_16KB", "mlp_step_us")


class RecordError(ValueError):
    pass


def kind(rec):
    """`mkbench/1`, `python_overhead`, or None for a record of no known kind."""
    if not isinstance(rec, dict):
        return None
    if rec.get("schema") == MKBENCH:
        return MKBENCH
    if rec.get("bench") == PYTHON_OVERHEAD and "schema" not in rec:
        return PYTHON_OVERHEAD
    return None


def _check_python_overhead(rec, where):
    for key in ("gpu", "command", "commit", "date"):
        if not isinstance(rec.get(key), str) or not rec[key]:
            raise RecordError(f'{where}: "{key}" is a non-empty string')
    for part in PYTHON_OVERHEAD_PARTS:
        contenders = rec.get(part)
        if not isinstance(contenders, dict):
            raise RecordError(f'{where}: missing object "{part}"')
        for name, c in contenders.items():
            if name == "shape":
                continue
            m = c.get("median") if isinstance(c, dict) else None
            if not isinstance(m, (int, float)) or isinstance(m, bool) or m <= 0:
                raise RecordError(f'{where}.{part}.{name}: "median" is a positive number')


def validate(rec, where="record"):
    """Returns `rec` if it is a record of a known kind that keeps its kind's rules; else
    raises RecordError (or plot.SchemaError for an mkbench/1 record) naming the rule."""
    k = kind(rec)
    if k == MKBENCH:
        plot.validate(rec, where)
        source = rec.get("transcribed_from")
        if source is not None and not (isinstance(source, str) and source.endswith(".md")):
            raise RecordError(f'{where}: "transcribed_from" names a results note (.md)')
    elif k == PYTHON_OVERHEAD:
        _check_python_overhead(rec, where)
    else:
        raise RecordError(f'{where}: not a record of a known kind ("schema": "{MKBENCH}", '
                          f'or "bench": "{PYTHON_OVERHEAD}")')
    return rec


def load(path):
    with open(path) as f:
        return validate(json.load(f), path)


def stored(results_dir):
    """{path relative to results_dir: record} for every record under results_dir/*/."""
    out = {}
    for folder in sorted(os.listdir(results_dir)):
        full = os.path.join(results_dir, folder)
        if not os.path.isdir(full):
            continue
        for name in sorted(os.listdir(full)):
            if name.endswith(".json"):
                rec = out[f"{folder}/{name}"] = load(os.path.join(full, name))
                note = rec.get("transcribed_from")
                if note and not os.path.isfile(os.path.join(results_dir, note)):
                    raise RecordError(f"{folder}/{name}: transcribed from {note}, which is not in {results_dir}")
    return out


def gpu(rec):
    """The GPU's short name: "H100" for "NVIDIA H100 80GB HBM3"."""
    name = rec["machine"].get("gpu") if kind(rec) == MKBENCH else rec["gpu"]
    if not name:
        return "unknown GPU"
    words = name.replace("NVIDIA ", "").split()
    return words[0] if words else name


def command(rec):
    """The command line, its program as a bare name and without the `--json PATH` that
    only says where the record was written."""
    argv = list(rec["command"]) if isinstance(rec["command"], list) else rec["command"].split()
    if argv:
        argv[0] = os.path.basename(argv[0]) if argv[0].startswith("/") else argv[0]
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--json":
            skip = True
        else:
            out.append(a)
    return " ".join(out)


def provenance(rec):
    """{gpu, commit (7 hex digits, or as the note states it), date (YYYY-MM-DD), command}."""
    commit = rec["commit"]
    if all(c in "0123456789abcdef" for c in commit) and len(commit) > 7:
        commit = commit[:7]
    return {"gpu": gpu(rec), "commit": commit, "date": rec["date"][:10], "command": command(rec)}
