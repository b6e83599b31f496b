"""What each rank runs in the GPU tests (importable by the spawned rank processes).

Every case returns a list of problems (empty when the rank saw none). Inputs are random
and generated identically on every rank from seeds; references are float64 on the CPU;
outputs given through out= are poisoned first.
"""

from __future__ import annotations

import math
import threading
import time

import torch
import torch.nn.functional as F

import mkernel
from gpu_harness import close_to, seeded

bf16 = torch.bfloat16
DEV = "cuda:0"


def _shard(t: torch.Tensor, rank: int, n: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(n, dim=dim)[rank].contiguous()


def _poisoned(shape, dtype) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=DEV)
    return out.fill_(float("nan")) if dtype.is_floating_point else out.fill_(-7)


def collectives(comm, rank, n):
    problems = []
    # AllGather, bit-exact for an integer and a float type; out= poisoned.
    for seed, dtype in ((1, torch.int64), (2, bf16)):
        full = (seeded(seed, n * 6, 5, dtype=torch.float64, scale=1000)).to(dtype)
        mine = _shard(full, rank, n).to(DEV)
        out = _poisoned((n * 6, 5), dtype)
        mkernel.all_gather(mine, comm, out=out)
        if not torch.equal(out.cpu(), full):
            problems.append(f"all_gather {dtype}: differs from the concatenation")
        if not torch.equal(mkernel.all_gather(mine, comm).cpu(), full):
            problems.append(f"all_gather {dtype} (functional): differs")
    # fp8 is gathered as bytes: every bit pattern (NaN included) arrives unchanged.
    for seed, dtype in ((3, torch.float8_e4m3fn), (4, torch.float8_e5m2)):
        full = torch.randint(0, 256, (n * 6, 5), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
        out = mkernel.all_gather(_shard(full, rank, n).to(DEV).view(dtype), comm)
        if out.dtype != dtype or not torch.equal(out.view(torch.uint8).cpu(), full):
            problems.append(f"all_gather {dtype}: differs from the concatenation (bytes)")
    # ReduceScatter and AllReduce: every rank's contribution is seeded(100 + r).
    contributions = [seeded(100 + r, n * 8, 16, dtype=torch.float32) for r in range(n)]
    stacked = torch.stack([c.double() for c in contributions])
    mine = contributions[rank].to(DEV)
    for op, ref in (("sum", stacked.sum(0)), ("max", stacked.amax(0)), ("avg", stacked.mean(0))):
        out = _poisoned((8, 16), torch.float32)
        mkernel.reduce_scatter(mine, comm, op, out=out)
        problems += close_to(f"reduce_scatter {op}", out, _shard(ref, rank, n), rtol=1e-5, atol=1e-5)
        problems += close_to(f"all_reduce {op}", mkernel.all_reduce(mine, comm, op), ref, rtol=1e-5, atol=1e-5)
    ints = [
        torch.randint(-50, 50, (37,), generator=torch.Generator().manual_seed(200 + r), dtype=torch.int32)
        for r in range(n)
    ]
    got = mkernel.all_reduce(ints[rank].to(DEV), comm, "sum").cpu()
    if not torch.equal(got, torch.stack(ints).sum(0)):
        problems.append("all_reduce int32 sum: not exact")
    # In place: out=input.
    x = contributions[rank].to(DEV)
    mkernel.all_reduce(x, comm, "sum", out=x)
    problems += close_to("all_reduce in place", x, stacked.sum(0), rtol=1e-5, atol=1e-5)
    torch.cuda.synchronize()
    return problems


def gemms(comm, rank, n):
    problems = []
    rows, k, nn_ = 64, 256, 192
    m = rows * n
    # GEMM alone.
    a, b = seeded(10, m, k), seeded(11, nn_, k)
    ref = a.double() @ b.double().T
    out = _poisoned((m, nn_), bf16)
    mkernel.gemm(a.to(DEV), b.to(DEV), out=out)
    problems += close_to("gemm", out, ref, rtol=1e-2, atol=2e-2)
    # Scaled fp8 GEMM, both scale modes, against float64 of the dequantized inputs.
    a8, b8 = (a / 4).to(torch.float8_e4m3fn), (b / 4).to(torch.float8_e4m3fn)
    deq_a, deq_b = a8.double(), b8.double()
    for mode, sa, sb in (
        ("tensor", torch.tensor(0.75), torch.tensor(1.5)),
        ("rowwise", torch.rand(m, 1, generator=torch.Generator().manual_seed(12)) + 0.5,
         torch.rand(1, nn_, generator=torch.Generator().manual_seed(13)) + 0.5),
    ):
        ref8 = (deq_a * sa.double().reshape(-1, 1)) @ (deq_b * sb.double().reshape(-1, 1)).T
        c8 = mkernel.scaled_gemm(a8.to(DEV), b8.to(DEV), sa.float().to(DEV), sb.float().to(DEV))
        problems += close_to(f"scaled_gemm {mode}", c8, ref8, rtol=1e-2, atol=2e-2)
    # a in e5m2 (an fp8 gradient) times b in e4m3, against its own dequantized values.
    a8_e5m2 = (a / 4).to(torch.float8_e5m2)
    sa, sb = torch.tensor(0.75), torch.tensor(1.5)
    ref8 = (a8_e5m2.double() * 0.75) @ (deq_b * 1.5).T
    c8 = mkernel.scaled_gemm(a8_e5m2.to(DEV), b8.to(DEV), sa.to(DEV), sb.to(DEV))
    problems += close_to("scaled_gemm e5m2 a", c8, ref8, rtol=1e-2, atol=2e-2)
    # AllGather + GEMM: A's rows sharded, B replicated.
    c, gathered = mkernel.all_gather_gemm(_shard(a, rank, n).to(DEV), b.to(DEV), comm, return_gathered=True)
    problems += close_to("all_gather_gemm", c, ref, rtol=1e-2, atol=2e-2)
    if not torch.equal(gathered.cpu(), a):
        problems.append("all_gather_gemm: gathered A differs from the concatenated shards")
    # GEMM + ReduceScatter / AllReduce: the contraction dimension K sharded.
    a_k, b_k = _shard(a, rank, n, dim=1).to(DEV), _shard(b, rank, n, dim=1).to(DEV)
    partials = [(_shard(a, r, n, 1).double() @ _shard(b, r, n, 1).double().T).to(bf16).double() for r in range(n)]
    ref_sum = torch.stack(partials).sum(0)
    tol = dict(rtol=1e-2, atol=2e-2 * n)
    out = _poisoned((rows, nn_), bf16)
    mkernel.gemm_reduce_scatter(a_k, b_k, comm, out=out)
    problems += close_to("gemm_reduce_scatter", out, _shard(ref_sum, rank, n), **tol)
    for m_ar in (m, 5):  # two-phase and one-shot (decode-sized) paths
        c_ar = mkernel.gemm_all_reduce(a_k[:m_ar].contiguous(), b_k, comm)
        problems += close_to(f"gemm_all_reduce M={m_ar}", c_ar, ref_sum[:m_ar], **tol)
    # fp8 GEMM + ReduceScatter / AllReduce: K sharded, each rank with its own rowwise scales;
    # every partial rounded to bf16, as the op stores it.
    def k_shard(t, r):
        return _shard(t, r, n, dim=1)

    sas = [torch.rand(m, 1, generator=torch.Generator().manual_seed(20 + r)) + 0.5 for r in range(n)]
    sbs = [torch.rand(1, nn_, generator=torch.Generator().manual_seed(40 + r)) + 0.5 for r in range(n)]
    partials8 = [
        ((k_shard(a8, r).double() * sas[r].double()) @ (k_shard(b8, r).double() * sbs[r].double().reshape(-1, 1)).T)
        .to(bf16)
        .double()
        for r in range(n)
    ]
    ref8_sum = torch.stack(partials8).sum(0)
    a8_k, b8_k = k_shard(a8, rank).to(DEV), k_shard(b8, rank).to(DEV)
    sa_k, sb_k = sas[rank].to(DEV), sbs[rank].to(DEV)
    out = _poisoned((rows, nn_), bf16)
    mkernel.scaled_gemm_reduce_scatter(a8_k, b8_k, sa_k, sb_k, comm, out=out)
    problems += close_to("scaled_gemm_reduce_scatter", out, _shard(ref8_sum, rank, n), **tol)
    for m_ar in (m, 5):  # two-phase (n > 1) and one-shot paths
        c8_ar = mkernel.scaled_gemm_all_reduce(a8_k[:m_ar].contiguous(), b8_k, sa_k[:m_ar].contiguous(), sb_k, comm)
        problems += close_to(f"scaled_gemm_all_reduce M={m_ar}", c8_ar, ref8_sum[:m_ar], **tol)
    torch.cuda.synchronize()
    # As a plain list (bf16 -> float is exact): tensors sent through the queue would need the rank alive.
    return problems, mkernel.gemm_all_reduce(a_k, b_k, comm).float().cpu().flatten().tolist()


def moe(comm, rank, n):
    problems = []
    tokens, hidden, ffn, topk, local = 48, 128, 256, 2, 2
    experts = local * n
    cap = 128 * math.ceil(n * tokens * topk / 128) + 128 * local
    xs = [seeded(300 + r, tokens, hidden, scale=0.5) for r in range(n)]
    routes = []
    for r in range(n):
        g = torch.Generator().manual_seed(400 + r)
        idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).to(torch.int32)
        idx[::7, 1] = -1  # some tokens use one expert only
        routes.append(idx)
    weights = [torch.rand(tokens, topk, generator=torch.Generator().manual_seed(500 + r)) for r in range(n)]
    w1 = seeded(600, experts, ffn, hidden, scale=0.1)
    w2 = seeded(601, experts, hidden, ffn, scale=0.1)
    mine = slice(rank * local, (rank + 1) * local)

    d = mkernel.moe_dispatch_gemm(xs[rank].to(DEV), routes[rank].to(DEV), w1[mine].contiguous().to(DEV), comm, cap)
    counts = d.recv_counts.cpu()
    starts = mkernel.moe_segment_starts(d.recv_counts).cpu()
    y = d.y.cpu()
    for e in range(local):
        expert = rank * local + e
        # Rows for this expert: by source rank, then token index.
        rows = [xs[r][t] for r in range(n) for t in range(tokens) if expert in routes[r][t].tolist()]
        if int(counts[e]) != len(rows):
            problems.append(f"moe_dispatch_gemm: expert {expert} got {int(counts[e])} rows, want {len(rows)}")
            continue
        if rows:
            ref = torch.stack(rows).double() @ w1[expert].double().T
            got = y[int(starts[e]) : int(starts[e]) + len(rows)]
            problems += close_to(f"moe_dispatch_gemm y (expert {expert})", got, ref, rtol=1e-2, atol=1e-2)
    if int(counts[local]) > cap:
        problems.append(f"moe_dispatch_gemm: needed capacity {int(counts[local])} exceeds {cap}")

    y_act = F.gelu(d.y.float()).to(bf16)
    out = mkernel.moe_gemm_combine(y_act, w2[mine].contiguous().to(DEV), weights[rank].to(DEV), d.layout, comm)
    ref = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(topk):
            e = int(routes[rank][t, j])
            if e < 0:
                continue
            y_row = (xs[rank][t].double() @ w1[e].double().T).to(bf16).float()
            z = (F.gelu(y_row).to(bf16).double() @ w2[e].double().T).to(bf16).double()
            ref[t] += weights[rank][t, j].double() * z
    problems += close_to("moe_gemm_combine", out, ref, rtol=2e-2, atol=2e-2)
    torch.cuda.synchronize()
    return problems


