"""mkernel.nn.MoE and its autograd on the CPU: the drop rule against a plain loop, the
backward's grouped recomputation against float64 autograd of the unfused reference (fresh
random inputs, -1 entries, repeated and empty experts, expert-parallel slices), the
layer's plumbing (options, overflow retry, drop mode) with the fused ops replaced by
CPU stand-ins, and its argument errors. The fused ops themselves run in the GPU tests
(gpu_cases.py)."""

from __future__ import annotations

import pytest
import torch

import mkernel
from mkernel.nn import moe as moe_module
from mkernel.nn.moe import ACTIVATIONS, moe_kept, moe_local_experts, moe_reference
from mkernel.ops import resolve


def _routing(tokens, topk, experts, seed, *, holes=True):
    """Skewed routing with -1 entries and repeated experts: half the choices go to experts 0-1."""
    g = torch.Generator().manual_seed(seed)
    hot = torch.randint(0, min(2, experts), (tokens, topk), generator=g)
    cold = torch.randint(0, experts, (tokens, topk), generator=g)
    idx = torch.where(torch.rand(tokens, topk, generator=g) < 0.5, hot, cold)
    if holes:
        idx = torch.where(torch.rand(tokens, topk, generator=g) < 0.15, -1, idx)
    weights = torch.rand(tokens, topk, generator=g)
    return idx.to(torch.int32), weights


def _kept_by_loop(idx, experts, capacity):
    kept = torch.zeros(idx.shape, dtype=torch.bool)
    taken = [0] * experts
    drops = [0] * experts
    for t in range(idx.shape[0]):
        row = [int(e) for e in idx[t]]
        for e in dict.fromkeys(e for e in row if e >= 0):  # one row per distinct expert, in choice order
            fits = taken[e] < capacity
            taken[e] += 1
            drops[e] += not fits
            for j, ej in enumerate(row):
                if ej == e:
                    kept[t, j] = fits
    return kept, torch.tensor(drops, dtype=torch.int32)


@pytest.mark.parametrize("seed", range(4))
def test_drop_rule_keeps_the_first_rows_per_expert_in_token_order(seed):
    experts = 6
    idx, _ = _routing(50, 4, experts, seed)
    for capacity in (1, 3, 9, 200):
        kept, drops = moe_kept(idx, experts, capacity)
        want_kept, want_drops = _kept_by_loop(idx, experts, capacity)
        assert torch.equal(kept, want_kept), capacity
        assert torch.equal(drops, want_drops), capacity
    assert moe_kept(idx, experts, 200)[1].sum() == 0
    assert moe_kept(idx, experts, 1)[1].sum() > 0


def _weights(local_experts, fc1_rows, hidden, ffn, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(local_experts, fc1_rows, hidden, generator=g, dtype=torch.float64) / hidden**0.5
    w2 = torch.randn(local_experts, hidden, ffn, generator=g, dtype=torch.float64) / ffn**0.5
    return w1.to(dtype), w2.to(dtype)


def _grads(fn, inputs, dout):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves, dout.to(out.dtype))


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("seed", [0, 1])
def test_grouped_recomputation_matches_float64_reference(activation, seed):
    """moe_local_experts (float32, torch._grouped_mm) against moe_reference in float64:
    output and the gradients of x, topk_weights, w1 and w2 (the backward's whole math at
    one rank), with -1 entries, a repeated expert in a token and an empty expert."""
    fused, act = ACTIVATIONS[activation]
    tokens, topk, experts, hidden, ffn = 40, 3, 5, 128, 64
    fc1_rows = 2 * ffn if fused != "none" else ffn
    idx, weights = _routing(tokens, topk, experts, seed)
    idx[0] = torch.tensor([2, 2, -1], dtype=torch.int32)
    idx = torch.where(idx == 4, 3, idx)  # expert 4 is empty
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    w1, w2 = _weights(experts, fc1_rows, hidden, ffn, seed)
    dout = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)

    want, want_grads = _grads(lambda *a: moe_reference(a[0], idx, a[1], a[2], a[3], act), (x, weights.double(), w1, w2), dout)
    got, got_grads = _grads(
        lambda *a: moe_local_experts(a[0], idx, a[1], a[2], a[3], act, 0),
        (x.float(), weights, w1.float(), w2.float()),
        dout,
    )
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    for name, g_, w_ in zip(("x", "topk_weights", "w1", "w2"), got_grads, want_grads):
        assert not g_.isnan().any(), name
        assert w_.abs().max() > 0, name
        torch.testing.assert_close(g_.double(), w_, rtol=1e-4, atol=1e-4, msg=name)
    # The empty expert's weights get exactly zero gradient; a -1 choice's weight too.
    assert got_grads[2][4].abs().max() == 0 and got_grads[3][4].abs().max() == 0
    assert got_grads[1][0, 2] == 0


