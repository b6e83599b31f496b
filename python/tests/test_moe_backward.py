"""The MoE layer's backward on the MoE kernels (mkernel.nn.moe_backward) on the CPU: the
receive layout it recomputes against a plain loop over the header's rule, the repeated-
choice weights of its combine, the activations' hand-written backwards against float64
autograd, and the whole backward at 1, 2 and 4 ranks (threads) against float64 autograd
of the unfused reference, with the MoE ops and the collectives replaced by plain float64
stand-ins that follow their documented contracts. The ops themselves run in the GPU tests
(gpu_cases.moe_layer)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import mkernel
from mkernel.nn import moe as moe_module
from mkernel.nn import moe_backward
from mkernel.nn.moe import ACTIVATIONS, glu, moe_reference, receive_capacity
from mkernel.nn.moe_backward import (
    ACTIVATION_BACKWARDS,
    activation_backward_by_autograd,
    first_choice_weights,
    moe_receive_rows,
)
from mkernel.ops import resolve
from test_moe_layer import _kept_by_loop, _routing, _weights


def _receive_layout_by_loop(routes, rank, local):
    """`rank`'s receive buffer by include/mkernel.h's rule, in plain loops: {row: (source rank,
    token, local expert)} and each expert's segment end. routes: every rank's ids, dropped
    choices -1. Rows grouped by local expert, then source rank, then token; one row per
    (token, expert); segments start on multiples of 128 rows."""
    rows, start, ends = {}, 0, []
    for le in range(local):
        e = rank * local + le
        group = [(s, t) for s, idx in enumerate(routes) for t in range(idx.shape[0]) if e in idx[t].tolist()]
        for i, (s, t) in enumerate(group):
            rows[start + i] = (s, t, le)
        start += -(-len(group) // 128) * 128
        ends.append(start)
    return rows, ends


def _kept_routes(routes, experts, capacity):
    if capacity is None:
        return list(routes)
    return [torch.where(_kept_by_loop(idx, experts, capacity)[0], idx, -1) for idx in routes]


@pytest.mark.parametrize("capacity", [None, 4])
def test_receive_rows_follow_the_dispatch_layout(capacity):
    n, tokens, topk, local = 3, 60, 4, 3
    experts = n * local
    routing = [_routing(tokens, topk, experts, 50 + r) for r in range(n)]
    routes = _kept_routes([idx for idx, _ in routing], experts, capacity)
    idx_all, weights_all = torch.cat(routes), torch.cat([w for _, w in routing])
    recv_capacity = receive_capacity(tokens, topk, local, n)
    for rank in range(n):
        rows, ends = _receive_layout_by_loop(routes, rank, local)
        assert rows, rank
        got = moe_receive_rows(idx_all, weights_all, rank, local, recv_capacity)
        want_token = [-1] * recv_capacity
        want_weight = [0.0] * recv_capacity
        where = {}
        for row, (s, t, le) in rows.items():
            g, e = s * tokens + t, rank * local + le
            want_token[row] = g
            want_weight[row] = sum(float(weights_all[g, j]) for j in range(topk) if int(routes[s][t, j]) == e)
            where[(g, e)] = row
        assert got.token.tolist() == want_token, rank
        torch.testing.assert_close(got.weight, torch.tensor(want_weight), rtol=1e-6, atol=0)
        assert got.group_ends.dtype == torch.int32 and got.group_ends.tolist() == ends
        want_choice = [[where.get((g, int(e)), -1) for e in idx_all[g]] for g in range(n * tokens)]
        assert got.choice_row.tolist() == want_choice
    # The routing leaves at least one token with a repeated expert.
    assert any(len(set(r.tolist()) - {-1}) < len([e for e in r.tolist() if e >= 0]) for r in idx_all)


def test_first_choice_weights_count_each_expert_of_a_token_once():
    idx = torch.tensor([[2, 2, -1, 5], [-1, -1, -1, -1], [1, 3, 1, 1], [0, 4, 6, 7]], dtype=torch.int32)
    want = [[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert first_choice_weights(idx).tolist() == want
    routed, _ = _routing(40, 5, 4, 3)
    got = first_choice_weights(routed)
    for t in range(40):
        seen = set()
        for j, e in enumerate(routed[t].tolist()):
            assert got[t, j] == (1.0 if e >= 0 and e not in seen else 0.0)
            seen.add(e)


def _clamped_glu(h):
    gate, up = torch.chunk(h, 2, dim=-1)
    return F.silu(gate.clamp(max=0.5)) * (up.clamp(min=-0.5, max=0.5) + 1.0)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_backwards_match_float64_autograd(name):
    assert set(ACTIVATION_BACKWARDS) == set(ACTIVATIONS)
    fused, act = ACTIVATIONS[name]
    g = torch.Generator().manual_seed(7)
    h = torch.randn(33, 256 if fused != "none" else 128, generator=g, dtype=torch.float64) * 3
    dy = torch.randn(33, 128, generator=g, dtype=torch.float64)
    leaf = h.clone().requires_grad_(True)
    want_y = act(leaf)
    (want_dh,) = torch.autograd.grad(want_y, leaf, dy)
    for backward in (ACTIVATION_BACKWARDS[name], activation_backward_by_autograd(act)):
        y, dh = backward(h.float(), dy.float())
        assert y.dtype == torch.float32 and dh.dtype == torch.float32
        torch.testing.assert_close(y.double(), want_y.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dh.double(), want_dh, rtol=1e-5, atol=1e-5)
    # bf16 inputs: the formulas run in fp32 on them.
    y, dh = ACTIVATION_BACKWARDS[name](h.bfloat16(), dy.bfloat16())
    assert y.dtype == torch.float32 and dh.dtype == torch.float32


def test_autograd_activation_backward_takes_any_activation():
    g = torch.Generator().manual_seed(8)
    h = torch.randn(20, 256, generator=g, dtype=torch.float64)
    dy = torch.randn(20, 128, generator=g, dtype=torch.float64)
    leaf = h.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(_clamped_glu(leaf), leaf, dy)
    y, dh = activation_backward_by_autograd(_clamped_glu)(h.float(), dy.float())
    torch.testing.assert_close(y.double(), _clamped_glu(h), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dh.double(), want, rtol=1e-5, atol=1e-5)




_FUSED = {"none": lambda h: h, "silu": glu(F.silu), "gelu": glu(F.gelu)}


class _ExpertParallelWorld:
    """n ranks as threads sharing this object. mkernel's MoE ops and its all_gather and
    reduce_scatter are replaced by float64 stand-ins written after their documented
    contracts (include/mkernel.h), which exchange through a barrier: the dispatch lays its
    rows out by _receive_layout_by_loop and fills the padding with NaN ("unspecified"); the
    combine computes Z per row and sums w·Z over each token's kept choices in choice order
    (a repeated expert counted per choice). Each rank's calls are recorded."""

    def __init__(self, monkeypatch, n, experts):
        self.n, self.experts = n, experts
        self.barrier = threading.Barrier(n, timeout=120)
        self.slots = [None] * n
        self.rows = {}  # rank -> {row: (source, token, local expert)} of its latest dispatch
        self.calls = [[] for _ in range(n)]
        for module in (moe_module, moe_backward):
            for name in ("moe_dispatch_gemm", "moe_gemm_combine", "all_gather", "reduce_scatter"):
                monkeypatch.setattr(module, name, getattr(self, name))

    def exchange(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        everyone = list(self.slots)
        self.barrier.wait()
        return everyone

    def run(self, step):
        """step(rank) on every rank, each in its own thread; the first failure is raised."""
        results, errors = [None] * self.n, []

        def body(rank):
            try:
                results[rank] = step(rank)
            except BaseException as e:  # noqa: BLE001 - re-raised below, the others released
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)] or errors
        if first:
            raise first[0]
        return results

    def moe_dispatch_gemm(self, x, topk_idx, w1, comm, capacity, *, activation="none", expert_capacity=None):
        rank = resolve(comm).rank
        self.calls[rank].append(("dispatch", activation, expert_capacity, tuple(w1.shape)))
        everyone = self.exchange(rank, (x, topk_idx, expert_capacity))
        routes = [_kept_routes([idx], self.experts, cap)[0] for _, idx, cap in everyone]
        local = w1.shape[0]
        rows, ends = _receive_layout_by_loop(routes, rank, local)
        assert max(self.exchange(rank, ends[-1])) <= capacity, "the stand-in does not model an overflow"
        ffn = w1.shape[1] // 2 if activation != "none" else w1.shape[1]
        y = torch.full((capacity, ffn), float("nan"), dtype=x.dtype)
        for row, (s, t, le) in rows.items():
            y[row] = _FUSED[activation](everyone[s][0][t].double() @ w1[le].double().t()).to(x.dtype)
        self.rows[rank] = rows
        where = self.exchange(rank, {(s, t, rank * local + le): row for row, (s, t, le) in rows.items()})
        tokens, topk = topk_idx.shape
        layout = torch.full((tokens, topk, 2), -1, dtype=torch.int64)  # (owner, row) per choice
        for t in range(tokens):
            for j in range(topk):
                e = int(routes[rank][t, j])
                if e >= 0:
                    layout[t, j] = torch.tensor([e // local, where[e // local][(rank, t, e)]])
        counts = [sum(1 for s_, t_, le_ in rows.values() if le_ == le) for le in range(local)]
        recv_counts = torch.tensor(counts + [capacity], dtype=torch.int32)
        if expert_capacity is None:
            return mkernel.MoeDispatch(y, recv_counts, layout)
        drops = _kept_by_loop(topk_idx, self.experts, expert_capacity)[1]
        return mkernel.MoeDropDispatch(y, recv_counts, layout, drops)

    def moe_gemm_combine(self, y_act, w2, topk_weights, layout, comm):
        rank = resolve(comm).rank
        self.calls[rank].append(("combine", tuple(w2.shape)))
        z = {row: y_act[row].double() @ w2[le].double().t() for row, (_, _, le) in self.rows[rank].items()}
        everyone = self.exchange(rank, z)
        tokens, topk = topk_weights.shape
        out = torch.zeros(tokens, w2.shape[1], dtype=torch.float64)
        for t in range(tokens):
            for j in range(topk):
                owner, row = layout[t, j].tolist()
                if owner >= 0:
                    out[t] += float(topk_weights[t, j]) * everyone[owner][row]
        return out.to(y_act.dtype)

    def all_gather(self, t, comm):
        return torch.cat(self.exchange(resolve(comm).rank, t))

    def reduce_scatter(self, t, comm):
        rank = resolve(comm).rank
        return sum(self.exchange(rank, t)).chunk(self.n)[rank].clone()


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize(
    "activation, capacity_factor",
    [("swiglu", None), ("geglu", None), ("gelu", None), ("relu", None), ("swiglu", 0.4), ("silu", 0.4)],
)
def test_kernels_backward_matches_float64_reference(shape_comm, monkeypatch, n, activation, capacity_factor):
    """nn.MoE(backward="kernels") at n ranks: out, dx, d topk_weights, dw1 and dw2 against
    float64 autograd of moe_reference over every rank's tokens and every expert (skewed
    routing, -1 entries, a repeated expert in a token), and the backward's calls: one
    dispatch of dout through W2ᵀ, one combine through W1ᵀ, no recomputation of the GEMMs."""
    tokens, topk, local, hidden, ffn = 20, 3, 2, 128, 128
    experts = local * n
    world = _ExpertParallelWorld(monkeypatch, n, experts)
    routing = [_routing(tokens, topk, experts, 60 + r) for r in range(n)]
    routing[0][0][0] = torch.tensor([1, 1, -1], dtype=torch.int32)
    g = torch.Generator().manual_seed(61)
    xs = [torch.randn(tokens, hidden, generator=g) for _ in range(n)]
    douts = [torch.randn(tokens, hidden, generator=g) for _ in range(n)]
    fused, act = ACTIVATIONS[activation]
    fc1 = 2 * ffn if fused != "none" else ffn
    w1, w2 = _weights(experts, fc1, hidden, ffn, 62, torch.float32)
    layers = []
    for r in range(n):
        layer = mkernel.nn.MoE(
            shape_comm(n, rank=r).name, experts, hidden, ffn, activation=activation,
            capacity_factor=capacity_factor, dtype=torch.float32,
        )
        with torch.no_grad():
            layer.w1.copy_(w1[r * local : (r + 1) * local])
            layer.w2.copy_(w2[r * local : (r + 1) * local])
        layers.append(layer)

    def step(rank):
        x = xs[rank].clone().requires_grad_(True)
        w = routing[rank][1].clone().requires_grad_(True)
        out = layers[rank](x, routing[rank][0], w)
        out.backward(douts[rank])
        return out.detach(), x.grad, w.grad, layers[rank].w1.grad, layers[rank].w2.grad

    results = world.run(step)

    capacity = None
    if capacity_factor is not None:
        capacity = moe_module.expert_capacity(tokens, topk, experts, capacity_factor)
    kept = _kept_routes([idx for idx, _ in routing], experts, capacity)
    if capacity is not None:
        assert any((k != idx).any() for k, (idx, _) in zip(kept, routing)), "the case drops nothing"
    leaves = [t.double().requires_grad_(True) for t in (torch.cat(xs), torch.cat([w for _, w in routing]), w1, w2)]
    ref = moe_reference(leaves[0], torch.cat(kept), leaves[1], leaves[2], leaves[3], act)
    ref.backward(torch.cat(douts).double())
    for r, (out, dx, dw, dw1, dw2) in enumerate(results):
        mine, experts_of_r = slice(r * tokens, (r + 1) * tokens), slice(r * local, (r + 1) * local)
        got = {"out": out, "dx": dx, "d topk_weights": dw, "dw1": dw1, "dw2": dw2}
        want = {
            "out": ref[mine].detach(),
            "dx": leaves[0].grad[mine],
            "d topk_weights": leaves[1].grad[mine],
            "dw1": leaves[2].grad[experts_of_r],
            "dw2": leaves[3].grad[experts_of_r],
        }
        for name in got:
            assert _nonzero(want[name]), name
            torch.testing.assert_close(got[name].double(), want[name], rtol=1e-4, atol=1e-4, msg=f"rank {r}: {name}")
        # A -1 or dropped choice's weight gets exactly no gradient.
        assert (dw[kept[r] < 0] == 0).all()
        assert world.calls[r] == [
            ("dispatch", fused, capacity, (local, fc1, hidden)),
            ("combine", (local, hidden, ffn)),
            ("dispatch", "none", capacity, (local, ffn, hidden)),  # dout through W2ᵀ
            ("combine", (local, hidden, fc1)),  # dh through W1ᵀ
        ]


def _nonzero(t: torch.Tensor) -> bool:
    return bool(t.abs().max() > 0)


def test_a_nan_token_reaches_its_own_gradients_and_its_experts_only(shape_comm, monkeypatch):
    """Rows of the receive buffer that hold no token take no token's x: a NaN in rank 0's
    token 0 (routed to expert 0 alone) makes that token's gradients and expert 0's weight
    gradients NaN, and leaves every other gradient finite (0 · NaN on a padding row would
    reach every expert's dW1)."""
    n, tokens, topk, local, hidden, ffn = 2, 12, 2, 2, 128, 128
    experts = local * n
    world = _ExpertParallelWorld(monkeypatch, n, experts)
    routing = [_routing(tokens, topk, experts, 70 + r, holes=False) for r in range(n)]
    for idx, _ in routing:
        idx.masked_fill_(idx == 0, 1)
    routing[0][0][0] = torch.tensor([0, -1], dtype=torch.int32)
    g = torch.Generator().manual_seed(71)
    xs = [torch.randn(tokens, hidden, generator=g) for _ in range(n)]
    xs[0][0, 5] = float("nan")
    w1, w2 = _weights(experts, 2 * ffn, hidden, ffn, 72, torch.float32)
    layers = []
    for r in range(n):
        layer = mkernel.nn.MoE(shape_comm(n, rank=r).name, experts, hidden, ffn, dtype=torch.float32)
        with torch.no_grad():
            layer.w1.copy_(w1[r * local : (r + 1) * local])
            layer.w2.copy_(w2[r * local : (r + 1) * local])
        layers.append(layer)

    def step(rank):
        x = xs[rank].clone().requires_grad_(True)
        w = routing[rank][1].clone().requires_grad_(True)
        layers[rank](x, routing[rank][0], w).backward(torch.ones(tokens, hidden))
        return x.grad, w.grad, layers[rank].w1.grad, layers[rank].w2.grad

    (dx0, dw0, dw1_0, dw2_0), (dx1, dw1, dw1_1, dw2_1) = world.run(step)
    assert dx0[0].isnan().all() and dw0[0, 0].isnan()
    assert dw1_0[0].isnan().any() and dw2_0[0].isnan().any()
    assert dx0[1:].isfinite().all() and dw0[1:].isfinite().all() and dw0[0, 1] == 0
    assert dw1_0[1:].isfinite().all() and dw2_0[1:].isfinite().all()
    assert all(t.isfinite().all() for t in (dx1, dw1, dw1_1, dw2_1))


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("activation, expert_capacity", [("swiglu", None), ("gelu", None), ("geglu", 7)])
def test_kernels_backward_traces_with_fake_cuda_tensors(shape_comm, n, activation, expert_capacity):
    """moe_backward_on_kernels on fake CUDA bf16 tensors (torch.compile's tracing; called
    directly, as autograd's engine needs a real device for fake CUDA tensors): the MoE ops'
    and collectives' shape rules and torch._grouped_mm's CUDA rules (bf16 operands, 16-byte
    strides, the 2D × 2D wgrad form) accept every call it makes, which the float32 CPU test
    cannot show, and each gradient has its input's shape and dtype."""
    tokens, topk, local, hidden, ffn = 64, 4, 2, 384, 128  # no two of hidden, ffn, 2·ffn alike
    fused = ACTIVATIONS[activation][0]
    fc1 = 2 * ffn if fused != "none" else ffn
    comm = shape_comm(n).name
    recv_capacity = receive_capacity(tokens, topk, local, n, expert_capacity)

    def e(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device="cuda")

    with FakeTensorMode():
        x, w1, w2 = e(tokens, hidden), e(local, fc1, hidden), e(local, hidden, ffn)
        idx, weights = e(tokens, topk, dtype=torch.int32), e(tokens, topk, dtype=torch.float32)
        hidden_rows = None if fused != "none" else e(recv_capacity, ffn)
        grads = moe_backward.moe_backward_on_kernels(
            e(tokens, hidden), x, idx, idx, weights, w1, w2, hidden_rows, comm=comm, recv_capacity=recv_capacity,
            expert_capacity=expert_capacity, activation_backward=ACTIVATION_BACKWARDS[activation],
        )
        for name, grad, leaf in zip(("x", "topk_weights", "w1", "w2"), grads, (x, weights, w1, w2)):
            assert (grad.shape, grad.dtype, grad.device) == (leaf.shape, leaf.dtype, leaf.device), name