def _zigzag_positions(rank: int, n: int, seq_local: int, causal: bool) -> torch.Tensor:
    if not causal:
        return torch.arange(rank * seq_local, (rank + 1) * seq_local)
    half = seq_local // 2
    return torch.cat(
        [torch.arange(rank * half, (rank + 1) * half), torch.arange((2 * n - 1 - rank) * half, (2 * n - rank) * half)]
    )


def ring_attention(comm, rank, n):
    problems = []
    batch, seq_local, heads, kv_heads, dim = 2, 64, 4, 2, 64
    seq = seq_local * n
    q, k, v = (seeded(700 + i, batch, seq, h, dim) for i, h in enumerate((heads, kv_heads, kv_heads)))
    scale = 1 / math.sqrt(dim)
    for causal in (False, True):
        pos = [_zigzag_positions(r, n, seq_local, causal) for r in range(n)]
        mine = pos[rank]
        out, lse = mkernel.ring_attention(*(t[:, mine].contiguous().to(DEV) for t in (q, k, v)), comm, causal=causal)
        # Reference over the global sequence, in float64 (GQA: head h uses K/V head h // (heads / kv_heads)).
        group = heads // kv_heads
        kk = k.double().repeat_interleave(group, dim=2)
        vv = v.double().repeat_interleave(group, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q[:, mine].double(), kk) * scale
        if causal:
            mask = mine[:, None] >= torch.arange(seq)[None, :]
            scores = scores.masked_fill(~mask, float("-inf"))
        ref_lse = torch.logsumexp(scores, dim=-1)
        ref_out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), vv)
        problems += close_to(f"ring_attention out causal={causal}", out, ref_out, rtol=2e-2, atol=1e-2)
        problems += close_to(f"ring_attention lse causal={causal}", lse, ref_lse, rtol=1e-3, atol=1e-3)
    torch.cuda.synchronize()
    return problems


