"""benches/moe_layer_same_process.py's CPU side: its skewed routing follows the law its
docstring states, its options refuse bad input before any GPU is probed, and without a GPU
it says SKIPPED with exit 77. Its GPU path (the checks and timings) runs on a GPU only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHES = Path(__file__).resolve().parents[2] / "benches"
BENCH = BENCHES / "moe_layer_same_process.py"

if not BENCH.is_file():
    pytest.skip("benches/ is not in this checkout", allow_module_level=True)
sys.path.insert(0, str(BENCHES))
import moe_layer_same_process as bench  # noqa: E402


def _run(*args):
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("experts,topk", [(8, 2), (128, 8), (256, 8)])
def test_routing_draws_distinct_experts_with_weights_summing_to_one(experts, topk):
    idx, weights, popularity = bench.zipf_routing(1000, experts, topk, 1.0, seed=3)
    assert idx.shape == (1000, topk) and idx.dtype == torch.int32
    assert int(idx.min()) >= 0 and int(idx.max()) < experts
    assert all(len(set(r)) == topk for r in idx.tolist()), "a token lists an expert twice"
    assert weights.dtype == torch.float32 and bool((weights > 0).all())
    assert torch.allclose(weights.sum(1), torch.ones(1000), atol=1e-5)
    assert popularity.shape == (experts,) and abs(float(popularity.sum()) - 1) < 1e-12


def test_routing_first_choice_follows_the_zipf_law():
    """The first of the k choices is a draw from the popularity law itself: its frequencies
    match 1/r^s normalised, whichever expert ids the permutation gave the ranks."""
    tokens, experts, s = 40000, 8, 1.0
    idx, _, popularity = bench.zipf_routing(tokens, experts, 2, s, seed=1)
    law = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** s
    assert torch.allclose(popularity.sort(descending=True).values, law / law.sum())
    first = torch.bincount(idx[:, 0].long(), minlength=experts).double() / tokens
    # Binomial standard error at p = 0.37 and 40000 draws is 0.0024: 0.01 is four of them.
    assert float((first - popularity).abs().max()) < 0.01, (first, popularity)
    assert not torch.equal(popularity, popularity.sort(descending=True).values), "the ranks go to permuted ids"


def test_routing_is_skewed_by_the_exponent_and_uniform_at_zero():
    skewed = bench.expert_rows(bench.zipf_routing(4096, 256, 8, 1.0, seed=0)[0], 256)
    flat = bench.expert_rows(bench.zipf_routing(4096, 256, 8, 0.0, seed=0)[0], 256)
    mean = 4096 * 8 / 256
    assert skewed["hottest"] > 10 * mean and skewed["coldest"] < mean / 2, skewed
    assert flat["hottest"] < 1.5 * mean and flat["coldest"] > mean / 2, flat


def test_routing_is_seeded():
    a, b, c = (bench.zipf_routing(256, 128, 8, 1.0, seed=s) for s in (5, 5, 6))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    with pytest.raises(ValueError, match="topk"):
        bench.zipf_routing(16, 4, 5)


def test_options_pick_models_and_refuse_bad_input():
    args = bench.parse_args(["4096", "--model", "qwen3-235b,mixtral-8x7b", "--backward"])
    assert args.tokens == [4096] and args.models == ["qwen3-235b", "mixtral-8x7b"] and args.backward
    assert bench.parse_args([]).models == list(bench.MODELS) and bench.parse_args([]).tokens == [4096, 16384]
    for bad, says in ((["--model", "llama"], "llama"), (["-n", "0"], "-n"), (["0"], "positive"),
                      (["--zipf", "-1"], "--zipf"), (["--model", ","], "--model")):
        run = _run(*bad)
        assert run.returncode == 2 and says in run.stderr, (bad, run.returncode, run.stderr)


def test_models_are_the_issue_shapes_and_the_workspace_holds_the_largest_dispatch():
    assert bench.MODELS == {"deepseek-v3": (7168, 2048, 256, 8), "qwen3-235b": (4096, 1536, 128, 8),
                            "mixtral-8x7b": (4096, 14336, 8, 2)}
    # DeepSeek-V3 at 16384 tokens: 131072 routed rows plus 256 experts' padding, of 7168 bf16.
    assert bench.workspace_bytes(["deepseek-v3"], [4096, 16384]) == (16384 * 8 + 256 * 128) * 7168 * 2 + (1 << 20)
    assert bench.workspace_bytes(["mixtral-8x7b"], [16]) == 256 << 20


@pytest.mark.skipif(torch.cuda.is_available(), reason="the SKIPPED path is for machines without a GPU")
def test_without_a_gpu_it_says_skipped():
    run = _run("4096", "--model", "mixtral-8x7b")
    assert run.returncode == 77 and run.stdout.startswith("SKIPPED"), (run.returncode, run.stdout, run.stderr)
