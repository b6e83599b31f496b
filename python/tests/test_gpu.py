"""GPU tests: N = 1, 2, 4 rank processes sharing one GPU (MPS), every op against a float64
reference (ring attention's gradients too), torch.compile, CUDA graph capture and replay
(torch.cuda.graph and torch.compile's reduce-overhead mode), the parallel layers and the MoE
layer forward and backward, the MoE dispatch's options (gated activation, drop mode,
overflow then retry), and abort / timeout behaviour. Skipped (and
reported as skipped) without an sm_90 GPU."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys

import pytest

import gpu_cases
from docs_example import TP_MLP, doc_example
from gpu_harness import max_ctas, requires_gpu, run_ranks

pytestmark = requires_gpu
RANKS = [1, 2, 4]


def _no_problems(results):
    problems = [f"rank {r}: {p}" for r, rank_problems in enumerate(results) for p in rank_problems]
    assert problems == []


@pytest.mark.parametrize("n", RANKS)
def test_collectives(n):
    _no_problems(run_ranks(n, gpu_cases.collectives))


@pytest.mark.parametrize("n", RANKS)
def test_gemm_ops(n):
    results = run_ranks(n, gpu_cases.gemms)
    _no_problems([problems for problems, _ in results])
    first = results[0][1]
    assert all(c == first for _, c in results), "gemm_all_reduce: ranks' results are not bitwise identical"


@pytest.mark.parametrize("n", RANKS)
def test_moe(n):
    _no_problems(run_ranks(n, gpu_cases.moe))


def _fresh_seed() -> int:
    """New inputs every run; the problems name the seed, so a failure can be replayed."""
    return random.randrange(1 << 30)


@pytest.mark.parametrize("n", RANKS)
def test_moe_options(n):
    _no_problems(run_ranks(n, gpu_cases.moe_options, _fresh_seed()))


@pytest.mark.parametrize("n", RANKS)
def test_moe_layer_gradients(n):
    _no_problems(run_ranks(n, gpu_cases.moe_layer, _fresh_seed()))


@pytest.mark.parametrize("n", RANKS)
def test_ring_attention(n):
    _no_problems(run_ranks(n, gpu_cases.ring_attention))


@pytest.mark.parametrize("n", RANKS)
def test_ring_attention_backward(n):
    _no_problems(run_ranks(n, gpu_cases.ring_attention_backward))


@pytest.mark.parametrize("n", RANKS)
def test_compile_and_cuda_graphs(n):
    _no_problems(run_ranks(n, gpu_cases.compile_and_graphs))


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sequence-parallel", "all-reduce"])
@pytest.mark.parametrize("n", RANKS)
def test_parallel_linear_matches_single_process(n, sequence_parallel):
    _no_problems(run_ranks(n, gpu_cases.parallel_linear, sequence_parallel))


def test_abort_from_watchdog_thread_unblocks():
    _no_problems(run_ranks(2, gpu_cases.abort_from_watchdog, timeout=120))


def test_timeout_surfaces_on_the_next_call():
    _no_problems(run_ranks(2, gpu_cases.async_timeout, timeout=120, timeout_s=2))


def test_bootstrap_over_torch_distributed(tmp_path):
    _no_problems(run_ranks(2, gpu_cases.torch_distributed_bootstrap, str(tmp_path / "pg-init"), make_comm=False))


def _torchrun(script, *args):
    env = dict(os.environ, MK_MAX_CTAS=str(max_ctas(2)), CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="50")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script), *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_tp_mlp_example_trains():
    """examples/torch/tp_mlp.py under torchrun with 2 ranks on one GPU: runs, and the loss falls."""
    if not TP_MLP.is_file():
        pytest.skip("not run from a checkout (examples/ absent)")
    done = _torchrun(TP_MLP, "--steps", "8", "--seq", "256", "--hidden", "256", "--ffn", "1024")
    losses = [float(v) for v in re.findall(r"step \d+: loss ([0-9.]+)", done.stdout)]
    assert len(losses) == 8, done.stdout
    assert losses[-1] < losses[0], losses


def test_doc_example_runs(tmp_path):
    """The example of docs/python.md under torchrun with 2 ranks: runs and prints the documented shapes."""
    source = doc_example()
    if source is None:
        pytest.skip("not run from a checkout (docs/ absent)")
    script = tmp_path / "example.py"
    script.write_text(source)
    done = _torchrun(script)
    for rank in (0, 1):
        assert f"{rank} torch.Size([4096, 2048]) torch.Size([2048, 1024])" in done.stdout, done.stdout