def _attention64(q, k, v, scale: float, causal: bool, seq: int, rows: torch.Tensor) -> torch.Tensor:
    """Attention of the global rows `rows` of q (positions in the sequence) in float64."""
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if causal:
        scores = scores.masked_fill(~(rows[:, None] >= torch.arange(seq)[None, :]), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), vv)


def ring_attention_backward(comm, rank, n):
    """Autograd through mkernel.ring_attention (mkRingAttentionBackward) against float64
    autograd of the whole sequence's attention: dq of this rank's queries, dk and dv of its
    K/V shard (which sum every rank's queries)."""
    problems = []
    batch, seq_local, heads, kv_heads = 1, 96, 4, 2
    seq = seq_local * n
    for dim, causal in ((64, False), (128, True)):
        scale = 1 / math.sqrt(dim)
        q, k, v = (seeded(800 + dim + i, batch, seq, h, dim) for i, h in enumerate((heads, kv_heads, kv_heads)))
        dout = seeded(900 + dim, batch, seq, heads, dim)
        pos = torch.cat([_zigzag_positions(r, n, seq_local, causal) for r in range(n)])
        mine = _zigzag_positions(rank, n, seq_local, causal)
        # float64 reference over the global sequence, rows in the ranks' shard order.
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        out64 = _attention64(q64[:, pos], k64, v64, scale, causal, seq, pos)
        out64.backward(dout.double()[:, pos])
        local = [t[:, mine].contiguous().to(DEV).requires_grad_() for t in (q, k, v)]
        out, lse = mkernel.ring_attention(*local, comm, causal=causal)
        if lse.requires_grad:
            problems.append("ring_attention: lse requires grad (it is returned as a constant)")
        out.backward(dout[:, mine].contiguous().to(DEV))
        for name, got, ref in zip("qkv", local, (q64, k64, v64)):
            want = ref.grad[:, mine]
            atol = 2e-2 * float(want.abs().max())
            problems += close_to(f"d{name} D={dim} causal={causal}", got.grad, want, rtol=5e-2, atol=atol)
    torch.cuda.synchronize()
    return problems


