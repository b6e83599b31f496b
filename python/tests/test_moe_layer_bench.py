"""benches/moe_layer_same_process.py's CPU side: its skewed routing follows the law its
docstring states; its torch stack (the baseline) agrees with float64 autograd's reference
layer; its checks are order-free where mkernel's layout is and catch a misplaced or wrong
row; its options refuse bad input before any GPU is probed; without a GPU it says SKIPPED
with exit 77. Its GPU path (mkernel's ops, the CUDA graph, the timings) runs on a GPU only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mkernel.nn import moe as moe_module
from mkernel.nn.moe import ACTIVATIONS, moe_reference

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


def _small_case(seed=0, experts=6, topk=3, tokens=64, hidden=128, ffn=64):
    """A Case on the CPU at a small shape, bf16 weights scaled as nn.MoE initialises them."""
    g = torch.Generator().manual_seed(seed)
    layer = SimpleNamespace(
        w1=((torch.rand(experts, 2 * ffn, hidden, generator=g) * 2 - 1) / hidden**0.5).to(torch.bfloat16),
        w2=((torch.rand(experts, hidden, ffn, generator=g) * 2 - 1) / ffn**0.5).to(torch.bfloat16),
    )
    return bench.Case(torch, layer, (hidden, ffn, experts, topk), tokens, 1.0, seed)


@pytest.mark.parametrize("seed", [0, 1])
def test_torch_stack_matches_the_float64_reference(seed):
    """The baseline itself: sort, gather, gate_up, SiLU·mul, down, weighted index_add_
    against moe_reference in float64 (Megatron's gate-then-up layout), within the bench's
    tolerance; and the layout it sorts by is the routing's rows per expert."""
    case = _small_case(seed)
    act = ACTIVATIONS["swiglu"][1]
    want = moe_reference(case.x.double(), case.idx, case.weights.double(), case.layer.w1.double(),
                         case.layer.w2.double(), act)
    got = case.stack(case.x, case.idx)
    assert got.dtype == torch.bfloat16 and got.shape == case.x.shape
    assert bench.rel_l2(got, want) < bench.TOLERANCE / 4, bench.rel_l2(got, want)
    assert torch.equal(case.counts, torch.bincount(case.idx.flatten().long(), minlength=case.E))
    # Swapping gate and up is a different layer, far outside the tolerance.
    swapped = SimpleNamespace(w1=torch.cat(case.layer.w1.chunk(2, dim=1)[::-1], dim=1), w2=case.layer.w2)
    wrong = moe_reference(case.x.double(), case.idx, case.weights.double(), swapped.w1.double(),
                          swapped.w2.double(), act)
    assert bench.rel_l2(got, wrong) > 10 * bench.TOLERANCE


def _dispatched(case, act_rows, shuffle_seed):
    """What moe_dispatch_gemm returns for this routing, built from the stack's activated rows:
    each expert's rows in a segment padded to 128, in an order of its own within the expert."""
    counts = case.counts.tolist()
    g = torch.Generator().manual_seed(shuffle_seed)
    y = torch.full((sum((c + 127) // 128 * 128 for c in counts), act_rows.shape[1]), float("nan"))
    start = ref = 0
    for c in counts:
        y[start:start + c] = act_rows[ref:ref + c][torch.randperm(c, generator=g)].float()
        start, ref = start + (c + 127) // 128 * 128, ref + c
    recv_counts = torch.tensor(counts + [y.shape[0]], dtype=torch.int32)
    return SimpleNamespace(y=y.to(act_rows.dtype), recv_counts=recv_counts)


def test_dispatch_check_is_order_free_within_an_expert_and_catches_a_misplaced_row():
    case = _small_case(2)
    act = case.swiglu(case.gate_up(case.x[case.token], case.offs))
    assert bench.dispatch_error(torch, case, _dispatched(case, act, 0), act) < 1e-6
    # A row of the hottest expert given to the next one: the counts disagree.
    d = _dispatched(case, act, 1)
    hot = int(case.counts.argmax())
    d.recv_counts[hot] -= 1
    d.recv_counts[(hot + 1) % case.E] += 1
    assert bench.dispatch_error(torch, case, d, act) == float("inf")
    # The right counts with one row of the hottest expert wrong: caught by the sums.
    d = _dispatched(case, act, 1)
    first = sum((c + 127) // 128 * 128 for c in case.counts.tolist()[:hot])
    d.y[first] = -d.y[first] * 4
    assert bench.dispatch_error(torch, case, d, act) > bench.TOLERANCE


def test_rel_l2_refuses_zeros_and_non_finite_values():
    ones = torch.ones(4, 4)
    assert bench.rel_l2(ones, torch.zeros(4, 4)) == float("inf"), "a zero reference proves nothing"
    assert bench.rel_l2(torch.full((4, 4), float("nan")), ones) == float("inf")
    assert bench.rel_l2(ones * 1.01, ones) == pytest.approx(0.01)


class _FakeMkernel:
    """mkernel's two MoE ops written in torch with mkernel's receive layout (each expert's
    segment padded to 128 rows, its rows in reverse token order: an order of arrival unlike
    the stack's), and the real mkernel.nn.moe for the capacity bound and the recomputation."""

    nn = SimpleNamespace(moe=moe_module)

    @staticmethod
    def moe_dispatch_gemm(x, idx, w1, comm, capacity, activation):
        assert activation == "silu"
        flat, k = idx.reshape(-1).long(), idx.shape[1]
        y = torch.zeros(capacity, w1.shape[1] // 2, dtype=x.dtype)
        row_of, start, counts = torch.empty_like(flat), 0, []
        for e in range(w1.shape[0]):
            slots = torch.nonzero(flat == e).squeeze(1).flip(0)
            rows = start + torch.arange(len(slots))
            row_of[slots] = rows
            gate, up = (x[slots // k].float() @ w1[e].float().t()).chunk(2, dim=-1)
            y[rows] = (torch.nn.functional.silu(gate) * up).to(x.dtype)
            counts.append(len(slots))
            start += (len(slots) + 127) // 128 * 128
        recv_counts = torch.tensor(counts + [start], dtype=torch.int32)
        return SimpleNamespace(y=y, recv_counts=recv_counts, layout=(row_of, flat))

    @staticmethod
    def moe_gemm_combine(y, w2, weights, layout, comm):
        row_of, flat = layout
        z = torch.stack([y[row_of[p]].float() @ w2[flat[p]].float().t() for p in range(flat.numel())])
        tokens, k = weights.shape
        return (z * weights.reshape(-1, 1)).reshape(tokens, k, -1).sum(1).to(y.dtype)


class _FakeLayer(torch.nn.Module):
    """nn.MoE's interface (w1, w2, forward(x, idx, weights)) over its own recomputation."""

    def __init__(self, case):
        super().__init__()
        self.w1 = torch.nn.Parameter(case.layer.w1.clone())
        self.w2 = torch.nn.Parameter(case.layer.w2.clone())
        self.settings = SimpleNamespace(backward="kernels")  # toggled by the bench's recompute contender

    def forward(self, x, idx, weights):
        act = ACTIVATIONS["swiglu"][1]
        return moe_module.moe_local_experts(x, idx, weights, self.w1, self.w2, act, 0).to(x.dtype)


def test_every_direction_checks_times_and_records_on_the_cpu(monkeypatch):
    """run_case end to end with the GPU's parts stood in for (mkernel's ops by _FakeMkernel,
    the CUDA graph by a plain call, the timing by one call per contender): every direction
    is checked, timed and recorded, the record passes the schema and targets.py judges it."""
    import bench_record
    import plot
    import targets

    H, F, E, k, T = 128, 64, 6, 3, 64
    monkeypatch.setitem(bench.MODELS, "tiny", (H, F, E, k))
    layer = _FakeLayer(_small_case(experts=E, topk=k, tokens=T, hidden=H, ffn=F))
    monkeypatch.setattr(bench, "capture", lambda torch, fn: (SimpleNamespace(replay=lambda: None), fn()))
    called = []

    def one_call_each(calls, warmup, blocks, iters):
        for name, fn in calls.items():
            fn()
            called.append(name)
        return {name: ([100.0] * blocks * iters, [5.0] * blocks * iters) for name in calls}

    monkeypatch.setattr(bench_record, "interleaved", one_call_each)
    args = bench.parse_args([str(T), "--model", "tiny", "--backward", "-w", "1", "-n", "2", "--blocks", "1"])
    rows = []
    assert bench.run_case(torch, _FakeMkernel, args, None, layer, "tiny", T, rows)
    assert [r["shape"]["direction"] for r in rows] == ["layer", "dispatch", "combine", "fwd+bwd"]
    assert called == ["mkernel_moe_layer", "torch_stack", "torch_stack_graph", "mkernel_dispatch_gemm",
                      "torch_grouped_mm", "torch_grouped_mm_swiglu", "mkernel_gemm_combine", "torch_grouped_mm",
                      "torch_grouped_mm_index_add", "mkernel_moe_layer_fwd_bwd",
                      "mkernel_moe_layer_fwd_bwd_recompute", "torch_stack_fwd_bwd"]
    errors = [c["rel_err_vs_torch"] for r in rows for c in r["contenders"] if "rel_err_vs_torch" in c]
    assert len(errors) == 6 and all(0 <= e <= bench.TOLERANCE for e in errors), errors
    rec = bench_record.record("moe_layer_same_process", True, bench_record.protocol_config(args), rows)
    plot.validate(rec)
    rows[0]["shape"]["tokens"] = 4096  # the targets judge T 4096 and 16384 only
    verdicts = {v["target"].split()[0]: v for v in targets.judge([rec])}
    assert verdicts["moe_layer"]["met"] is True, verdicts["moe_layer"]  # equal times: 1.00 x

    # A wrong combine is caught and its direction not timed; the run says it failed.
    class WrongCombine(_FakeMkernel):
        @staticmethod
        def moe_gemm_combine(y, w2, weights, layout, comm):
            return _FakeMkernel.moe_gemm_combine(y, w2, weights.flip(1), layout, comm)

    rows, called[:] = [], []
    args.backward = False
    assert not bench.run_case(torch, WrongCombine, args, None, layer, "tiny", T, rows)
    assert [r["shape"]["direction"] for r in rows] == ["layer", "dispatch"]
    assert "mkernel_gemm_combine" not in called

    # A stack torch cannot capture: the layer is checked against the eager stack and timed
    # without the graph, whose time is null; moe_layer then has nothing to judge.
    def refuse(torch, fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(bench, "capture", refuse)
    rows, called[:] = [], []
    assert bench.run_case(torch, _FakeMkernel, args, None, layer, "tiny", T, rows)
    graph = next(c for c in rows[0]["contenders"] if c["name"] == "torch_stack_graph")
    assert graph["median_us"] is None and "torch_stack_graph" not in called
    rows[0]["shape"]["tokens"] = 4096
    rec = bench_record.record("moe_layer_same_process", True, bench_record.protocol_config(args), rows)
    plot.validate(rec)
    assert targets.moe_layer([rec])["met"] is None
