"""benches/python_host_cost.py runs on a CPU: a few calls of every case with the stub
library, each reporting a positive time (the measurement itself is the bench's job)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benches" / "python_host_cost.py"


def test_host_cost_bench_runs_without_a_gpu(tmp_path):
    if not BENCH.is_file():
        pytest.skip("benches/ is not in this checkout")
    if shutil.which("cc") is None:
        pytest.skip("no C compiler for the stub library")
    record = tmp_path / "host_cost.json"
    run = subprocess.run(
        [sys.executable, str(BENCH), "--calls", "20", "--blocks", "2", "--json", str(record)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(record.read_text())["results"]
    for case in ("all_reduce out=", "moe_dispatch_gemm", "moe_gemm_combine", "ring_attention fwd"):
        assert results[case]["median_us"] > 0, case