def compile_and_graphs(comm, rank, n):
    problems = []
    rows, k, nn_ = 64, 128, 128
    b = seeded(20, nn_, k).to(DEV)

    def step(x):
        c = mkernel.all_gather_gemm(x, b, comm.name)  # [rows·n, 128], the same on every rank
        return mkernel.gemm_all_reduce(c, b, comm.name)  # n · c·bᵀ

    def reference(a_full):
        b64 = b.double().cpu()
        c = (a_full.double() @ b64.T).to(bf16).double()
        return n * (c @ b64.T)

    # torch.compile: one graph (fullgraph), same result as eager.
    x = _shard(seeded(21, rows * n, k), rank, n).to(DEV)
    eager = step(x)
    compiled = torch.compile(step, fullgraph=True)(x)
    if not torch.equal(eager, compiled):
        problems.append("torch.compile: the compiled step differs from eager")
    # CUDA graph: capture once, replay with new inputs copied into the static input.
    static_x = torch.empty_like(x)
    static_x.copy_(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(static_x)  # warm-up outside capture, as torch.cuda.graph recommends
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_x)
    for seed in (22, 23, 24):
        full = seeded(seed, rows * n, k)
        static_x.copy_(_shard(full, rank, n).to(DEV))
        static_out.fill_(float("nan"))
        graph.replay()
        problems += close_to(f"graph replay (seed {seed})", static_out, reference(full), rtol=2e-2, atol=0.5 * n)
    # torch.compile(mode="reduce-overhead"): Inductor's CUDA graph trees run the step, record it
    # on their own capture stream (the stream the ops must find as the current one) and replay it.
    from torch._dynamo.utils import counters

    counters["inductor"]["cudagraph_skips"] = 0
    graphed = torch.compile(lambda x: step(x), mode="reduce-overhead", fullgraph=True)
    for seed in (25, 26, 27, 28):  # warm-up, recording, then replays
        full = seeded(seed, rows * n, k)
        got = graphed(_shard(full, rank, n).to(DEV))
        problems += close_to(f"reduce-overhead (seed {seed})", got, reference(full), rtol=2e-2, atol=0.5 * n)
    if counters["inductor"]["cudagraph_skips"]:
        problems.append("reduce-overhead: Inductor ran the step without CUDA graphs")
    torch.cuda.synchronize()
    return problems


