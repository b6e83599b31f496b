"""benches/megatron_compare.py on synthetic step lines (no GPU, no torch): the bound derived
from the reference pair, a layout inside it and one outside, a non-finite loss, missing runs,
the checkpoint swap, and the record it writes passing the mkbench/1 schema."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parents[2] / "benches"
if not (BENCHES / "megatron_compare.py").is_file():
    pytest.skip("benches/ is not in this checkout", allow_module_level=True)
sys.path.insert(0, str(BENCHES))
spec = importlib.util.spec_from_file_location("megatron_compare", BENCHES / "megatron_compare.py")
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)
import plot  # noqa: E402 -- benches/plot.py, the record schema

STEPS = 20


def curve(step, offset=0.0):
    return 10.4 * math.exp(-step / 6) + 2.0 + offset


def lines(run, losses, step_s=0.1, first_batch=0, stopped=None):
    out = [{"run": run, "spec": "x", "step": i, "batch": first_batch + i, "loss": loss, "step_s": step_s}
           for i, loss in enumerate(losses)]
    out.append({"run": run, "summary": True, "steps_asked": STEPS, "steps_done": len(losses), "stopped": stopped,
                "world_size": 2, "data_parallel_size": 1,
                "args": {"layers": 4, "hidden": 1024, "heads": 16, "seq": 4096, "data": "markov-copy"}})
    return [json.dumps(d) for d in out]


def reference_pair(spread=0.01):
    """tp-local and dense-local-1 whose largest difference is `spread` (at step 5)."""
    local = [curve(t) for t in range(STEPS)]
    one = [x + (spread if t == 5 else spread / 3) for t, x in enumerate(local)]
    return local, one


def full_log(tp_offset=0.005, cp_offset=-0.004, ep_offset=0.003, ckpt_offset=0.001):
    local, one = reference_pair()
    moe_local = [curve(t, 0.5) for t in range(STEPS)]
    out = lines("tp-local", local, 0.2) + lines("dense-local-1", one, 0.3)
    out += lines("tp-mkernel", [x + tp_offset for x in local], 0.1)
    out += lines("cp-mkernel", [x + cp_offset for x in one], 0.15)
    out += lines("ep-local", moe_local, 0.4) + lines("moe-local-1", [x + 0.02 for x in moe_local], 0.5)
    out += lines("ep-mkernel", [x + ep_offset for x in moe_local], 0.3)
    out += lines("ckpt-local-from-mkernel", [local[10] + tp_offset + ckpt_offset], first_batch=10)
    out += lines("ckpt-mkernel-from-local", [local[10] - ckpt_offset], first_batch=10)
    return out


def test_every_layout_within_its_bound_passes_and_the_record_keeps_the_schema(tmp_path):
    steps = tmp_path / "steps.jsonl"
    steps.write_text("\n".join(full_log()) + "\n")
    status = compare.main([str(steps), "--out", str(tmp_path), "--command", "scripts/gpu-megatron.sh --steps 20"])
    assert status == 0
    rec = plot.load(tmp_path / "megatron-gpt.json")
    assert rec["ok"] is True and rec["command"] == ["scripts/gpu-megatron.sh", "--steps", "20"]
    layouts = {c["layout"]: c for c in rec["config"]["layouts"]}
    # The dense bound: twice the reference's largest difference (0.01), above the bf16 floor.
    assert layouts["tp2-sp"]["bound"] == pytest.approx(0.02)
    assert layouts["tp2-sp"]["max_abs_diff"] == pytest.approx(0.005)
    assert layouts["cp2"]["bound"] == pytest.approx(0.02)
    # The MoE layout's bound comes from its own reference pair (0.02 apart): 0.04.
    assert layouts["ep2"]["bound"] == pytest.approx(0.04)
    assert layouts["tp2-sp"]["step_time_ratio"] == pytest.approx(0.5)
    assert all(c["verdict"] == "within" for c in rec["config"]["checkpoints"])
    row = rec["rows"][0]
    assert [c["name"] for c in row["contenders"]] == ["mkernel_spec", "local_spec"]
    assert row["contenders"][0]["median_us"] == pytest.approx(1e5)
    text = (tmp_path / "comparison.md").read_text()
    assert "| tp2-sp | 20 |" in text and "Runs cut short: none." in text


def test_a_layout_past_its_bound_fails_at_its_worst_step(tmp_path):
    log = full_log()
    drift = [json.loads(x) for x in log]
    for d in drift:
        if d["run"] == "cp-mkernel" and d.get("batch") == 17:
            d["loss"] += 0.05
    layouts, _, status = compare.compare(compare.load_runs(json.dumps(d) for d in drift))
    cp = next(c for c in layouts if c["layout"] == "cp2")
    assert status == 1 and cp["verdict"] == "OUT" and cp["max_abs_diff_batch"] == 17


def test_a_checkpoint_swap_off_by_more_than_the_bound_fails():
    layouts, checkpoints, status = compare.compare(compare.load_runs(full_log(ckpt_offset=0.1)))
    assert status == 1
    assert [c["verdict"] for c in checkpoints] == ["OUT", "OUT"]
    assert all(c["verdict"] == "within" for c in layouts)


def test_a_non_finite_mkernel_loss_is_out_of_bound():
    log = [json.loads(x) for x in full_log()]
    for d in log:
        if d["run"] == "tp-mkernel" and d.get("batch") == 3:
            d["loss"] = float("nan")
    layouts, _, status = compare.compare(compare.load_runs(json.dumps(d) for d in log))
    assert status == 1 and layouts[0]["verdict"] == "OUT" and "not finite" in layouts[0]["reason"]


def test_missing_runs_make_the_comparison_incomplete_not_a_pass(tmp_path):
    log = [x for x in full_log() if json.loads(x)["run"] not in ("ep-mkernel", "moe-local-1", "ckpt-mkernel-from-local")]
    layouts, checkpoints, status = compare.compare(compare.load_runs(log))
    by = {c["layout"]: c for c in layouts}
    assert status == 3
    assert by["ep2"]["verdict"] == "missing"
    assert [c["verdict"] for c in checkpoints] == ["within", "missing"]
    # Without its own reference, the MoE layout would be judged on the dense bound, and says so.
    log = [x for x in full_log() if json.loads(x)["run"] != "moe-local-1"]
    by = {c["layout"]: c for c in compare.compare(compare.load_runs(log))[0]}
    assert by["ep2"]["bound"] == pytest.approx(0.02) and "did not run" in by["ep2"]["reference_note"]


def test_runs_cut_short_are_compared_over_their_common_steps():
    local, one = reference_pair()
    log = lines("tp-local", local[:12]) + lines("dense-local-1", one)
    log += lines("tp-mkernel", [x + 0.001 for x in local[:8]], stopped="--max-seconds 30 reached after 8 of 20 steps")
    by = {c["layout"]: c for c in compare.compare(compare.load_runs(log))[0]}
    assert by["tp2-sp"]["steps_compared"] == 8 and by["tp2-sp"]["verdict"] == "within"


def test_the_bound_never_goes_below_bf16_resolution():
    local = [curve(t) for t in range(STEPS)]
    runs = compare.load_runs(lines("a", local) + lines("b", local))
    bound, spread, steps = compare.reference_bound((runs["a"], runs["b"]))
    assert spread == 0 and steps == STEPS
    assert bound == pytest.approx(2.0**-8 * statistics.median(local))
