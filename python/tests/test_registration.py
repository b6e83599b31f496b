"""How the torch.ops.mkernel ops are registered: their schemas and tags, torch's own
consistency checks of a custom op (torch.library.opcheck: schema, autograd registration,
fake against real), the autograd node of an op without a gradient formula, and the
public functions' path to the ops. CPU tensors; the kernel launches are replaced by CPU
stand-ins that fill the outputs."""

from __future__ import annotations

import ctypes

import pytest
import torch
from torch.autograd import forward_ad
from torch.utils._python_dispatch import TorchDispatchMode

import mkernel
from mkernel import ops

bf16 = torch.bfloat16

# The schemas as documented in docs/python.md; a compiled graph or a caller of torch.ops.mkernel.* relies on them.
SCHEMAS = {
    "all_gather": "mkernel::all_gather(Tensor x, str comm, SymInt world_size) -> Tensor",
    "reduce_scatter": "mkernel::reduce_scatter(Tensor x, str comm, SymInt world_size, str op) -> Tensor",
    "all_reduce": "mkernel::all_reduce(Tensor x, str comm, str op) -> Tensor",
    "gemm": "mkernel::gemm(Tensor a, Tensor b) -> Tensor",
    "scaled_gemm": "mkernel::scaled_gemm(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, ScalarType out_dtype) "
    "-> Tensor",
    "all_gather_gemm": "mkernel::all_gather_gemm(Tensor a, Tensor b, str comm, SymInt world_size, "
    "bool return_gathered) -> (Tensor, Tensor)",
    "gemm_reduce_scatter": "mkernel::gemm_reduce_scatter(Tensor a, Tensor b, str comm, SymInt world_size) -> Tensor",
    "gemm_all_reduce": "mkernel::gemm_all_reduce(Tensor a, Tensor b, str comm) -> Tensor",
    "scaled_gemm_reduce_scatter": "mkernel::scaled_gemm_reduce_scatter(Tensor a, Tensor b, Tensor scale_a, "
    "Tensor scale_b, ScalarType out_dtype, str comm, SymInt world_size) -> Tensor",
    "scaled_gemm_all_reduce": "mkernel::scaled_gemm_all_reduce(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, "
    "ScalarType out_dtype, str comm) -> Tensor",
    "moe_dispatch_gemm": "mkernel::moe_dispatch_gemm(Tensor x, Tensor topk_idx, Tensor w1, str comm, "
    "SymInt world_size, SymInt recv_capacity) -> (Tensor, Tensor, Tensor)",
    "moe_dispatch_gemm_with_options": "mkernel::moe_dispatch_gemm_with_options(Tensor x, Tensor topk_idx, "
    "Tensor w1, str comm, SymInt world_size, SymInt recv_capacity, str activation, int expert_capacity) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
    "moe_gemm_combine": "mkernel::moe_gemm_combine(Tensor y_act, Tensor w2, Tensor topk_weights, Tensor layout, "
    "str comm, SymInt world_size) -> Tensor",
    "ring_attention": "mkernel::ring_attention(Tensor q, Tensor k, Tensor v, str comm, float softmax_scale, "
    "bool causal) -> (Tensor, Tensor)",
    "ring_attention_backward": "mkernel::ring_attention_backward(Tensor q, Tensor k, Tensor v, Tensor out, "
    "Tensor dout, Tensor lse, str comm, float softmax_scale, bool causal) -> (Tensor, Tensor, Tensor)",
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_and_tags(name):
    op = getattr(torch.ops.mkernel, name).default
    assert str(op._schema) == SCHEMAS[name]
    assert torch.Tag.pt2_compliant_tag in op.tags


def _random(*shape, dtype=bf16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture
def cpu_launches(monkeypatch):
    """Replaces the launches with CPU stand-ins: outputs filled from the inputs, as if every rank held this rank's."""

    def all_reduce(x, out, op, comm):
        out.copy_(x * comm.world_size)

    def all_gather_gemm(a, b, out, gathered, comm):
        rows = a.repeat(comm.world_size, 1)
        out.copy_(rows.float() @ b.float().t())
        if gathered is not None:
            gathered.copy_(rows)

    def moe_dispatch(x, topk_idx, w1, y, recv_counts, layout, experts, comm):
        y.copy_(torch.arange(y.numel(), dtype=torch.float32).reshape(y.shape) % 7)
        recv_counts.fill_(3)
        layout.fill_(1)

    def moe_dispatch_options(x, topk_idx, w1, y, recv_counts, drop_counts, layout, experts, activation, capacity, comm):
        moe_dispatch(x, topk_idx, w1, y, recv_counts, layout, experts, comm)
        drop_counts.fill_(capacity % 5)

    def ring_attention(q, k, v, out, lse, softmax_scale, causal, comm):
        out.copy_(q * softmax_scale)
        lse.fill_(0.5)

    def scaled_gemm(a, b, scale_a, scale_b, out, mode):
        if mode == "block":  # scale_a [K/128, M], scale_b [K/128, ceil(N/128)]: each to its elements
            sa_full = scale_a.t().repeat_interleave(128, 1)
            sb_full = scale_b.t().repeat_interleave(128, 0)[: b.shape[0]].repeat_interleave(128, 1)
            out.copy_((a.float() * sa_full) @ (b.float() * sb_full).t())
            return
        rowwise = mode == "rowwise"
        sa, sb = (scale_a.reshape(-1, 1), scale_b.reshape(-1, 1)) if rowwise else (scale_a.reshape(()), scale_b.reshape(()))
        out.copy_((a.float() * sa) @ (b.float() * sb).t())

    def scaled_gemm_reduce_scatter(a, b, scale_a, scale_b, out, mode, comm):
        # Every rank's partial is this rank's: the sum is world_size times it, this rank's rows.
        full = torch.empty(a.shape[0], b.shape[0], dtype=out.dtype)
        scaled_gemm(a, b, scale_a, scale_b, full, mode)
        out.copy_(full[comm.rank * out.shape[0] : (comm.rank + 1) * out.shape[0]].float() * comm.world_size)

    def scaled_gemm_all_reduce(a, b, scale_a, scale_b, out, mode, comm):
        scaled_gemm(a, b, scale_a, scale_b, out, mode)
        out.mul_(comm.world_size)

    monkeypatch.setattr(ops, "all_reduce_launch", all_reduce)
    monkeypatch.setattr(ops, "scaled_gemm_launch", scaled_gemm)
    monkeypatch.setattr(ops, "scaled_gemm_reduce_scatter_launch", scaled_gemm_reduce_scatter)
    monkeypatch.setattr(ops, "scaled_gemm_all_reduce_launch", scaled_gemm_all_reduce)
    monkeypatch.setattr(ops, "all_gather_gemm_launch", all_gather_gemm)
    monkeypatch.setattr(ops, "moe_dispatch_launch", moe_dispatch)
    monkeypatch.setattr(ops, "moe_dispatch_options_launch", moe_dispatch_options)
    monkeypatch.setattr(ops, "ring_attention_launch", ring_attention)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(shape_comm, cpu_launches, requires_grad):
    """torch's checks of a custom op: its schema against what it does, an autograd kernel for
    inputs that require grad, the fake's outputs against the real ones, and AOTAutograd's
    trace with symbolic sizes against eager (without grad: with it, the backward of an op
    without a gradient formula raises, as it should)."""
    name = shape_comm(2).name

    def r(*shape, seed=0):
        return _random(*shape, seed=seed).requires_grad_(requires_grad)

    def e4m3(*shape, seed=0):  # fp8 tensors cannot require grad
        return _random(*shape, dtype=torch.float32, seed=seed).to(torch.float8_e4m3fn)

    def e5m2(*shape, seed=0):  # a's other type: the gradient of an fp8 backward
        return _random(*shape, dtype=torch.float32, seed=seed).to(torch.float8_e5m2)

    def scales(*shape, seed=0):
        return torch.rand(shape, generator=torch.Generator().manual_seed(seed)).requires_grad_(requires_grad)

    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    if not requires_grad:
        utils += ("test_aot_dispatch_dynamic",)
    cases = [
        (torch.ops.mkernel.all_reduce.default, (r(6, 4), name, "sum")),
        (torch.ops.mkernel.all_gather_gemm.default, (r(4, 16), r(8, 16, seed=1), name, 2, True)),
        (
            torch.ops.mkernel.moe_dispatch_gemm.default,
            (r(5, 128), torch.tensor([[0, 1]] * 5, dtype=torch.int32), r(1, 128, 128), name, 2, 256),
        ),
        (
            torch.ops.mkernel.moe_dispatch_gemm_with_options.default,
            (r(5, 128), torch.tensor([[0, 1]] * 5, dtype=torch.int32), r(1, 256, 128), name, 2, 256, "silu", 3),
        ),
        (
            torch.ops.mkernel.moe_dispatch_gemm_with_options.default,
            (r(5, 128), torch.tensor([[0, -1]] * 5, dtype=torch.int32), r(1, 128, 128), name, 2, 128, "none", 0),
        ),
        (
            torch.ops.mkernel.ring_attention.default,
            (r(1, 8, 4, 64), r(1, 8, 2, 64, seed=1), r(1, 8, 2, 64, seed=2), name, 0.125, True),
        ),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=utils)
    # scaled_gemm per tensor, rowwise and block, a in e4m3 and in e5m2. Without test_schema: its SchemaCheckMode
    # compares every input before and after the call with arithmetic CPU torch does not
    # implement for float8 ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn').
    fp8_cases = [
        (e4m3(4, 32), e4m3(8, 32, seed=1), scales(4, 1), scales(1, 8, seed=1), bf16),
        (e4m3(4, 32), e4m3(8, 32, seed=1), scales(), scales(seed=1), torch.float16),
        (e4m3(4, 256), e4m3(130, 256, seed=1), scales(2, 4), scales(2, 2, seed=1), bf16),
        (e5m2(4, 32), e4m3(8, 32, seed=1), scales(4, 1), scales(1, 8, seed=1), bf16),
        (e5m2(4, 32), e4m3(8, 32, seed=1), scales(), scales(seed=1), torch.float16),
        (e5m2(4, 256), e4m3(130, 256, seed=1), scales(2, 4), scales(2, 2, seed=1), bf16),
    ]
    for args in fp8_cases:
        torch.library.opcheck(torch.ops.mkernel.scaled_gemm.default, args, test_utils=utils[1:])
    # The scaled GEMM + reductions (e4m3 a and b only), per tensor, rowwise and block, at two ranks.
    reduce_cases = [
        (e4m3(8, 32), e4m3(8, 32, seed=1), scales(8, 1), scales(1, 8, seed=1), bf16),
        (e4m3(4, 32), e4m3(16, 32, seed=1), scales(), scales(seed=1), torch.float16),
        (e4m3(4, 256), e4m3(136, 256, seed=1), scales(2, 4), scales(2, 2, seed=1), bf16),
    ]
    for args in reduce_cases:
        torch.library.opcheck(torch.ops.mkernel.scaled_gemm_reduce_scatter.default, (*args, name, 2), test_utils=utils[1:])
        torch.library.opcheck(torch.ops.mkernel.scaled_gemm_all_reduce.default, (*args, name), test_utils=utils[1:])


def test_backward_through_an_op_without_a_formula_raises(shape_comm, cpu_launches):
    name = shape_comm(2).name
    x = _random(6, 4, dtype=torch.float32).requires_grad_()
    y = torch.ops.mkernel.all_reduce(x, name, "sum")
    assert y.requires_grad
    torch.testing.assert_close(y, x.detach() * 2, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"mkernel\.all_reduce has no gradient formula"):
        y.sum().backward()
    # Without grad the output is a plain tensor.
    with torch.no_grad():
        assert not torch.ops.mkernel.all_reduce(x, name, "sum").requires_grad


def test_integer_outputs_need_no_gradient(shape_comm, cpu_launches):
    name = shape_comm(2).name
    x = _random(5, 128).requires_grad_()
    idx = torch.tensor([[0, 1]] * 5, dtype=torch.int32)
    y, counts, layout = torch.ops.mkernel.moe_dispatch_gemm(x, idx, _random(1, 128, 128), name, 2, 256)
    assert y.requires_grad and not counts.requires_grad and not layout.requires_grad


def test_ring_attention_keeps_its_gradient_formula(shape_comm, cpu_launches, monkeypatch):
    """The forward records the backward op with what the forward saved."""
    name = shape_comm(2).name
    seen = {}

    def backward_launch(q, k, v, out, dout, lse, dq, dk, dv, softmax_scale, causal, comm):
        seen.update(dout=dout.clone(), lse=lse.clone(), causal=causal, scale=softmax_scale)
        dq.copy_(dout * 2)
        dk.fill_(1.0)
        dv.fill_(-1.0)

    monkeypatch.setattr(ops, "ring_attention_backward_launch", backward_launch)
    q, k, v = (_random(1, 8, h, 64, seed=s).requires_grad_() for s, h in ((0, 4), (1, 2), (2, 2)))
    out, lse = torch.ops.mkernel.ring_attention(q, k, v, name, 0.125, True)
    dout = _random(*out.shape, seed=3)
    out.backward(dout)
    torch.testing.assert_close(q.grad, dout * 2, rtol=0, atol=0)
    assert torch.equal(k.grad, torch.ones_like(k)) and torch.equal(v.grad, -torch.ones_like(v))
    assert seen["causal"] is True and seen["scale"] == 0.125 and torch.equal(seen["lse"], torch.full_like(lse, 0.5))


def test_ring_attention_lse_is_a_constant(shape_comm, cpu_launches):
    """lse carries no gradient and says so: requires_grad is False, so a loss of lse alone
    cannot be differentiated (rather than giving q, k, v a silent zero)."""
    name = shape_comm(2).name
    q, k, v = (_random(1, 8, h, 64, seed=s).requires_grad_() for s, h in ((0, 4), (1, 2), (2, 2)))
    for out, lse in (
        torch.ops.mkernel.ring_attention(q, k, v, name, 0.125, True),
        mkernel.ring_attention(q, k, v, name, causal=True),
    ):
        assert out.requires_grad and not lse.requires_grad
        with pytest.raises(RuntimeError, match="does not require grad"):
            lse.sum().backward()


def test_forward_mode_ad_is_refused(shape_comm, cpu_launches):
    """A tangent would be dropped below the autograd keys (a zero output tangent): refused,
    through the op and the public function alike; plain inputs inside a dual level run."""
    name = shape_comm(2).name
    x = _random(6, 4, dtype=torch.float32)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(x, torch.ones_like(x))
        for call in (lambda t: torch.ops.mkernel.all_reduce(t, name, "sum"), lambda t: mkernel.all_reduce(t, name)):
            with pytest.raises(RuntimeError, match=r"mkernel\.all_reduce has no forward-mode derivative"):
                call(dual)
            torch.testing.assert_close(call(x), x * 2, rtol=0, atol=0)
        q, k, v = (_random(1, 8, h, 64, seed=s) for s, h in ((0, 4), (1, 2), (2, 2)))
        with pytest.raises(RuntimeError, match=r"mkernel\.ring_attention has no forward-mode derivative"):
            mkernel.ring_attention(forward_ad.make_dual(q, torch.ones_like(q)), k, v, name, causal=True)


class OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.filterwarnings("ignore:Warning. Profiler clears events")
def test_public_functions_call_the_op_without_grad(shape_comm, cpu_launches):
    """Without grad the public functions skip the op's autograd kernel (mkernel.ops.dispatch), and
    dispatch modes and the profiler still see the op."""
    name = shape_comm(2).name
    x = _random(6, 4, dtype=torch.float32)
    with OpRecorder() as recorder:
        y = mkernel.all_reduce(x, name)
    assert recorder.ops == ["mkernel.all_reduce.default"]
    torch.testing.assert_close(y, x * 2, rtol=0, atol=0)
    assert not y.requires_grad
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        mkernel.all_reduce(x, name)
    assert "mkernel::all_reduce" in {e.name for e in prof.events()}


def test_public_functions_keep_the_autograd_node(shape_comm, cpu_launches):
    name = shape_comm(2).name
    x = _random(6, 4, dtype=torch.float32).requires_grad_()
    y = mkernel.all_reduce(x, name)
    assert y.requires_grad
    with pytest.raises(RuntimeError, match=r"mkernel\.all_reduce has no gradient formula"):
        y.sum().backward()
    with torch.no_grad():
        assert not mkernel.all_reduce(x, name).requires_grad
    # A differentiable op records its backward through the public function too.
    q, k, v = (_random(1, 8, h, 64, seed=s).requires_grad_() for s, h in ((0, 4), (1, 2), (2, 2)))
    out, _lse = mkernel.ring_attention(q, k, v, name, causal=True)
    assert out.grad_fn is not None


def test_moe_options_carry_the_activation_and_the_drop_rule(shape_comm, monkeypatch):
    """The public function picks the op from its options and the options struct from the
    library's initializer: plain calls keep mkMoeDispatchGemm, gated and drop calls go
    through mkMoeDispatchGemmWithOptions with the codes of include/mkernel.h."""
    from mkernel import _lib

    base = ops.moe_options("none", 0)
    init = _lib.mkMoeOptions_t()
    assert _lib.library().mkMoeOptionsInit(ctypes.byref(init)) == _lib.SUCCESS
    assert bytes(base) == bytes(init) and init.size == ctypes.sizeof(_lib.mkMoeOptions_t)
    silu = ops.moe_options("silu", 0)
    assert (silu.activation, silu.capacityPolicy, silu.expertCapacity) == (1, _lib.MOE_NO_DROP, 0)
    drop = ops.moe_options("gelu", 96)
    assert (drop.activation, drop.capacityPolicy, drop.expertCapacity) == (2, _lib.MOE_DROP, 96)
    assert (drop.size, drop.magic, drop.version, drop.reserved) == (init.size, init.magic, init.version, 0)

    seen = []
    monkeypatch.setattr(ops, "moe_dispatch_launch", lambda *a: seen.append(("plain",)))
    monkeypatch.setattr(
        ops, "moe_dispatch_options_launch", lambda *a: seen.append(("options", a[-3], a[-2]))
    )
    name = shape_comm(2).name
    x, idx = _random(5, 128), torch.tensor([[0, 1]] * 5, dtype=torch.int32)
    plain = mkernel.moe_dispatch_gemm(x, idx, _random(1, 128, 128), name, 256)
    gated = mkernel.moe_dispatch_gemm(x, idx, _random(1, 256, 128), name, 256, activation="silu")
    dropping = mkernel.moe_dispatch_gemm(x, idx, _random(1, 256, 128), name, 256, activation="gelu", expert_capacity=9)
    assert seen == [("plain",), ("options", "silu", 0), ("options", "gelu", 9)]
    assert type(plain) is mkernel.MoeDispatch and type(gated) is mkernel.MoeDispatch
    assert type(dropping) is mkernel.MoeDropDispatch and tuple(dropping.drop_counts.shape) == (2,)
    y, counts, layout = gated  # a gated call unpacks as a plain one
    assert tuple(y.shape) == (256, 128) and dropping.y.shape == y.shape


def test_moe_overflow_is_an_outcome_that_names_the_needed_capacity():
    """recv_counts[-1] > recv_capacity: raise_for_overflow raises MkMoeOverflowError with
    the needed capacity (no communicator state is involved); a fitting call raises nothing."""
    y = torch.empty(256, 128, dtype=bf16)
    layout = torch.empty(16, dtype=torch.uint8)
    fits = mkernel.MoeDispatch(y, torch.tensor([100, 20, 256], dtype=torch.int32), layout)
    fits.raise_for_overflow()
    assert int(fits.needed_capacity) == 256
    over = mkernel.MoeDropDispatch(y, torch.tensor([300, 20, 512], dtype=torch.int32), layout, torch.zeros(4))
    with pytest.raises(mkernel.MkMoeOverflowError, match=r"need recv_capacity >= 512, but the call had 256") as info:
        over.raise_for_overflow()
    assert (info.value.needed_capacity, info.value.recv_capacity) == (512, 256)
    assert isinstance(info.value, mkernel.MkError) and not isinstance(info.value, mkernel.MkInvalidUsageError)
    with pytest.raises(mkernel.MkMoeOverflowError, match=r"call again with recv_capacity=384"):
        mkernel.moe_raise_for_overflow(torch.tensor([0, 384], dtype=torch.int32), 128)