def parallel_linear(comm, rank, n, sequence_parallel: bool):
    """A Column -> GELU -> Row block against a float64 single-process reference, forward and backward."""
    problems = []
    seq, batch, hidden, ffn = 16 * n, 2, 128, 64 * n
    w_up, b_up = seeded(30, ffn, hidden, scale=0.1), seeded(31, ffn, scale=0.1)
    w_down, b_down = seeded(32, hidden, ffn, scale=0.1), seeded(33, hidden, scale=0.1)
    x_full, dy_full = seeded(34, seq, batch, hidden), seeded(35, seq, batch, hidden)

    up = mkernel.nn.ColumnParallelLinear(hidden, ffn, comm, sequence_parallel=sequence_parallel)
    down = mkernel.nn.RowParallelLinear(ffn, hidden, comm, sequence_parallel=sequence_parallel)
    with torch.no_grad():
        up.weight.copy_(_shard(w_up, rank, n))
        up.bias.copy_(_shard(b_up, rank, n))
        down.weight.copy_(_shard(w_down, rank, n, dim=1))
        down.bias.copy_(b_down)
    x = (_shard(x_full, rank, n) if sequence_parallel else x_full).to(DEV).requires_grad_()
    y = down(F.gelu(up(x)))
    y.backward((_shard(dy_full, rank, n) if sequence_parallel else dy_full).to(DEV))

    ref = [t.detach().double().requires_grad_() for t in (x_full, w_up, b_up, w_down, b_down)]
    rx, rwu, rbu, rwd, rbd = ref
    ry = F.linear(F.gelu(F.linear(rx, rwu, rbu)), rwd, rbd)
    ry.backward(dy_full.double())
    tol = dict(rtol=3e-2, atol=3e-2)
    local = (lambda t: _shard(t, rank, n)) if sequence_parallel else (lambda t: t)
    problems += close_to("y", y, local(ry), **tol)
    problems += close_to("dx", x.grad, local(rx.grad), **tol)
    problems += close_to("d up.weight", up.weight.grad, _shard(rwu.grad, rank, n), **tol)
    problems += close_to("d up.bias", up.bias.grad, _shard(rbu.grad, rank, n), **tol)
    problems += close_to("d down.weight", down.weight.grad, _shard(rwd.grad, rank, n, dim=1), **tol)
    problems += close_to("d down.bias", down.bias.grad, rbd.grad, rtol=3e-2, atol=5e-2)
    torch.cuda.synchronize()
    return problems


def abort_from_watchdog(comm, rank, n):
    """Rank 0 waits in a collective that rank 1 never joins; a watchdog thread aborts it."""
    if rank != 0:
        time.sleep(20)  # stays away from the collective until rank 0 is done
        comm.abort()
        return []
    x = torch.ones(1 << 20, device=DEV)
    mkernel.all_reduce(x, comm)  # blocks on the device: rank 1 never arrives
    watchdog = threading.Timer(2.0, comm.abort)
    t0 = time.monotonic()
    watchdog.start()
    torch.cuda.synchronize()  # returns once abort stops the kernel (the timeout is 120 s)
    waited = time.monotonic() - t0
    watchdog.join()
    problems = [] if waited < 15 else [f"synchronize returned {waited:.1f} s after the abort was scheduled"]
    try:
        mkernel.all_reduce(x, comm)
        problems.append("an op on an aborted communicator did not raise")
    except mkernel.MkInvalidUsageError as e:
        if "aborted" not in str(e):
            problems.append(f"unexpected message: {e}")
    return problems


