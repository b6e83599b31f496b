"""The whole SwiGLU MoE layer at one rank: mkernel against the grouped-GEMM stack, one process.

Model shapes (--model, default all): DeepSeek-V3 (H 7168, F 2048, E 256, top-8),
Qwen3-235B-A22B (H 4096, F 1536, E 128, top-8), Mixtral-8x7B (H 4096, F 14336, E 8,
top-2); bf16; T tokens per case (default 4096 and 16384). Every expert is local (one rank).

Routing, skewed by a stated rule (`zipf_routing`): the expert of popularity rank r
(1 = most popular) is chosen with weight 1 / r^s, s = --zipf (1.0 by default, Zipf's law);
the ranks go to expert ids by a seeded permutation, so the hot experts are not the low ids.
Each token draws k distinct experts by sampling without replacement in proportion to those
weights (Gumbel top-k: the first choice follows the law exactly); its k weights are a
softmax of standard-normal logits. Seeded (--seed, default 0) on the CPU, so every run and
machine routes alike. Each case prints its rows per expert (hottest, median, coldest, empty).

The weights are mkernel.nn.MoE's (w1 [E, 2F, H] in Megatron's fused fc1 layout, gate rows
then up rows; w2 [E, H, F]; nn.Linear's initialisation), shared by every contender; x is
uniform in [-1, 1). Directions, each a row of the record with its own interleaved blocks:

- `layer`: mkernel.nn.MoE's forward (`mkernel_moe_layer`: moe_dispatch_gemm with the SwiGLU
  epilogue, then moe_gemm_combine; the receive buffer at nn.MoE's no-overflow bound, no
  host synchronisation) against the stack a user runs on one GPU: the (token, choice) pairs
  sorted by expert, the rows gathered, torch._grouped_mm with w1 (gate_up), SiLU(gate)·up,
  torch._grouped_mm with w2 (down), a weighted index_add_ in fp32, captured whole in one
  CUDA graph (`torch_stack_graph`, one layer per replay) so that launch gaps do not
  handicap it; and the same stack called eagerly (`torch_stack`).
- `dispatch`: moe_dispatch_gemm with activation "silu" (`mkernel_dispatch_gemm`: the
  rows' dispatch, the gate_up GEMM and SwiGLU) against torch._grouped_mm alone on the rows
  already laid out by expert (`torch_grouped_mm`, [rows, 2F]) and that GEMM followed by
  SiLU·mul (`torch_grouped_mm_swiglu`).
- `combine`: moe_gemm_combine on the dispatch's rows (`mkernel_gemm_combine`) against
  torch._grouped_mm alone on the stack's activated rows (`torch_grouped_mm`) and that GEMM
  followed by the weighted index_add_ (`torch_grouped_mm_index_add`).
- `fwd+bwd` (with --backward; no target): mkernel.nn.MoE's forward and autograd backward,
  its default backward on the MoE kernels (`mkernel_moe_layer_fwd_bwd`: dout dispatched
  through w2ᵀ, dh combined through w1ᵀ, wgrad by torch._grouped_mm, with the transposed
  weight copies it makes each time) and its recompute backward
  (`mkernel_moe_layer_fwd_bwd_recompute`), against the same stack's forward and autograd backward
  (`torch_stack_fwd_bwd`: mkernel.nn.moe.moe_local_experts, which is torch alone: the
  stack above with each expert's group padded to 8 rows, since _grouped_mm's wgrad needs
  16-byte aligned groups), gradients of x, the routing weights, w1 and w2 each time.

Checks before any timing, against the torch stack (the graph's replay; where torch cannot
capture the stack, the eager stack, and the graph is reported unavailable): recv_counts equal
the routing's rows per expert; per expert, the sum of the dispatch's activated rows (mkernel
orders rows within an expert by arrival; the sum is order-free); the layer's and the
combine's outputs; with --backward, the gradients of x and the routing weights and the
gradients of w1 and w2 of three experts (the hottest, the median, the coldest). Each is a
relative L2 error at most 2e-2: both sides multiply the same bf16 operands with fp32
accumulation and differ only in where they round (the stack rounds gate_up to bf16 before
SiLU·mul and each expert's output before weighting; mkernel rounds SwiGLU once from fp32),
a few bf16 roundings of 2^-9 each, while a wrong row, expert or weight is an O(1) error.
A reference that is all zeros, or a non-finite value on either side, fails the check; a
case that fails its check is not timed.

TFLOP/s counts the routed rows' math (not the padding): the layer 6·T·k·H·F (gate_up
4·T·k·H·F, down 2·T·k·H·F), forward and backward three times that. The protocol and record
are mkbench's (bench_record); the record's bench is `moe_layer_same_process`, rows keyed by
model, tokens and direction, which benches/targets.py judges (`moe_layer`, and the GEMM
phases in `moe_vs_grouped_mm`). docs/decisions/0078-moe-layer-benchmark.md says why the
routing, the contenders and the targets are these.

Memory: DeepSeek-V3's weights are 22.5 GB (w1 15 GB, w2 7.5 GB), shared by both stacks;
its T = 16384 forward needs about 12 GB more per stack (the graph keeps its intermediates)
and the receive buffer 2.4 GB; --backward adds the weights' gradients (22.5 GB) and the
saved activations, which fit in 80 GB one contender at a time. A contender that runs out of
memory is reported unavailable (null time), not timed.

    PYTHONPATH=<the wheel's site> python3 benches/moe_layer_same_process.py [T ...]
        [--model deepseek-v3,qwen3-235b,mixtral-8x7b] [--zipf 1.0] [--seed 0] [--backward]
        [-w 3] [-n 10] [--blocks 5] [--json PATH]

Needs a CUDA GPU, torch._grouped_mm (torch 2.8 and later) and the mkernel package; without
a GPU it prints SKIPPED and exits 77.
"""
import argparse
import sys

