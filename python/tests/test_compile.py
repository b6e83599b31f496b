"""torch.compile(fullgraph=True) keeps the mkernel ops in the graph (no graph breaks),
traced on meta tensors without a GPU, for the functional ops and the nn layers,
forward and backward."""

from __future__ import annotations

import pytest
import torch

import mkernel
from mkernel.nn import ColumnParallelLinear, RingAttention, RowParallelLinear

bf16 = torch.bfloat16


class GraphRecorder:
    """A torch.compile backend that keeps each FX graph and runs it as traced (eagerly)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def mkernel_ops(self) -> list[str]:
        return [
            str(node.target).removesuffix(".default")
            for gm in self.graphs
            for node in gm.graph.nodes
            if node.op == "call_function" and str(node.target).startswith("mkernel.")
        ]


def test_functional_ops_compile_without_graph_breaks(shape_comm):
    comm = shape_comm(2).name

    def step(x, w, q, k, v):
        y = mkernel.all_gather_gemm(x, w, comm)  # [2·rows, N]
        z = mkernel.gemm_reduce_scatter(torch.relu(y), w.t().contiguous(), comm)  # [rows, K]
        z = mkernel.all_reduce(z, comm)
        out, lse = mkernel.ring_attention(q, k, v, comm, causal=True)
        return z, out.float().sum() + lse.sum()

    recorder = GraphRecorder()
    compiled = torch.compile(step, backend=recorder, fullgraph=True)
    meta = dict(dtype=bf16, device="meta")
    z, s = compiled(
        torch.empty(8, 32, **meta),
        torch.empty(16, 32, **meta),
        torch.empty(1, 8, 4, 64, **meta),
        torch.empty(1, 8, 2, 64, **meta),
        torch.empty(1, 8, 2, 64, **meta),
    )
    assert z.shape == (8, 32) and z.dtype == bf16
    assert len(recorder.graphs) == 1
    assert recorder.mkernel_ops() == [
        "mkernel.all_gather_gemm",
        "mkernel.gemm_reduce_scatter",
        "mkernel.all_reduce",
        "mkernel.ring_attention",
    ]


def test_dynamic_shapes_trace_the_shape_rules(shape_comm):
    """With symbolic sizes the fakes run the shape rules themselves (a symbolic size has no
    cache key): one graph serves two sequence lengths."""
    comm = shape_comm(2).name

    def step(q, k, v):
        return mkernel.ring_attention(q, k, v, comm, causal=True)[0]

    recorder = GraphRecorder()
    compiled = torch.compile(step, backend=recorder, fullgraph=True, dynamic=True)
    meta = dict(dtype=bf16, device="meta")
    for seq in (8, 16):
        out = compiled(torch.empty(1, seq, 4, 64, **meta), *(torch.empty(1, seq, 2, 64, **meta) for _ in range(2)))
        assert out.shape == (1, seq, 4, 64)
    assert len(recorder.graphs) == 1
    assert recorder.mkernel_ops() == ["mkernel.ring_attention"]

def test_moe_ops_compile_for_a_second_token_count(shape_comm):
    """A second token count makes Dynamo trace the MoE ops again with a symbolic count
    (automatic dynamic shapes), so their shape rules and moe_layout_bytes see a symbolic
    size, which no cache can hash."""
    comm = shape_comm(2).name
    hidden, ffn, topk, cap = 128, 256, 2, 256

    def step(x, idx, w1, w2, weights):
        d = mkernel.moe_dispatch_gemm(x, idx, w1, comm, cap)
        return d.layout, mkernel.moe_gemm_combine(d.y, w2, weights, d.layout, comm)

    recorder = GraphRecorder()
    compiled = torch.compile(step, backend=recorder, fullgraph=True)
    meta = dict(device="meta")
    for tokens in (5, 9, 13, 17):
        layout, out = compiled(
            torch.empty(tokens, hidden, dtype=bf16, **meta),
            torch.empty(tokens, topk, dtype=torch.int32, **meta),
            torch.empty(1, ffn, hidden, dtype=bf16, **meta),
            torch.empty(1, hidden, ffn, dtype=bf16, **meta),
            torch.empty(tokens, topk, dtype=torch.float32, **meta),
        )
        assert layout.shape == (mkernel.moe_layout_bytes(tokens, topk, cap),)
        assert out.shape == (tokens, hidden) and out.dtype == bf16
    # The first count's static graph, then one graph for every other count: the layout's
    # size stays an expression of the count instead of specializing it.
    assert len(recorder.graphs) == 2


def test_moe_options_compile_into_one_graph(shape_comm):
    """The gated, dropping dispatch (moe_dispatch_gemm_with_options) stays in the graph with
    fullgraph=True, and its MoeDropDispatch fields reach the combine."""
    comm = shape_comm(2).name
    tokens, hidden, ffn, topk, cap = 7, 128, 128, 2, 256

    def step(x, idx, w1, w2, weights):
        d = mkernel.moe_dispatch_gemm(x, idx, w1, comm, cap, activation="silu", expert_capacity=3)
        return d.drop_counts, mkernel.moe_gemm_combine(d.y, w2, weights, d.layout, comm)

    recorder = GraphRecorder()
    compiled = torch.compile(step, backend=recorder, fullgraph=True)
    meta = dict(device="meta")
    drops, out = compiled(
        torch.empty(tokens, hidden, dtype=bf16, **meta),
        torch.empty(tokens, topk, dtype=torch.int32, **meta),
        torch.empty(1, 2 * ffn, hidden, dtype=bf16, **meta),
        torch.empty(1, hidden, ffn, dtype=bf16, **meta),
        torch.empty(tokens, topk, dtype=torch.float32, **meta),
    )
    assert drops.shape == (2,) and drops.dtype == torch.int32
    assert out.shape == (tokens, hidden) and out.dtype == bf16
    assert recorder.mkernel_ops() == ["mkernel.moe_dispatch_gemm_with_options", "mkernel.moe_gemm_combine"]


class TensorParallelMLP(torch.nn.Module):
    def __init__(self, hidden, ffn, comm, sequence_parallel):
        super().__init__()
        kw = dict(sequence_parallel=sequence_parallel, device="meta")
        self.up = ColumnParallelLinear(hidden, ffn, comm, **kw)
        self.down = RowParallelLinear(ffn, hidden, comm, **kw)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_parallel_mlp_compiles_forward_and_backward(shape_comm, sequence_parallel):
    n, seq, batch, hidden, ffn = 4, 16, 2, 64, 256
    comm = shape_comm(n).name
    mlp = TensorParallelMLP(hidden, ffn, comm, sequence_parallel)
    assert mlp.up.weight.shape == (ffn // n, hidden) and mlp.down.weight.shape == (hidden, ffn // n)

    recorder = GraphRecorder()
    # aot_autograd traces forward and backward together; the recorder sees both graphs.
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def boxed(gm, example_inputs):
        return make_boxed_func(recorder(gm, example_inputs))

    compiled = torch.compile(mlp, backend=aot_autograd(fw_compiler=boxed, bw_compiler=boxed), fullgraph=True)
    local_seq = seq // n if sequence_parallel else seq
    x = torch.empty(local_seq, batch, hidden, dtype=bf16, device="meta", requires_grad=True)
    y = compiled(x)
    assert y.shape == (local_seq, batch, hidden)
    y.sum().backward()
    assert x.grad.shape == x.shape
    assert mlp.up.weight.grad.shape == mlp.up.weight.shape
    assert mlp.down.bias.grad.shape == (hidden,)

    ops = recorder.mkernel_ops()
    if sequence_parallel:
        # forward: AG+GEMM, GEMM+RS; backward: AG+GEMM (row), GEMM+RS (column).
        assert sorted(ops) == sorted(["mkernel.all_gather_gemm", "mkernel.gemm_reduce_scatter"] * 2)
    else:
        # forward: GEMM+AR (row); backward: GEMM+AR (column's dx).
        assert ops == ["mkernel.gemm_all_reduce", "mkernel.gemm_all_reduce"]


def test_column_layer_skips_dx_for_an_input_without_grad(shape_comm):
    comm = shape_comm(2).name
    mlp = TensorParallelMLP(64, 128, comm, sequence_parallel=True)
    recorder = GraphRecorder()
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def boxed(gm, example_inputs):
        return make_boxed_func(recorder(gm, example_inputs))

    compiled = torch.compile(mlp, backend=aot_autograd(fw_compiler=boxed, bw_compiler=boxed), fullgraph=True)
    compiled(torch.empty(8, 2, 64, dtype=bf16, device="meta")).sum().backward()
    assert mlp.up.weight.grad is not None
    # The column layer's dx (a GEMM+ReduceScatter) is not computed: only the row layer's AllGather+GEMM remains.
    assert sorted(recorder.mkernel_ops()) == sorted(
        ["mkernel.all_gather_gemm", "mkernel.gemm_reduce_scatter", "mkernel.all_gather_gemm"]
    )


def test_ring_attention_module_compiles_forward_and_backward(shape_comm):
    comm = shape_comm(2).name
    attn = RingAttention(comm, causal=True)
    recorder = GraphRecorder()
    compiled = torch.compile(attn, backend=recorder, fullgraph=True)
    meta = dict(dtype=bf16, device="meta")
    q = torch.empty(1, 8, 4, 64, **meta)
    out = compiled(q, torch.empty(1, 8, 2, 64, **meta), torch.empty(1, 8, 2, 64, **meta))
    assert out.shape == q.shape
    assert recorder.mkernel_ops() == ["mkernel.ring_attention"]

    # The backward: one mkernel op in the backward graph, gradients shaped like the inputs.
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    fw, bw = GraphRecorder(), GraphRecorder()
    traced = torch.compile(
        attn,
        backend=aot_autograd(
            fw_compiler=lambda gm, ex: make_boxed_func(fw(gm, ex)),
            bw_compiler=lambda gm, ex: make_boxed_func(bw(gm, ex)),
        ),
        fullgraph=True,
    )
    q, k, v = (torch.empty(1, 8, h, 64, requires_grad=True, **meta) for h in (4, 2, 2))
    traced(q, k, v).float().sum().backward()
    assert fw.mkernel_ops() == ["mkernel.ring_attention"]
    assert bw.mkernel_ops() == ["mkernel.ring_attention_backward"]
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit, imported by Inductor
def test_graphs_compiled_at_two_world_sizes_under_one_name(shape_comm, monkeypatch, tmp_path):
    """Inductor caches compiled graphs on disk, keyed by the traced graph, and every process of a
    user shares that cache. A graph compiled for a 1-rank communicator must not be served to a
    2-rank one of the same name, whose AllGather + GEMM returns twice the rows: the graph holds
    the world size, so the two graphs differ. Runs Inductor on CPU tensors, the kernel launch
    replaced by a CPU stand-in."""
    from torch._dynamo.utils import counters
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    from mkernel import comm as registry
    from mkernel import ops

    def launch(a, b, out, gathered, comm):
        # As if every rank held this rank's rows.
        out.copy_(a.repeat(comm.world_size, 1) @ b.t())

    monkeypatch.setattr(ops, "all_gather_gemm_launch", launch)
    name = "test-compile-one-name"

    def step(x, w):
        return mkernel.all_gather_gemm(x, w, name)

    g = torch.Generator().manual_seed(7)
    x, w = (torch.randn(*shape, generator=g).to(bf16) for shape in ((4, 16), (8, 16)))

    def fresh_compile():
        # A new process's view: nothing compiled in memory, only the disk cache.
        torch._dynamo.reset()
        return torch.compile(step, backend="inductor", fullgraph=True)

    with temporary_cache_dir(str(tmp_path)), torch._inductor.config.patch(fx_graph_cache=True):
        try:
            shape_comm(1, name=name)
            counters.clear()
            one_rank = fresh_compile()
            assert one_rank(x, w).shape == (4, 8)
            assert fresh_compile()(x, w).shape == (4, 8)
            # The cache is on and served the second compile: the case the 2-rank compile must miss.
            hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
            assert hits >= 1, dict(counters)

            registry.unregister(name)
            shape_comm(2, name=name)
            y = fresh_compile()(x, w)
            assert y.shape == (8, 8)
            assert torch.equal(y, step(x, w))
            # A function compiled before the name changed hands recompiles (Dynamo guards on the world size).
            assert one_rank(x, w).shape == (8, 8)
        finally:
            torch._dynamo.reset()