def async_timeout(comm, rank, n):
    """A peer that never arrives: the kernel stops at the timeout and the next call raises."""
    if rank != 0:
        time.sleep(15)
        comm.abort()
        return []
    x = torch.ones(1024, device=DEV)
    mkernel.all_reduce(x, comm)
    torch.cuda.synchronize()  # bounded by the communicator's 2 s timeout
    problems = []
    # Every later call raises the error with the kernel's description (which op, on which rank).
    for call in ("the op after a timed-out one", "a second op"):
        try:
            mkernel.all_reduce(x, comm)
            problems.append(f"{call} did not raise")
        except (mkernel.MkTimeoutError, mkernel.MkRemoteError) as e:
            if "abort it and create a new one" not in str(e) or "mkAllReduce on rank 0" not in str(e):
                problems.append(f"{call}: unexpected message: {e}")
    comm.abort()
    return problems


def torch_distributed_bootstrap(_comm, rank, n, init_file):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=n)
    try:
        with mkernel.Communicator(device=0, workspace_bytes=64 << 20, max_ctas=32) as comm:
            problems = []
            if (comm.rank, comm.world_size) != (rank, n):
                problems.append(f"rank/world {comm.rank}/{comm.world_size}, want {rank}/{n}")
            if comm.device_memory_bytes != (4 << 20) + 2 * (64 << 20):
                problems.append(f"device_memory_bytes {comm.device_memory_bytes}")
            got = mkernel.all_reduce(torch.full((256,), float(rank + 1), device=DEV), comm)
            problems += close_to(
                "all_reduce over a gloo-bootstrapped communicator",
                got,
                torch.full((256,), n * (n + 1) / 2.0),
                rtol=0,
                atol=0,
            )
            return problems
    finally:
        dist.destroy_process_group()


def _relative(ref: torch.Tensor, rtol: float = 2e-2) -> dict:
    """Tolerances scaled to the reference: a gated layer's outputs are small, and an absolute
    bound of the plain layer's size would let a 10 % error pass."""
    return dict(rtol=rtol, atol=rtol / 2 * float(ref.abs().max()))


def _moe_inputs(seed, n, tokens, hidden, ffn_rows, ffn, topk, local, *, skew=0.0):
    """Every rank's tokens, routing (-1 entries, repeated picks, `skew` of the choices on
    experts 0 and 1) and weights, and every expert's w1 [E, ffn_rows, hidden], w2 [E, hidden, ffn]."""
    experts = local * n
    xs = [seeded(seed + r, tokens, hidden, scale=0.5) for r in range(n)]
    routes, weights = [], []
    for r in range(n):
        g = torch.Generator().manual_seed(seed + 100 + r)
        idx = torch.randint(0, experts, (tokens, topk), generator=g)
        hot = torch.randint(0, min(2, experts), (tokens, topk), generator=g)
        idx = torch.where(torch.rand(tokens, topk, generator=g) < skew, hot, idx)
        idx = torch.where(torch.rand(tokens, topk, generator=g) < 0.1, -1, idx)
        routes.append(idx.to(torch.int32))
        weights.append(torch.rand(tokens, topk, generator=g))
    w1 = seeded(seed + 200, experts, ffn_rows, hidden, scale=0.1)
    w2 = seeded(seed + 201, experts, hidden, ffn, scale=0.1)
    return xs, routes, weights, w1, w2


def _moe_rows(xs, routes, expert):
    """The rows expert `expert` receives, in the receive layout's order: by source rank, then token."""
    return [xs[r][t] for r in range(len(xs)) for t in range(xs[r].shape[0]) if expert in routes[r][t].tolist()]


def _combine_reference(x, route, weight, w1, w2, act):
    """Float64 of this rank's combined output: per kept choice, act(x·w1ᵀ) and its product
    with w2 each rounded to bf16 as the kernels store them, weighted and summed."""
    ref = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(route.shape[1]):
            e = int(route[t, j])
            if e >= 0:
                y_row = act(x[t].double() @ w1[e].double().T).to(bf16).double()
                ref[t] += weight[t, j].double() * (y_row @ w2[e].double().T).to(bf16).double()
    return ref