import bench_record

TOLERANCE = 2e-2
# name: (hidden H, ffn F per expert, experts E, top-k)
MODELS = {
    "deepseek-v3": (7168, 2048, 256, 8),
    "qwen3-235b": (4096, 1536, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}
# The layer's FLOPs in units of T·k·H·F, per direction.
FLOP_UNITS = {"layer": 6, "dispatch": 4, "combine": 2, "fwd+bwd": 18}
# Rows of a group that torch._grouped_mm's backward needs (16 bytes of bf16).
WGRAD_ALIGN = 8


def zipf_routing(tokens, experts, topk, exponent=1.0, seed=0):
    """Skewed routing (the module's docstring states the rule): (topk_idx [tokens, topk]
    int32, distinct experts per token; topk_weights [tokens, topk] float32, each row summing
    to 1; popularity [experts] float64, expert e's chance to be a token's first choice).
    On the CPU, from a generator seeded with `seed`."""
    import torch

    if not 1 <= topk <= experts:
        raise ValueError(f"need 1 <= topk <= experts, got topk {topk} and {experts} experts")
    g = torch.Generator().manual_seed(seed)
    by_rank = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** exponent
    popularity = torch.empty(experts, dtype=torch.float64)
    popularity[torch.randperm(experts, generator=g)] = by_rank / by_rank.sum()
    # Gumbel top-k: the k largest of log p + Gumbel noise are k draws without replacement.
    u = torch.rand(tokens, experts, generator=g, dtype=torch.float64).clamp_min(1e-300)
    keys = popularity.log() - (-u.log()).log()
    topk_idx = keys.topk(topk, dim=1).indices.to(torch.int32)
    topk_weights = torch.softmax(torch.randn(tokens, topk, generator=g), dim=1)
    return topk_idx, topk_weights, popularity


def expert_rows(topk_idx, experts):
    """{hottest, median, coldest, empty}: the routing's rows per expert."""
    import torch

    counts = torch.bincount(topk_idx.flatten().long().cpu(), minlength=experts)
    ordered = sorted(counts.tolist())
    return {"hottest": ordered[-1], "median": ordered[len(ordered) // 2], "coldest": ordered[0],
            "empty": int((counts == 0).sum())}


def rel_l2(got, want):
    """||got - want|| / ||want|| in float64; inf when got is non-finite or want is all zeros
    (a check against zeros proves nothing)."""
    g, w = got.double(), want.double()
    norm = float(w.norm())
    if not bool(g.isfinite().all()) or not norm > 0:
        return float("inf")
    return float((g - w).norm()) / norm


def row(model, tokens, zipf, direction, results, errors, notes=None):
    """A record row. `notes[name]`: extra fields of that contender (e.g. graph_calls)."""
    H, F, E, k = MODELS[model]
    shape = {"ranks": 1, "model": model, "tokens": tokens, "experts": E, "hidden": H, "ffn": F, "topk": k,
             "activation": "swiglu", "zipf": zipf, "direction": direction}
    extra = {name: {"rel_err_vs_torch": e} for name, e in errors.items()}
    for name, fields in (notes or {}).items():
        extra.setdefault(name, {}).update(fields)
    return bench_record.row(shape, results, extra)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tokens", nargs="*", type=int, default=[4096, 16384])
    ap.add_argument("--model", default=",".join(MODELS),
                    help=f"comma-separated, any of {', '.join(MODELS)} (default: all)")
    ap.add_argument("--zipf", type=float, default=1.0, help="the popularity law's exponent s (0: uniform)")
    ap.add_argument("--seed", type=int, default=0, help="the routing's seed")
    ap.add_argument("--backward", action="store_true", help="also time forward + backward (no target)")
    bench_record.add_protocol_args(ap)
    args = ap.parse_args(argv)
    args.models = [m for m in args.model.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        ap.error(f"--model: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(MODELS)}")
    if args.iters < 1 or args.blocks < 1 or args.warmup < 0:
        ap.error("need -n >= 1, --blocks >= 1 and -w >= 0")
    if not args.tokens or min(args.tokens) < 1:
        ap.error("tokens: each T must be positive")
    if not args.zipf >= 0:
        ap.error("--zipf: the exponent is non-negative")
    return args


def workspace_bytes(models, tokens):
    """The communicator's workspace: the dispatch's receive buffer (at most T·k rows plus each
    expert's padding to 128, of H bf16) for the largest case, and 1 MiB for the rest."""
    most = 0
    for m in models:
        H, _, E, k = MODELS[m]
        most = max(most, (max(tokens) * k + E * 128) * H * 2)
    return max(256 << 20, most + (1 << 20))


class Case:
    """One model shape and T: the inputs on the GPU and the torch stack's building blocks."""

    def __init__(self, torch, layer, shape, T, zipf, seed):
        """layer: holds w1 [E, 2F, H] and w2 [E, H, F] (an nn.MoE); shape: (H, F, E, k)."""
        H, F, E, k = shape
        dev = layer.w1.device
        self.torch, self.layer, self.T, self.H, self.F, self.E, self.k = torch, layer, T, H, F, E, k
        idx, weights, _ = zipf_routing(T, E, k, zipf, seed)
        self.rows = expert_rows(idx, E)
        self.idx, self.weights = idx.to(dev), weights.to(dev)
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.x = torch.rand(T, H, device=dev, dtype=torch.bfloat16, generator=gen) * 2 - 1
        self.dout = torch.rand(T, H, device=dev, dtype=torch.bfloat16, generator=gen) * 2 - 1
        self.w1t, self.w2t = layer.w1.detach().transpose(1, 2), layer.w2.detach().transpose(1, 2)
        self.expert_ids = torch.arange(E, device=dev, dtype=torch.int32)
        # The stack's layout, outside any timing: the pairs sorted by expert.
        self.order, self.offs = self.sort(self.idx)
        self.token = self.order // k
        self.counts = torch.diff(self.offs.long(), prepend=self.offs.new_zeros(1).long())

    def sort(self, idx):
        """(order of the (token, choice) pairs sorted by expert, stably; offs [E] int32, the
        cumulative rows per expert as torch._grouped_mm takes them). No host synchronisation."""
        flat = idx.reshape(-1)
        order = self.torch.argsort(flat, stable=True)
        offs = self.torch.searchsorted(flat[order], self.expert_ids, right=True, out_int32=True)
        return order, offs

    def gate_up(self, rows, offs):
        return self.torch._grouped_mm(rows, self.w1t, offs=offs)

    def swiglu(self, h):
        gate, up = h.chunk(2, dim=-1)
        return self.torch.nn.functional.silu(gate) * up

    def down(self, act, offs):
        return self.torch._grouped_mm(act, self.w2t, offs=offs)

    def weighted_sum(self, z, order, token):
        torch = self.torch
        out = torch.zeros(self.T, self.H, device=z.device, dtype=torch.float32)
        out.index_add_(0, token, z.float() * self.weights.reshape(-1)[order, None])
        return out.to(torch.bfloat16)

    def stack(self, x, idx):
        """The torch stack, whole: sort, gather, gate_up, SiLU·mul, down, weighted index_add_."""
        order, offs = self.sort(idx)
        token = order // self.k
        return self.weighted_sum(self.down(self.swiglu(self.gate_up(x[token], offs)), offs), order, token)


def capture(torch, fn):
    """(a CUDA graph of fn() on static inputs, its output): warmed up on a side stream first,
    as torch.cuda.graphs asks, so that cuBLAS's workspace and the allocator's pools exist."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def dispatch_error(torch, case, d, act_ref):
    """The dispatch's check: per expert, the sum of mkernel's activated rows against the
    stack's (mkernel orders an expert's rows by arrival, the stack by token)."""
    counts = case.counts.tolist()
    if d.recv_counts[:-1].long().tolist() != counts:
        return float("inf")
    padded = [(c + 127) // 128 * 128 for c in counts]
    mk, ref, start, ref_start = [], [], 0, 0
    for c, p in zip(counts, padded):
        mk.append(d.y[start:start + c].double().sum(0))
        ref.append(act_ref[ref_start:ref_start + c].double().sum(0))
        start, ref_start = start + p, ref_start + c
    return rel_l2(torch.stack(mk), torch.stack(ref))


def run_case(torch, mkernel, args, comm, layer, model, T, rows):
    """Checks and times one model shape at T tokens; appends its rows; returns whether every
    check passed."""
    case = Case(torch, layer, MODELS[model], T, args.zipf, args.seed)
    H, F, E, k = MODELS[model]
    r = case.rows
    print(f"# {model} T={T}: rows per expert hottest {r['hottest']}, median {r['median']}, coldest {r['coldest']}, "
          f"{r['empty']} empty (of {E})")
    units = T * k * H * F
    ok = True

    def timed(direction, calls, errors, notes=None, refused=()):
        """Times `calls` interleaved and records the row; `refused` contenders get a null time."""
        results = bench_record.interleaved(calls, args.warmup, args.blocks, args.iters)
        results.update({name: None for name in refused})
        bench_record.print_timed(f"{model:>12} {T:>6} {direction:>8}", results, FLOP_UNITS[direction] * units,
                                 {name: f"{e:.2e}" for name, e in errors.items()})
        out = row(model, T, args.zipf, direction, results, errors, notes)
        out["expert_rows"] = case.rows
        rows.append(out)

    def checked(errors):
        bad = {name: e for name, e in errors.items() if not e <= TOLERANCE}
        for name, e in bad.items():
            print(f"  {model} T={T}: {name} disagrees with the torch stack (rel err {e:.2e} > {TOLERANCE}): not timed")
        return not bad

    # --- layer: nn.MoE's forward against the stack in one CUDA graph, and called eagerly.
    x, idx, weights = case.x, case.idx, case.weights
    with torch.no_grad():
        def mk_layer():
            return layer(x, idx, weights)

        def torch_stack():
            return case.stack(x, idx)

        try:
            graph, reference = capture(torch, torch_stack)
            graph.replay()
            refused = ()
        except Exception as e:  # noqa: BLE001 -- a stack torch cannot capture: timed eagerly only
            print(f"  torch_stack_graph: unavailable: {type(e).__name__}: {e}")
            graph, reference, refused = None, torch_stack(), ("torch_stack_graph",)
        errors = {"mkernel_moe_layer": rel_l2(mk_layer(), reference), "torch_stack": rel_l2(torch_stack(), reference)}
        if checked(errors):
            calls = {"mkernel_moe_layer": mk_layer, "torch_stack": torch_stack}
            if graph is not None:
                calls["torch_stack_graph"] = graph.replay
            timed("layer", calls, errors, {"torch_stack_graph": {"graph_calls": 1}} if graph else None, refused)
        else:
            ok = False
        del graph, reference

        # --- the GEMM phases against torch._grouped_mm alone on the stack's laid-out rows.
        capacity = mkernel.nn.moe.receive_capacity(T, k, E, 1)
        x_sorted = x[case.token]
        h_ref = case.gate_up(x_sorted, case.offs)
        act_ref = case.swiglu(h_ref)
        del h_ref

        def mk_dispatch():
            return mkernel.moe_dispatch_gemm(x, idx, layer.w1, comm, capacity, activation="silu")

        d = mk_dispatch()
        errors = {"mkernel_dispatch_gemm": dispatch_error(torch, case, d, act_ref)}
        if checked(errors):
            timed("dispatch", {"mkernel_dispatch_gemm": mk_dispatch,
                               "torch_grouped_mm": lambda: case.gate_up(x_sorted, case.offs),
                               "torch_grouped_mm_swiglu": lambda: case.swiglu(case.gate_up(x_sorted, case.offs))},
                  errors)
        else:
            ok = False
        del x_sorted

        def mk_combine():
            return mkernel.moe_gemm_combine(d.y, layer.w2, weights, d.layout, comm)

        def torch_combine():
            return case.weighted_sum(case.down(act_ref, case.offs), case.order, case.token)

        errors = {"mkernel_gemm_combine": rel_l2(mk_combine(), torch_combine())}
        if checked(errors):
            timed("combine", {"mkernel_gemm_combine": mk_combine,
                              "torch_grouped_mm": lambda: case.down(act_ref, case.offs),
                              "torch_grouped_mm_index_add": torch_combine}, errors)
        else:
            ok = False
        del d, act_ref
    torch.cuda.empty_cache()

    if args.backward:
        ok &= run_backward(torch, mkernel, case, timed, checked)
    return ok


def run_backward(torch, mkernel, case, timed, checked):
    """fwd+bwd: nn.MoE's autograd against the stack's (moe_local_experts), gradients of x,
    the routing weights, w1 and w2. The check compares w1's and w2's gradients on three
    experts only: two full sets of DeepSeek-V3's weight gradients (45 GB) and the weights
    would not fit in 80 GB beside the saved activations."""
    layer, moe = case.layer, mkernel.nn.moe
    act = moe.ACTIVATIONS["swiglu"][1]
    x = case.x.detach().requires_grad_(True)
    weights = case.weights.detach().requires_grad_(True)
    params = (x, weights, layer.w1, layer.w2)

    def mk_fwd_bwd():
        return torch.autograd.grad(layer(x, case.idx, weights), params, case.dout)

    def mk_fwd_bwd_recompute():
        kept, layer.settings.backward = layer.settings.backward, "recompute"
        try:
            return mk_fwd_bwd()
        finally:
            layer.settings.backward = kept

    def torch_fwd_bwd():
        out = moe.moe_local_experts(x, case.idx, weights, layer.w1, layer.w2, act, 0).to(torch.bfloat16)
        return torch.autograd.grad(out, params, case.dout)

    counts = case.counts.tolist()
    ordered = sorted(range(case.E), key=lambda e: counts[e])
    experts = sorted({ordered[-1], ordered[len(ordered) // 2], ordered[0]})

    def compared(grads):
        """dx and dweights whole, dw1 and dw2 on the three experts (copies)."""
        dx, dweights, dw1, dw2 = grads
        return {"dx": dx.clone(), "dweights": dweights.clone(), "dw1": dw1[experts], "dw2": dw2[experts]}

    mine = {"mkernel_moe_layer_fwd_bwd": mk_fwd_bwd, "mkernel_moe_layer_fwd_bwd_recompute": mk_fwd_bwd_recompute}
    refused, errors = [], {}
    try:
        ref = compared(torch_fwd_bwd())
        for name, fn in mine.items():
            got = compared(fn())
            each = {what: rel_l2(got[what], ref[what]) for what in ref}
            errors[name] = max(each.values())
            print(f"  fwd+bwd check, {name}: " + ", ".join(f"{what} {e:.2e}" for what, e in each.items()))
            del got
        del ref
    except torch.OutOfMemoryError as e:
        print(f"  fwd+bwd: not checked, out of memory: {e}")
        refused = [*mine, "torch_stack_fwd_bwd"]
    torch.cuda.empty_cache()
    if refused:
        timed("fwd+bwd", {}, errors, refused=refused)
        return True
    if not checked(errors):
        return False
    timed("fwd+bwd", {**mine, "torch_stack_fwd_bwd": torch_fwd_bwd}, errors)
    torch.cuda.empty_cache()
    return True


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("SKIPPED: no CUDA GPU")
        return 77
    import mkernel

    comm = mkernel.Communicator(unique_id=mkernel.get_unique_id(), rank=0, world_size=1, device=0,
                                workspace_bytes=workspace_bytes(args.models, args.tokens))
    print(f"# torch {torch.__version__}, mkernel {mkernel.__version__}: the SwiGLU MoE layer at one rank, bf16, "
          f"routing Zipf s={args.zipf} seed {args.seed}; warm-up {args.warmup} then {args.blocks} interleaved blocks "
          f"of {args.iters} calls")
    print(f"# {'model':>12} {'T':>6} {'dir':>8} | {'contender':>28} {'ms':>8} {'TF/s':>7} {'p10 ms':>8} {'p90 ms':>8} "
          f"{'host us':>8} {'rel err':>8}  (rel err: against the torch stack)")
    rows, ok = [], True
    for model in args.models:
        H, F, E, k = MODELS[model]
        torch.manual_seed(args.seed)  # nn.MoE's initialisation
        layer = mkernel.nn.MoE(comm, E, H, F, activation="swiglu", device="cuda", dtype=torch.bfloat16)
        for T in args.tokens:
            ok &= run_case(torch, mkernel, args, comm, layer, model, T, rows)
        del layer
        torch.cuda.empty_cache()
    comm.close()
    if args.json:
        config = {**bench_record.protocol_config(args),
                  "routing": f"Zipf popularity 1/r^{args.zipf} over a seeded permutation of the experts, k distinct "
                             f"per token (Gumbel top-k), weights softmax of N(0,1) logits; seed {args.seed}",
                  "flops": "layer 6·T·k·H·F (dispatch 4, combine 2), fwd+bwd 18·T·k·H·F; routed rows, not padding",
                  "check": f"against the torch stack, relative L2 <= {TOLERANCE}: per-expert sums of the dispatch's "
                           "rows, the combine's and the layer's output; fwd+bwd: dx, dweights, dw1 and dw2 of three "
                           "experts",
                  "torch_stack": "sort by expert, gather, torch._grouped_mm (gate_up), SiLU·mul, torch._grouped_mm "
                                 "(down), weighted index_add_ in fp32; _graph: captured in one CUDA graph",
                  "torch": torch.__version__}
        bench_record.write(args.json, "moe_layer_same_process", ok, config, rows)
    print("OK" if ok else "FAILED: mkernel disagrees with the torch stack beyond the tolerance (see rel err)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