def test_grouped_recomputation_aligns_each_group_in_bf16(monkeypatch):
    """In bf16 every expert's group of rows starts on 16 bytes (8 rows), as _grouped_mm's
    backward needs (it contracts over the rows); the result still matches float64."""
    seen = []
    grouped_mm = torch._grouped_mm

    def recording(a, b, offs):
        seen.append(offs.tolist())
        return grouped_mm(a, b, offs=offs)

    monkeypatch.setattr(torch, "_grouped_mm", recording)
    tokens, topk, experts, hidden, ffn = 37, 3, 4, 128, 128
    act = ACTIVATIONS["swiglu"][1]
    idx, weights = _routing(tokens, topk, experts, 11)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    w1, w2 = _weights(experts, 2 * ffn, hidden, ffn, 13)
    got = moe_local_experts(x.bfloat16(), idx, weights, w1.bfloat16(), w2.bfloat16(), act, 0)
    assert seen and all(o % 8 == 0 for offs in seen for o in offs), seen
    # Each group holds its expert's choices (a token listing an expert twice: two choices).
    counts = [int((idx == e).sum()) for e in range(experts)]
    ends = [sum(-(-c // 8) * 8 for c in counts[: e + 1]) for e in range(experts)]
    assert seen[0] == ends
    want = moe_reference(x, idx, weights.double(), w1, w2, act)
    torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2)


def test_expert_parallel_slices_sum_to_the_whole():
    """Each rank's experts (first_expert = rank * E_local) give partial sums that add up to
    the one-rank layer: what the backward's reduce-scatter relies on."""
    tokens, topk, experts, hidden, ffn, ranks = 24, 4, 8, 128, 128, 4
    act = ACTIVATIONS["swiglu"][1]
    idx, weights = _routing(tokens, topk, experts, 7)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(tokens, hidden, generator=g)
    w1, w2 = _weights(experts, 2 * ffn, hidden, ffn, 9, torch.float32)
    whole = moe_local_experts(x, idx, weights, w1, w2, act, 0)
    local = experts // ranks
    parts = sum(
        moe_local_experts(x, idx, weights, w1[r * local : (r + 1) * local], w2[r * local : (r + 1) * local], act, r * local)
        for r in range(ranks)
    )
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-5)


class _FusedStandIn:
    """The fused ops replaced by CPU stand-ins: the dispatch records its arguments and
    reports `needed` as its needed capacity; the combine returns the float64 reference of
    the recorded call (the drop rule applied; this rank's experts only), so at one rank the
    layer's forward is exact and its backward (the code under test) is compared with
    float64 autograd."""

    def __init__(self, monkeypatch, needed=None):
        self.calls = []
        self.needed = list(needed or [])
        monkeypatch.setattr(moe_module, "moe_dispatch_gemm", self.dispatch)
        monkeypatch.setattr(moe_module, "moe_gemm_combine", self.combine)

    def dispatch(self, x, topk_idx, w1, comm, capacity, *, activation, expert_capacity):
        self.calls.append(dict(capacity=capacity, activation=activation, expert_capacity=expert_capacity))
        self.last = (x, topk_idx, w1, activation, expert_capacity)
        needed = self.needed.pop(0) if self.needed else capacity
        counts = torch.tensor([0] * w1.shape[0] + [needed], dtype=torch.int32)
        ffn = w1.shape[1] // 2 if activation != "none" else w1.shape[1]
        y = torch.zeros(capacity, ffn, dtype=x.dtype)
        layout = torch.zeros(16, dtype=torch.uint8)
        if expert_capacity is None:
            return mkernel.MoeDispatch(y, counts, layout)
        experts = w1.shape[0] * resolve(comm).world_size  # the layer passes its communicator's name
        self.experts = experts
        return mkernel.MoeDropDispatch(y, counts, layout, moe_kept(topk_idx, experts, expert_capacity)[1])

    def combine(self, y_act, w2, topk_weights, layout, comm):
        x, idx, w1, activation, capacity = self.last
        if capacity is not None:
            idx = torch.where(moe_kept(idx, self.experts, capacity)[0], idx, -1)
        act = self.layer_activation
        with torch.no_grad():
            return moe_reference(x.double(), idx, topk_weights.double(), w1.double(), w2.double(), act).to(x.dtype)


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "relu"])
@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_recompute_backward_matches_float64_reference(shape_comm, monkeypatch, activation, capacity_factor):
    comm = shape_comm(1).name
    fused = _FusedStandIn(monkeypatch)
    layer = mkernel.nn.MoE(
        comm, 6, 128, 128, activation=activation, capacity_factor=capacity_factor, backward="recompute",
        dtype=torch.float32,
    )
    fused.layer_activation = ACTIVATIONS[activation][1]
    tokens, topk = 30, 3
    idx, weights = _routing(tokens, topk, 6, 3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, tokens // 2, 128, generator=g)
    dout = torch.randn(2, tokens // 2, 128, generator=g)
    xs = x.clone().requires_grad_(True)
    ws = weights.clone().requires_grad_(True)
    out = layer(xs, idx.reshape(2, tokens // 2, topk).to(torch.int64), ws.reshape(2, tokens // 2, topk))
    assert out.shape == x.shape
    out.backward(dout)
    call = fused.calls[-1]
    assert call["activation"] == ACTIVATIONS[activation][0]
    want_capacity = None if capacity_factor is None else moe_module.expert_capacity(tokens, topk, 6, capacity_factor)
    assert call["expert_capacity"] == want_capacity

    ref_idx = idx
    if capacity_factor is not None:
        kept, drops = moe_kept(idx, 6, want_capacity)
        assert drops.sum() > 0 and torch.equal(layer.drop_counts, drops)
        ref_idx = torch.where(kept, idx, -1)
    else:
        assert layer.drop_counts.tolist() == [0] * 6
    act = ACTIVATIONS[activation][1]
    inputs = (x.reshape(tokens, 128).double(), weights.double(), layer.w1.double(), layer.w2.double())
    _, want = _grads(lambda *a: moe_reference(a[0], ref_idx, a[1], a[2], a[3], act), inputs, dout.reshape(tokens, 128))
    got = (xs.grad.reshape(tokens, 128), ws.grad, layer.w1.grad, layer.w2.grad)
    for name, g_, w_ in zip(("x", "topk_weights", "w1", "w2"), got, want):
        assert not g_.isnan().any(), name
        torch.testing.assert_close(g_.double(), w_, rtol=1e-4, atol=1e-4, msg=name)
    if capacity_factor is not None:  # a dropped choice's weight has no gradient
        assert (ws.grad[~kept] == 0).all() and (ws.grad[kept & (idx >= 0)] != 0).any()


def test_layer_retries_an_overflow_with_the_needed_capacity(shape_comm, monkeypatch):
    comm = shape_comm(1).name
    fused = _FusedStandIn(monkeypatch, needed=[512, 512])
    fused.layer_activation = ACTIVATIONS["swiglu"][1]
    layer = mkernel.nn.MoE(comm, 4, 128, 128, recv_capacity=256, dtype=torch.float32)
    idx, weights = _routing(8, 2, 4, 0, holes=False)
    layer(torch.randn(8, 128), idx, weights)
    assert [c["capacity"] for c in fused.calls] == [256, 512] and layer.recv_capacity == 512
    layer(torch.randn(8, 128), idx, weights)  # the grown capacity stays
    assert [c["capacity"] for c in fused.calls] == [256, 512, 512]

    raising = mkernel.nn.MoE(comm, 4, 128, 128, recv_capacity=128, on_overflow="raise", dtype=torch.float32)
    fused.needed = [384]
    with pytest.raises(mkernel.MkMoeOverflowError, match=r"need recv_capacity >= 384, but the call had 128") as info:
        raising(torch.randn(8, 128), idx, weights)
    assert info.value.needed_capacity == 384 and raising.recv_capacity == 128


def test_layer_with_the_default_capacity_never_checks(shape_comm, monkeypatch):
    """recv_capacity None: the no-overflow bound, and no host read of the needed capacity."""
    comm = shape_comm(2).name
    fused = _FusedStandIn(monkeypatch, needed=[10**6])
    fused.layer_activation = ACTIVATIONS["swiglu"][1]
    layer = mkernel.nn.MoE(comm, 4, 128, 128, dtype=torch.float32)
    idx, weights = _routing(8, 2, 4, 0)
    layer(torch.randn(8, 128), idx, weights)
    # 2 ranks * 8 tokens * min(k 2, E_local 2) rows + 2 experts * 127 padding = 286 -> 384.
    assert fused.calls[0]["capacity"] == moe_module.receive_capacity(8, 2, 2, 2) == 384
    assert layer.recv_capacity is None
    # Drop mode: each expert gets at most 2 ranks * C rows; the smaller of the two bounds.
    assert moe_module.receive_capacity(8, 2, 2, 2, expert_capacity=3) == 2 * 128
    assert moe_module.receive_capacity(8, 2, 2, 2, expert_capacity=100) == 384


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(activation="swish"), r"nn.MoE: expected activation to be one of \('swiglu', 'geglu', 'silu', 'gelu', 'relu'\), but got 'swish'"),
        (dict(num_experts=3), r"nn.MoE: expected num_experts to be a multiple of the world size \(2\), but got 3"),
        (dict(capacity_factor=0.0), r"nn.MoE: expected capacity_factor to be positive \(or None: no drop\), but got 0.0"),
        (dict(recv_capacity=200), r"nn.MoE: expected recv_capacity to be a multiple of 128, but got 200"),
        (dict(on_overflow="ignore"), r"nn.MoE: expected on_overflow to be 'retry' or 'raise', but got 'ignore'"),
        (dict(backward="autograd"), r"nn.MoE: expected backward to be one of \('kernels', 'recompute'\), but got 'autograd'"),
        (dict(hidden_size=96), r"nn.MoE: expected hidden_size to be a multiple of 128, but got 96"),
        (dict(ffn_hidden_size=0), r"nn.MoE: expected ffn_hidden_size to be a positive multiple of 128, but got 0"),
        (dict(num_experts=2048), r"nn.MoE: expected num_experts to be at most 1024, but got 2048"),
    ],
)
def test_layer_arguments_are_checked(shape_comm, kwargs, match):
    comm = shape_comm(2).name
    args = dict(num_experts=4, hidden_size=128, ffn_hidden_size=128)
    args.update(kwargs)
    with pytest.raises(mkernel.MkInvalidArgumentError, match=match):
        mkernel.nn.MoE(comm, **args)


def test_layer_forward_arguments_are_checked(shape_comm):
    layer = mkernel.nn.MoE(shape_comm(1).name, 4, 128, 128, dtype=torch.float32)
    x = torch.randn(8, 128)
    idx, weights = _routing(8, 2, 4, 0)
    with pytest.raises(mkernel.MkInvalidArgumentError, match=r"expected topk_idx and topk_weights \[..., k\] with x's"):
        layer(x, idx[:7], weights[:7])
    with pytest.raises(mkernel.MkInvalidArgumentError, match=r"expected topk_idx to be int32 or int64, but got torch.float32"):
        layer(x, weights, weights)
    with pytest.raises(mkernel.MkInvalidArgumentError, match=r"expected x to be a torch.Tensor, but got list"):
        layer([1.0], idx, weights)


def test_layer_parameters_have_the_documented_layouts(shape_comm):
    gated = mkernel.nn.MoE(shape_comm(2).name, 8, 256, 128, device="meta")
    assert tuple(gated.w1.shape) == (4, 256, 256) and tuple(gated.w2.shape) == (4, 256, 128)
    assert gated.w1.dtype == torch.bfloat16
    plain = mkernel.nn.MoE(shape_comm(2).name, 8, 256, 128, activation="gelu", device="meta")
    assert tuple(plain.w1.shape) == (4, 128, 256)


@pytest.mark.parametrize("capacity_factor", [None, 0.6])
def test_recompute_backward_over_two_ranks_matches_float64_reference(shape_comm, monkeypatch, capacity_factor):
    """The recompute backward's expert-parallel path, two ranks run one after the other: each rank's
    all_gather stand-in returns every rank's tensor of the same role, and the reduce-scatter
    is summed over the ranks' recorded partials. Against float64 autograd of moe_reference
    over every rank's tokens and every expert, with each rank's own drop rule."""
    n, tokens, topk, experts, hidden, ffn = 2, 20, 3, 4, 128, 128
    local = experts // n
    act = ACTIVATIONS["swiglu"][1]
    g = torch.Generator().manual_seed(21)
    routing = [_routing(tokens, topk, experts, 30 + r) for r in range(n)]
    xs = [torch.randn(tokens, hidden, generator=g) for _ in range(n)]
    douts = [torch.randn(tokens, hidden, generator=g) for _ in range(n)]
    w1, w2 = _weights(experts, 2 * ffn, hidden, ffn, 22, torch.float32)
    capacity = None if capacity_factor is None else moe_module.expert_capacity(tokens, topk, experts, capacity_factor)

    fused = _FusedStandIn(monkeypatch)
    fused.layer_activation = act
    roles = {}  # tensor data pointer of the current rank -> every rank's tensor of that role
    partials = []

    def all_gather(t, comm):
        return torch.cat(roles[t.data_ptr()]) if t.data_ptr() in roles else _gather_by_value(t)

    def _gather_by_value(t):
        for candidates in by_value:
            if any(c.shape == t.shape and c.dtype == t.dtype and torch.equal(c, t) for c in candidates):
                return torch.cat(candidates)
        raise AssertionError(f"all_gather of an unknown tensor {tuple(t.shape)} {t.dtype}")

    def reduce_scatter(t, comm):
        partials.append(t.clone())
        return t[: t.shape[0] // n]  # placeholder: the sum over ranks is formed below

    monkeypatch.setattr(moe_module, "all_gather", all_gather)
    monkeypatch.setattr(moe_module, "reduce_scatter", reduce_scatter)
    kept_idx = []
    for r in range(n):
        idx = routing[r][0]
        kept_idx.append(idx if capacity is None else torch.where(moe_kept(idx, experts, capacity)[0], idx, -1))
    by_value = [xs, kept_idx, [w for _, w in routing], douts]

    grads = []
    for r in range(n):
        comm = shape_comm(n, rank=r).name
        layer = mkernel.nn.MoE(
            comm, experts, hidden, ffn, capacity_factor=capacity_factor, backward="recompute", dtype=torch.float32
        )
        with torch.no_grad():
            layer.w1.copy_(w1[r * local : (r + 1) * local])
            layer.w2.copy_(w2[r * local : (r + 1) * local])
        x = xs[r].clone().requires_grad_(True)
        w = routing[r][1].clone().requires_grad_(True)
        layer(x, routing[r][0], w).backward(douts[r])
        grads.append((layer.w1.grad, layer.w2.grad))
    # partials: per rank, dx then d(weights), each [n * tokens, ...]: the reduce-scatter's sum.
    dx_sum = partials[0] + partials[2]
    dw_sum = partials[1] + partials[3]

    leaves = [t.double().requires_grad_(True) for t in (torch.cat(xs), torch.cat([w for _, w in routing]), w1, w2)]
    ref = moe_reference(leaves[0], torch.cat(kept_idx), leaves[1], leaves[2].to(torch.float64), leaves[3], act)
    ref.backward(torch.cat(douts).double())
    torch.testing.assert_close(dx_sum.double(), leaves[0].grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dw_sum.double(), leaves[1].grad, rtol=1e-4, atol=1e-4)
    for r in range(n):
        mine = slice(r * local, (r + 1) * local)
        torch.testing.assert_close(grads[r][0].double(), leaves[2].grad[mine], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(grads[r][1].double(), leaves[3].grad[mine], rtol=1e-4, atol=1e-4)