def _receive_rows_problems(label, d, xs, kept_routes, weights, w1, act, rank, local, recv_capacity):
    """The row map the layer's kernels backward recomputes (moe_receive_rows) against the
    dispatch's own rows: every row it names holds act(x[token] · W1_eᵀ) of its token and
    expert, and it names recv_counts[e] rows of each local expert."""
    from mkernel.nn.moe_backward import moe_receive_rows

    rows = moe_receive_rows(torch.cat(kept_routes), torch.cat(weights), rank, local, recv_capacity)
    token, ends = rows.token.cpu(), rows.group_ends.cpu().tolist()
    x_all = torch.cat(xs).double()
    problems, start = [], 0
    for e in range(local):
        held = (token[start : ends[e]] >= 0).nonzero().squeeze(1) + start
        if held.numel() != int(d.recv_counts[e]):
            problems.append(f"{label}: moe_receive_rows names {held.numel()} rows of local expert {e}, "
                            f"the dispatch {int(d.recv_counts[e])}")
        elif held.numel():
            ref = act(x_all[token[held]] @ w1[rank * local + e].double().T)
            got = d.y[held.to(DEV)]
            problems += close_to(f"{label}: moe_receive_rows' rows of local expert {e}", got, ref, **_relative(ref))
        start = ends[e]
    return problems


def moe_options(comm, rank, n, seed):
    """The dispatch's options through Python: SwiGLU and GeGLU in the epilogue, drop mode
    (drop counts, kept rows, the combine) and an overflow that leaves the communicator usable
    (MkMoeOverflowError names the needed capacity; the retry with it is checked), against
    float64."""
    from mkernel.nn.moe import ACTIVATIONS, moe_kept, receive_capacity

    problems = []
    tokens, hidden, ffn, topk, local = 64, 128, 128, 3, 2
    experts = local * n
    mine = slice(rank * local, (rank + 1) * local)
    for name, fused in (("swiglu", "silu"), ("geglu", "gelu")):
        act = ACTIVATIONS[name][1]
        xs, routes, weights, w1, w2 = _moe_inputs(seed, n, tokens, hidden, 2 * ffn, ffn, topk, local, skew=0.5)
        for capacity in (None, 5):
            label = f"{name} expert_capacity={capacity} (seed {seed})"
            kept_routes = routes
            if capacity is not None:
                kept_routes = [torch.where(moe_kept(r, experts, capacity)[0], r, -1) for r in routes]
            bound = receive_capacity(tokens, topk, local, n)
            d = mkernel.moe_dispatch_gemm(
                xs[rank].to(DEV),
                routes[rank].to(DEV),
                w1[mine].contiguous().to(DEV),
                comm,
                bound,
                activation=fused,
                expert_capacity=capacity,
            )
            if capacity is not None:
                want_drops = moe_kept(routes[rank], experts, capacity)[1]
                if not torch.equal(d.drop_counts.cpu(), want_drops):
                    problems.append(f"{label}: drop_counts {d.drop_counts.tolist()}, want {want_drops.tolist()}")
            counts = d.recv_counts.cpu()
            starts = mkernel.moe_segment_starts(d.recv_counts).cpu()
            for e in range(local):
                rows = _moe_rows(xs, kept_routes, rank * local + e)
                if int(counts[e]) != len(rows):
                    problems.append(f"{label}: expert {rank * local + e} got {int(counts[e])} rows, want {len(rows)}")
                    continue
                if rows:
                    ref = act(torch.stack(rows).double() @ w1[rank * local + e].double().T)
                    got = d.y[int(starts[e]) : int(starts[e]) + len(rows)]
                    problems += close_to(f"{label}: y of expert {rank * local + e}", got, ref, **_relative(ref))
            problems += _receive_rows_problems(label, d, xs, kept_routes, weights, w1, act, rank, local, bound)
            out = mkernel.moe_gemm_combine(d.y, w2[mine].contiguous().to(DEV), weights[rank].to(DEV), d.layout, comm)
            ref = _combine_reference(xs[rank], kept_routes[rank], weights[rank], w1, w2, act)
            problems += close_to(f"{label}: moe_gemm_combine", out, ref, **_relative(ref))

    # Overflow then retry: every choice on experts 0 and 1 (rank 0's), far past 128 rows.
    xs, routes, weights, w1, w2 = _moe_inputs(seed + 1000, n, tokens, hidden, ffn, ffn, topk, local, skew=1.0)
    d = mkernel.moe_dispatch_gemm(xs[rank].to(DEV), routes[rank].to(DEV), w1[mine].contiguous().to(DEV), comm, 128)
    try:
        d.raise_for_overflow()
        problems.append(f"overflow (seed {seed}): 128 rows fit a routing that sends every choice to rank 0")
        needed = None
    except mkernel.MkMoeOverflowError as e:
        needed = e.needed_capacity
    comm.check_async_error()  # the overflow is no error of the communicator
    if needed is not None:
        d = mkernel.moe_dispatch_gemm(
            xs[rank].to(DEV), routes[rank].to(DEV), w1[mine].contiguous().to(DEV), comm, needed
        )
        d.raise_for_overflow()
        out = mkernel.moe_gemm_combine(d.y, w2[mine].contiguous().to(DEV), weights[rank].to(DEV), d.layout, comm)
        ref = _combine_reference(xs[rank], routes[rank], weights[rank], w1, w2, lambda y: y)
        problems += close_to(f"overflow then retry at {needed} (seed {seed}): combine", out, ref, **_relative(ref))
    torch.cuda.synchronize()
    return problems


def moe_layer(comm, rank, n, seed):
    """mkernel.nn.MoE forward and backward against float64 autograd of the unfused layer
    (moe_reference with every rank's tokens and every expert in one process): out, dx,
    d(topk_weights), dw1, dw2, for SwiGLU, GeGLU and a plain GELU, with and without drop
    mode, skewed routing with -1 entries and repeated experts, each with the backward on
    the MoE kernels and with the recompute backward."""
    from mkernel.nn.moe import ACTIVATIONS, BACKWARDS, expert_capacity, moe_kept, moe_reference

    problems = []
    tokens, hidden, ffn, topk, local = 96, 256, 128, 4, 2
    experts = local * n
    mine = slice(rank * local, (rank + 1) * local)
    rows = slice(rank * tokens, (rank + 1) * tokens)
    cases = [
        (name, capacity_factor, backward)
        for name, capacity_factor in (("swiglu", None), ("geglu", None), ("gelu", None), ("swiglu", 0.75))
        for backward in BACKWARDS
    ]
    for case, (name, capacity_factor, backward) in enumerate(cases):
        fused, act = ACTIVATIONS[name]
        s = seed + 10_000 * (case + 1)
        fc1 = 2 * ffn if fused != "none" else ffn
        xs, routes, weights, w1, w2 = _moe_inputs(s, n, tokens, hidden, fc1, ffn, topk, local, skew=0.4)
        dout = [seeded(s + 300 + r, tokens, hidden) for r in range(n)]
        label = f"nn.MoE {name} capacity_factor={capacity_factor} backward={backward} (seed {s})"

        layer = mkernel.nn.MoE(
            comm, experts, hidden, ffn, activation=name, capacity_factor=capacity_factor, backward=backward, device=DEV
        )
        with torch.no_grad():
            layer.w1.copy_(w1[mine])
            layer.w2.copy_(w2[mine])
        x = xs[rank].to(DEV).requires_grad_()
        w = weights[rank].to(DEV).requires_grad_()
        out = layer(x, routes[rank].to(DEV), w)
        out.backward(dout[rank].to(DEV))

        ref_routes = routes
        if capacity_factor is not None:
            capacity = expert_capacity(tokens, topk, experts, capacity_factor)
            ref_routes = [torch.where(moe_kept(r, experts, capacity)[0], r, -1) for r in routes]
            want_drops = moe_kept(routes[rank], experts, capacity)[1]
            if not torch.equal(layer.drop_counts.cpu(), want_drops):
                problems.append(f"{label}: drop_counts {layer.drop_counts.tolist()}, want {want_drops.tolist()}")
        leaves = [t.detach().double().requires_grad_() for t in (torch.cat(xs), torch.cat(weights), w1, w2)]
        ref = moe_reference(leaves[0], torch.cat(ref_routes), leaves[1], leaves[2], leaves[3], act)
        ref.backward(torch.cat(dout).double())
        grads = {"dx": (x.grad, leaves[0].grad[rows]), "d topk_weights": (w.grad, leaves[1].grad[rows])}
        grads["d w1"] = (layer.w1.grad, leaves[2].grad[mine])
        grads["d w2"] = (layer.w2.grad, leaves[3].grad[mine])
        problems += close_to(f"{label}: out", out, ref[rows], **_relative(ref[rows], rtol=3e-2))
        for what, (got, want) in grads.items():
            if got is None:
                problems.append(f"{label}: {what} is None")
                continue
            atol = 2e-2 * float(want.abs().max())
            problems += close_to(f"{label}: {what}", got, want, rtol=5e-2, atol=atol)
    torch.cuda.synchronize()
    return problems
