"""mkernel.megatron against the real megatron-core (CPU): the spec's construction, checkpoints
interchanging with Megatron's local spec, the process-group-to-communicator wiring, the
argument checks, CP sharding against mkernel's zigzag layout, and the MoE layer's
routing conversion and unfused recomputation against Megatron's own experts.

The ranks are CPU processes over gloo. The communicators are made by a stand-in factory
(mkernel.Communicator needs a GPU); everything Megatron builds is Megatron's. What needs
the GPU (the fused ops' numerics, training) is in the GPU proof (docs/megatron.md).
"""

from __future__ import annotations

import multiprocessing
import os
import re
import socket
import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import pytest
import torch

if os.environ.get("MK_TEST_MEGATRON") == "required":  # scripts/test-python.sh installs it: never skip there
    import megatron.core  # noqa: F401
else:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (scripts/test-python.sh installs it)")

import torch.distributed as dist  # noqa: E402

from mkernel.errors import MkInvalidArgumentError, MkInvalidUsageError  # noqa: E402

warnings.filterwarnings("ignore", message="Apex is not installed")

REPO = Path(__file__).resolve().parents[2]


class StandInCommunicator:
    """What the layers read of a communicator (name, rank, world_size) and close(); made over a real group."""

    def __init__(self, group, name):
        self.group, self.name = group, name
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.closed = False

    def close(self):
        self.closed = True


class RecordingFactory:
    def __init__(self):
        self.made = []

    def __call__(self, group, *, name):
        comm = StandInCommunicator(group, name)
        self.made.append(comm)
        return comm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, body, results):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        warnings.filterwarnings("ignore")
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            results.put((rank, body(rank, world_size)))
        finally:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 -- reported to the test in the parent
        results.put((rank, "FAILED\n" + traceback.format_exc()))


def run_ranks(world_size: int, body, timeout: float = 180.0):
    """Runs body(rank, world_size) in world_size spawned processes over gloo; returns results by rank."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, body, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in range(world_size):
            rank, value = results.get(timeout=timeout)
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank, value in out.items():
        if isinstance(value, str) and value.startswith("FAILED"):
            pytest.fail(f"rank {rank}: {value}")
    return out


def config(**overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=2,
        hidden_size=256,
        num_attention_heads=4,
        ffn_hidden_size=512,
        use_cpu_initialization=True,
        params_dtype=torch.bfloat16,
        bf16=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        add_bias_linear=True,
    )
    base.update(overrides)
    return TransformerConfig(**base)


def moe_config(**overrides):
    base = dict(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=256,
        add_bias_linear=False,
        # Megatron's alltoall dispatcher makes a CUDA stream when built; the allgather one builds on a CPU.
        moe_token_dispatcher_type="allgather",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
    )
    base.update(overrides)
    return config(**base)


def build_layers(cfg, comms, **spec_args):
    """One TransformerLayer from Megatron's local spec and one from the mkernel spec, same config."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    from mkernel.megatron import get_gpt_layer_mkernel_spec

    local = build_module(get_gpt_layer_local_spec(**spec_args), config=cfg, layer_number=1)
    fused = build_module(get_gpt_layer_mkernel_spec(comms, **spec_args), config=cfg, layer_number=1)
    return local, fused


def build_mkernel_layer(cfg, comms, **spec_args):
    from megatron.core.transformer.spec_utils import build_module

    from mkernel.megatron import get_gpt_layer_mkernel_spec

    return build_module(get_gpt_layer_mkernel_spec(comms, **spec_args), config=cfg, layer_number=1)


def assert_checkpoints_interchange(a: torch.nn.Module, b: torch.nn.Module):
    """a's state dict loads into b strictly and b then holds exactly a's tensors (keys, shapes, values)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for key in sa:
        if isinstance(sa[key], torch.Tensor):
            assert sa[key].shape == sb[key].shape, key
            assert sa[key].dtype == sb[key].dtype, key
    # Different values before loading, so the comparison after it can fail.
    assert any(
        isinstance(sa[k], torch.Tensor) and sa[k].numel() > 1 and not torch.equal(sa[k], sb[k]) for k in sa
    )
    b.load_state_dict(sa, strict=True)
    sb = b.state_dict()
    for key in sa:
        if isinstance(sa[key], torch.Tensor):
            assert torch.equal(sa[key], sb[key]), key


# --- one process --------------------------------------------------------------------------------


@pytest.fixture
def megatron_world():
    """parallel_state initialised over a one-rank gloo group (TP = CP = EP = 1)."""
    from megatron.core import parallel_state

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    yield parallel_state
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_import_mkernel_does_not_import_megatron():
    code = "import sys, mkernel; assert not any(m.startswith('megatron') for m in sys.modules), 'megatron imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO / "python")


def test_the_spec_swaps_only_the_parallel_modules(megatron_world):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from mkernel.megatron import (
        Communicators,
        MkernelColumnParallelLinear,
        MkernelRingAttention,
        MkernelRowParallelLinear,
    )

    factory = RecordingFactory()
    comms = Communicators(factory=factory)
    local, fused = build_layers(config(), comms)
    assert type(fused.self_attention.linear_qkv) is MkernelColumnParallelLinear
    assert type(fused.self_attention.linear_proj) is MkernelRowParallelLinear
    assert type(fused.self_attention.core_attention) is MkernelRingAttention
    assert type(fused.mlp.linear_fc1) is MkernelColumnParallelLinear
    assert type(fused.mlp.linear_fc2) is MkernelRowParallelLinear
    assert isinstance(fused.mlp.linear_fc1, ColumnParallelLinear) and isinstance(fused.mlp.linear_fc2, RowParallelLinear)

    def names(model):  # the module tree, less DotProductAttention's own softmax and dropout modules
        inner = "self_attention.core_attention."
        return [(n, type(c).__name__) for n, c in model.named_modules() if not n.startswith(inner)]

    swapped = {"MkernelColumnParallelLinear": "ColumnParallelLinear", "MkernelRowParallelLinear": "RowParallelLinear",
               "MkernelRingAttention": "DotProductAttention"}
    assert [(n, swapped.get(t, t)) for n, t in names(fused)] == names(local)
    # One communicator per group, created once and shared by every layer of that group.
    assert sorted(comms.made()) == ["cp", "tp"]
    assert len(factory.made) == 2
    assert fused.self_attention.linear_qkv.comm is fused.mlp.linear_fc2.comm is comms.made()["tp"]
    assert comms.made()["tp"].group is megatron_world.get_tensor_model_parallel_group()
    assert comms.made()["cp"].group is megatron_world.get_context_parallel_group()


def test_layer_checkpoints_interchange_with_the_local_spec(megatron_world):
    from mkernel.megatron import Communicators

    cfg = config(normalization="RMSNorm", qk_layernorm=True)
    with Communicators(factory=RecordingFactory()) as comms:
        local, fused = build_layers(cfg, comms, qk_layernorm=True, normalization="RMSNorm")
        assert_checkpoints_interchange(local, fused)
        torch.manual_seed(1)
        local2, fused2 = build_layers(cfg, comms, qk_layernorm=True, normalization="RMSNorm")
        assert_checkpoints_interchange(fused2, local2)


def test_moe_layer_checkpoints_interchange_with_the_local_spec(megatron_world):
    from mkernel.megatron import Communicators, MkernelExperts, MkernelMoELayer

    with Communicators(factory=RecordingFactory()) as comms:
        local, fused = build_layers(moe_config(), comms, num_experts=4)
        assert type(fused.mlp) is MkernelMoELayer and type(fused.mlp.experts) is MkernelExperts
        assert "mlp.experts.local_experts.3.linear_fc1.weight" in fused.state_dict()
        assert_checkpoints_interchange(local, fused)
        assert sorted(comms.made()) == ["cp", "ep", "tp"]


def test_gpt_model_checkpoints_interchange(megatron_world):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from mkernel.megatron import Communicators, get_gpt_layer_mkernel_spec

    cfg = config()
    comms = Communicators(factory=RecordingFactory())
    args = dict(config=cfg, vocab_size=512, max_sequence_length=128, position_embedding_type="rope")
    local = GPTModel(transformer_layer_spec=get_gpt_layer_local_spec(), **args)
    fused = GPTModel(transformer_layer_spec=get_gpt_layer_mkernel_spec(comms), **args)
    assert_checkpoints_interchange(fused, local)
    made = list(comms.made().values())
    # The model holds the communicators; dropping the model destroys them.
    del fused, comms
    import gc

    gc.collect()
    assert made and all(c.closed for c in made)


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_fused_paths_give_megatrons_shapes_forward_and_backward(megatron_world, shape_comm, sequence_parallel):
    """Each mkernel module's fused path at two tensor-/context-parallel ranks, on meta tensors
    (the ops' shape-only implementations): Megatron's output shapes and bias handling, and
    gradients shaped like the inputs and parameters through the fused autograd functions.
    The communicator is a shape-only stand-in of world size 2, so no data moves."""
    from mkernel.megatron import Communicators

    layer = build_mkernel_layer(config(), Communicators(factory=RecordingFactory())).to("meta")
    two = shape_comm(2)
    s, b, h = 8, 2, 256
    attention, mlp = layer.self_attention, layer.mlp
    for module in (attention.linear_qkv, attention.linear_proj, mlp.linear_fc1, mlp.linear_fc2):
        module.comm, module.sequence_parallel = two, sequence_parallel
    shard = s // 2 if sequence_parallel else s

    def run(module, x):
        x = x.detach().requires_grad_(True)
        y, bias = module(x)
        y.sum().backward()
        assert x.grad.shape == x.shape
        for p in module.parameters():
            if p.grad is not None:
                assert p.grad.shape == p.shape
        return y, bias

    qkv_width = attention.linear_qkv.output_size_per_partition
    y, bias = run(attention.linear_qkv, torch.empty(shard, b, h, dtype=torch.bfloat16, device="meta"))
    assert y.shape == (s, b, qkv_width) and bias is None  # skip_bias_add=False: added inside
    assert attention.linear_qkv.weight.grad is not None and attention.linear_qkv.bias.grad is not None
    y, bias = run(attention.linear_proj, torch.empty(s, b, h, dtype=torch.bfloat16, device="meta"))
    assert y.shape == (shard, b, h) and bias is attention.linear_proj.bias  # skip_bias_add=True: returned
    y, _ = run(mlp.linear_fc1, torch.empty(shard, b, h, dtype=torch.bfloat16, device="meta"))
    assert y.shape == (s, b, mlp.linear_fc1.output_size_per_partition)
    y, _ = run(mlp.linear_fc2, torch.empty(s, b, 512, dtype=torch.bfloat16, device="meta"))
    assert y.shape == (shard, b, h)

    core = attention.core_attention
    core.comm = shape_comm(2)
    heads, d = 4, 64
    q, k, v = (torch.empty(s, b, heads, d, dtype=torch.bfloat16, device="meta", requires_grad=True) for _ in range(3))
    out = core(q, k, v, None)
    assert out.shape == (s, b, heads * d)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_communicators_close_once_and_refuse_afterwards(megatron_world):
    from mkernel.megatron import Communicators

    comms = Communicators(factory=RecordingFactory())
    tp = comms.for_group("tp", megatron_world.get_tensor_model_parallel_group(), config())
    assert comms.for_group("tp", None, config()) is tp
    comms.close()
    assert tp.closed and comms.closed
    with pytest.raises(MkInvalidUsageError, match="closed"):
        comms.for_group("cp", None, config())


def test_communicators_need_megatron_initialised_or_groups():
    from mkernel.megatron import Communicators

    with pytest.raises(MkInvalidUsageError, match="parallel_state is not initialized"):
        Communicators(factory=RecordingFactory())


def test_a_config_that_disagrees_with_the_group_names_the_group(megatron_world):
    from mkernel.megatron import Communicators

    comms = Communicators(factory=RecordingFactory())
    cfg = config()
    cfg.context_parallel_size = 2  # the group has one rank
    with pytest.raises(MkInvalidUsageError, match=r"context-parallel \(cp\) group has 1 ranks but config.context_parallel_size = 2"):
        comms.for_group("cp", None, cfg)


@pytest.mark.parametrize(
    "overrides, spec_args, match",
    [
        (dict(kv_channels=96), {}, r"config.kv_channels \(head dim\) = 96 is not supported; supported: 64, 128"),
        (dict(attention_dropout=0.1), {}, r"config.attention_dropout = 0.1 is not supported; supported: 0.0"),
        (dict(params_dtype=torch.float32, bf16=False), {}, r"config.params_dtype = torch.float32 is not supported; supported: torch.bfloat16, torch.float16"),
        (dict(hidden_size=260, num_attention_heads=2, kv_channels=64), {}, r"features per rank .* = 260 is not supported; supported: positive multiples of 8"),
        (dict(gradient_accumulation_fusion=False, window_size=(128, 0)), {}, r"config.window_size = \(128, 0\) is not supported; supported: None"),
    ],
)
def test_unsupported_dense_configs_are_refused_at_build(megatron_world, overrides, spec_args, match):
    from mkernel.megatron import Communicators

    with pytest.raises(MkInvalidArgumentError, match=match):
        build_mkernel_layer(config(**overrides), Communicators(factory=RecordingFactory()), **spec_args)


@pytest.mark.parametrize("option", ["multi_latent_attention", "moe_grouped_gemm"])
def test_spec_options_with_other_modules_are_refused(megatron_world, option):
    from mkernel.megatron import Communicators, get_gpt_layer_mkernel_spec

    with pytest.raises(MkInvalidArgumentError, match=f"{option} = True is not supported; supported: False"):
        get_gpt_layer_mkernel_spec(Communicators(factory=RecordingFactory()), **{option: True})


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(moe_ffn_hidden_size=200), r"config.moe_ffn_hidden_size = 200 is not supported; supported: positive multiples of 128"),
        (dict(hidden_size=320, num_attention_heads=5), r"config.hidden_size = 320 is not supported; supported: positive multiples of 128"),
        (dict(moe_shared_expert_intermediate_size=256), r"config.moe_shared_expert_intermediate_size = 256 is not supported; supported: None"),
        (
            dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
            r"config.moe_pad_expert_input_to_capacity = True is not supported; supported: False",
        ),
        (dict(add_bias_linear=True), r"config.add_bias_linear = True is not supported; supported: False"),
        (dict(num_moe_experts=2048), r"config.num_moe_experts = 2048 is not supported; supported: 1 to 1024"),
    ],
)
def test_unsupported_moe_configs_are_refused_at_build(megatron_world, overrides, match):
    from mkernel.megatron import Communicators

    experts = overrides.get("num_moe_experts", 4)
    with pytest.raises(MkInvalidArgumentError, match=match):
        build_mkernel_layer(moe_config(**overrides), Communicators(factory=RecordingFactory()), num_experts=experts)


def test_megatron_cp_sharding_is_mkernel_zigzag(megatron_world):  # get_pg_size reads the group once dist is up
    from megatron.core.utils import get_batch_on_this_cp_rank

    from mkernel.megatron import zigzag_positions

    class Group:  # what get_batch_on_this_cp_rank reads of a CP group: its size and this rank
        def __init__(self, size, rank):
            self._size, self._rank = size, rank

        def size(self):
            return self._size

        def rank(self):
            return self._rank

    seq = 48
    for cp in (1, 2, 3, 4):
        for rank in range(cp):
            positions = torch.arange(seq).unsqueeze(0)  # [batch, seq], as Megatron's batches
            sharded = get_batch_on_this_cp_rank({"position_ids": positions.clone()}, cp_group=Group(cp, rank))
            assert torch.equal(sharded["position_ids"][0], zigzag_positions(seq, cp, rank)), (cp, rank)


def test_moe_fuses_exactly_swiglu_and_geglu(megatron_world):
    """The dispatch epilogue takes SwiGLU and GeGLU (erf GELU) as megatron-core's MLP computes
    them; a clamp, an offset, another activation or a plain unit run in torch."""
    from mkernel.megatron.moe import activation_of, fused_activation_of

    F = torch.nn.functional
    assert fused_activation_of(moe_config()) == "silu"
    assert fused_activation_of(moe_config(activation_func=F.gelu)) == "gelu"
    assert fused_activation_of(moe_config(activation_func=F.relu)) == "none"
    assert fused_activation_of(moe_config(gated_linear_unit=False)) == "none"
    assert fused_activation_of(moe_config(glu_linear_offset=1.0)) == "none"
    assert fused_activation_of(moe_config(activation_func_clamp_value=7.0)) == "none"
    # The torch twin of the fused SwiGLU: silu(gate) * up on fc1's [gate | up] columns.
    y = torch.randn(5, 8, dtype=torch.float64)
    torch.testing.assert_close(activation_of(moe_config())(y), F.silu(y[:, :4]) * y[:, 4:], rtol=0, atol=0)


def test_megatrons_router_gemm_runs_without_transformer_engine():
    """megatron-core 0.16.1's router GEMM names Transformer Engine's GEMM even when TE is not
    installed (NameError at the first MoE forward, local spec and mkernel's alike); the binding
    the mkernel spec makes lets it take torch's path, forward and backward."""
    from megatron.core.transformer.moe import moe_utils

    if moe_utils.HAVE_TE:
        pytest.skip("Transformer Engine is installed: the router has its GEMM")
    from mkernel.megatron import let_router_run_without_transformer_engine

    let_router_run_without_transformer_engine()
    assert moe_utils.te_general_gemm is None
    assert not let_router_run_without_transformer_engine(), "a second call binds nothing"
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 16, generator=g, requires_grad=True)
    w = torch.randn(4, 16, generator=g, requires_grad=True)
    logits = moe_utils.router_gating_linear(x, w, None, torch.float32)
    torch.testing.assert_close(logits.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
    logits.sum().backward()
    torch.testing.assert_close(x.grad.double(), w.double().sum(0).expand(6, 16), rtol=1e-5, atol=1e-5)


def test_routing_and_unfused_moe_match_megatron_experts(megatron_world):
    """Megatron's router output converted to top-k ids and weights, then moe_reference (the MoE
    layer's backward recomputation) against Megatron's own SequentialMLP experts, forward and backward."""
    from mkernel.megatron import moe_reference, topk_from_routing
    from mkernel.megatron.moe import activation_of

    cfg = moe_config(params_dtype=torch.float32, bf16=False)
    torch.manual_seed(3)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    layer = build_module(get_gpt_layer_local_spec(num_experts=4), config=cfg, layer_number=1)
    moe = layer.mlp
    tokens = 24
    x = torch.randn(tokens, 1, cfg.hidden_size, dtype=torch.float64).to(torch.float32)
    # Megatron's router: its gate (TopKRouter.gating moves the weight to the GPU, so the
    # logits are computed here) and its top-k routing with softmax.
    logits = x.reshape(tokens, -1) @ moe.router.weight.t()
    probs, routing_map = moe.router.routing(logits)
    idx, weights = topk_from_routing(probs, routing_map, cfg.moe_router_topk)
    assert idx.dtype == torch.int32 and (idx >= 0).all() and (routing_map.sum(1) == cfg.moe_router_topk).all()
    assert torch.equal(torch.zeros_like(routing_map).scatter(1, idx.long(), True), routing_map)

    experts = moe.experts.local_experts
    w1 = torch.stack([e.linear_fc1.weight for e in experts]).detach().requires_grad_(True)
    w2 = torch.stack([e.linear_fc2.weight for e in experts]).detach().requires_grad_(True)
    rows = x.reshape(tokens, -1).detach().requires_grad_(True)
    weights = weights.detach().requires_grad_(True)
    out = moe_reference(rows, idx, weights, w1, w2, activation_of(cfg))

    # Megatron's experts, token by token, each choice weighted by its probability.
    expected = torch.zeros_like(out)
    for t in range(tokens):
        for j in range(cfg.moe_router_topk):
            e = int(idx[t, j])
            y, _ = experts[e](rows[t : t + 1])
            expected[t] += weights[t, j] * y[0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (rows, weights, w1, w2), grad)
    fc1 = [e.linear_fc1.weight for e in experts]
    fc2 = [e.linear_fc2.weight for e in experts]
    want = torch.autograd.grad(expected, (rows, weights, *fc1, *fc2), grad)
    want = (want[0], want[1], torch.stack(want[2 : 2 + len(fc1)]), torch.stack(want[2 + len(fc1) :]))
    for g, w in zip(got, want):
        assert g.abs().sum() > 0
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_megatrons_capacity_drops_reach_the_layer_as_absent_choices(megatron_world, policy):
    """With moe_expert_capacity_factor Megatron's router drops choices by its policy; the layer
    takes what is left: -1 for each dropped choice, the kept ones' probabilities as weights, and
    moe_reference (the layer's unfused form) equals Megatron's experts over the kept choices."""
    from mkernel.megatron import Communicators, moe_reference, topk_from_routing
    from mkernel.megatron.moe import activation_of

    drops = dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy=policy)
    build_mkernel_layer(moe_config(**drops), Communicators(factory=RecordingFactory()), num_experts=4)  # accepted
    cfg = moe_config(params_dtype=torch.float32, bf16=False, **drops)
    torch.manual_seed(5)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    moe = build_module(get_gpt_layer_local_spec(num_experts=4), config=cfg, layer_number=1).mlp
    tokens = 32
    x = torch.randn(tokens, cfg.hidden_size, dtype=torch.float64).to(torch.float32)
    probs, routing_map = moe.router.routing(x @ moe.router.weight.t())
    idx, weights = topk_from_routing(probs, routing_map, cfg.moe_router_topk)
    kept = idx >= 0
    assert (~kept).any() and kept.any(), "capacity 0.5 should drop some choices and keep others"
    assert torch.equal(kept.sum(1), routing_map.sum(1).to(kept.sum(1).dtype))
    rows, cols = kept.nonzero(as_tuple=True)
    ids = idx[rows, cols].long()
    assert routing_map[rows, ids].all()
    assert torch.equal(weights[rows, cols], probs[rows, ids].to(torch.float32))
    assert (weights[~kept] == 0).all()

    experts = moe.experts.local_experts
    w1 = torch.stack([e.linear_fc1.weight for e in experts]).detach()
    w2 = torch.stack([e.linear_fc2.weight for e in experts]).detach()
    out = moe_reference(x, idx, weights, w1, w2, activation_of(cfg))
    expected = torch.zeros_like(out)
    for t in range(tokens):
        for e in routing_map[t].nonzero().flatten().tolist():
            y, _ = experts[e](x[t : t + 1])
            expected[t] += probs[t, e] * y[0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# --- two processes: TP = 2, CP = 2, EP = 2 ---------------------------------------------------------


def _two_rank_body(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    import mkernel.megatron as mm

    report = {}
    # TP = 2, sequence parallel.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    cfg = config(tensor_model_parallel_size=2, sequence_parallel=True)
    factory = RecordingFactory()
    comms = mm.Communicators(factory=factory)
    fused = build_module(mm.get_gpt_layer_mkernel_spec(comms), config=cfg, layer_number=1)
    # Without Apex the local spec's norm refuses sequence parallelism; the mkernel spec's norm
    # marks its parameters for Megatron's gradient sum over the group instead.
    try:
        build_module(get_gpt_layer_local_spec(), config=cfg, layer_number=1)
        report["local_spec_sp"] = "built"
    except AssertionError as e:
        report["local_spec_sp"] = str(e)
    assert fused.input_layernorm.weight.sequence_parallel and fused.pre_mlp_layernorm.bias.sequence_parallel
    local = build_module(get_gpt_layer_local_spec(), config=config(tensor_model_parallel_size=2), layer_number=1)
    assert_checkpoints_interchange(local, fused)
    tp = comms.made()["tp"]
    assert tp.group is parallel_state.get_tensor_model_parallel_group() and (tp.rank, tp.world_size) == (rank, 2)
    assert fused.self_attention.linear_qkv.weight.shape == (3 * 256 // 2, 256)
    assert fused.mlp.linear_fc2.weight.shape == (256, 512 // 2)
    assert len(factory.made) == 2  # tp and cp, each once for both sublayers
    # Communicators made over other groups than the model's: refused, naming the group.
    other = mm.Communicators(
        tp_group=dist.new_group([0, 1]), cp_group=parallel_state.get_context_parallel_group(),
        ep_group=parallel_state.get_expert_model_parallel_group(), factory=RecordingFactory(),
    )
    try:
        build_module(mm.get_gpt_layer_mkernel_spec(other), config=cfg, layer_number=1)
        raise AssertionError("a foreign tensor-parallel group was accepted")
    except MkInvalidUsageError as e:
        assert "tensor-parallel (tp) group (size 2) is not the tensor-parallel (tp) group these Communicators" in str(e)
    comms.close()
    parallel_state.destroy_model_parallel()

    # CP = 2: the local spec's DotProductAttention refuses CP, the mkernel spec builds.
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    cfg = config(context_parallel_size=2)
    comms = mm.Communicators(factory=RecordingFactory())
    fused = build_module(mm.get_gpt_layer_mkernel_spec(comms), config=cfg, layer_number=1)
    cp = comms.made()["cp"]
    assert cp.group is parallel_state.get_context_parallel_group() and cp.world_size == 2
    try:
        build_module(get_gpt_layer_local_spec(), config=cfg, layer_number=1)
        report["local_spec_cp"] = "built"
    except AssertionError as e:
        report["local_spec_cp"] = str(e)
    cfg_a2a = config(context_parallel_size=2, cp_comm_type="a2a")
    try:
        build_module(mm.get_gpt_layer_mkernel_spec(comms), config=cfg_a2a, layer_number=1)
        raise AssertionError("cp_comm_type a2a was accepted")
    except MkInvalidArgumentError as e:
        assert "cp_comm_type = 'a2a' is not supported; supported: p2p" in str(e)
    comms.close()
    parallel_state.destroy_model_parallel()

    # EP = 2: 8 experts, 4 on each rank.
    parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    cfg = moe_config(num_moe_experts=8, expert_model_parallel_size=2)
    comms = mm.Communicators(factory=RecordingFactory())
    local, fused = build_layers(cfg, comms, num_experts=8)
    assert_checkpoints_interchange(local, fused)
    ep = comms.made()["ep"]
    assert ep.group is parallel_state.get_expert_model_parallel_group() and ep.world_size == 2
    assert len(fused.mlp.experts.local_experts) == 4
    comms.close()
    # In the same processes (each spawn costs seconds of imports): the MoE recomputation over EP = 2.
    report["moe_reference_ep2"] = _moe_reference_over_two_ranks(rank)
    return report


def test_tp_cp_ep_of_two_ranks_wire_megatrons_groups_and_moe_recomputes_over_ep():
    results = run_ranks(2, _two_rank_body)
    for rank in range(2):
        assert results[rank]["moe_reference_ep2"] is True
        assert "sequence parallel not supported by torch LayerNorm" in results[rank]["local_spec_sp"]
        assert "Context parallelism is only supported by TEDotProductAttention" in results[rank]["local_spec_cp"]


def _moe_reference_over_two_ranks(rank):
    """moe_reference over two expert-parallel ranks equals the one-rank computation with all experts."""
    from mkernel.megatron import moe_reference

    group = dist.new_group([0, 1])
    torch.manual_seed(7)  # the same data on both ranks; each takes its half of the tokens
    tokens, hidden, ffn, experts, k = 16, 32, 24, 4, 2
    x = torch.randn(2 * tokens, hidden, dtype=torch.float64)
    idx = torch.stack([torch.randperm(experts)[:k] for _ in range(2 * tokens)]).to(torch.int32)
    idx[3, 1] = -1  # a token with one choice only
    weights = torch.rand(2 * tokens, k, dtype=torch.float32)
    w1 = torch.randn(experts, ffn, hidden, dtype=torch.float64) / 8
    w2 = torch.randn(experts, hidden, ffn, dtype=torch.float64) / 8
    act = torch.nn.functional.gelu
    w1.requires_grad_(True)
    whole = moe_reference(x, idx, weights, w1, w2, act)
    whole.square().sum().backward()
    mine = slice(rank * tokens, (rank + 1) * tokens)
    local = slice(rank * experts // 2, (rank + 1) * experts // 2)
    w1_local = w1[local].detach().clone().requires_grad_(True)
    x_mine = x[mine].clone().requires_grad_(True)
    out = moe_reference(x_mine, idx[mine], weights[mine], w1_local, w2[local].clone(), act, group)
    torch.testing.assert_close(out, whole[mine])
    # Each rank's loss is its own tokens' part; the gradient of the sum over ranks reaches
    # this rank's experts from every rank's tokens through the gathers.
    out.square().sum().backward()
    assert w1_local.grad.abs().sum() > 0
    torch.testing.assert_close(w1_local.grad, w1.grad[local])
    return True


def _load_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_gpt", REPO / "examples/megatron/train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_builds_both_specs_and_they_share_checkpoints(megatron_world, tmp_path):
    """The example's own config and model builder (its training loop needs a GPU): both specs,
    MoE, checkpoints interchange through the example's own files (torch.save / torch.load);
    the local spec with sequence parallelism is refused without Apex."""
    example = _load_example()
    small = ["--layers", "2", "--hidden", "256", "--heads", "4", "--ffn", "512", "--seq", "64", "--vocab", "512"]
    for extra in ([], ["--experts", "4", "--moe-ffn", "128"]):
        models = {}
        for spec in ("mkernel", "local"):
            args = example.parse_args(["--spec", spec, *small, *extra])
            config = example.transformer_config(args)
            config.use_cpu_initialization = True
            models[spec], communicators = example.build_model(args, config, factory=RecordingFactory())
            assert (communicators is None) == (spec == "local")
        assert type(models["mkernel"].decoder.layers[0].self_attention.core_attention).__name__ == "MkernelRingAttention"
        prefix = str(tmp_path / f"mkernel{len(extra)}")
        example.save_checkpoint(models["mkernel"], prefix, 0)
        saved = models["mkernel"].state_dict()
        before = models["local"].state_dict()
        assert any(isinstance(v, torch.Tensor) and v.numel() > 1 and not torch.equal(v, before[k]) for k, v in saved.items())
        example.load_checkpoint(models["local"], prefix, 0, "cpu")
        loaded = models["local"].state_dict()
        assert sorted(loaded) == sorted(saved)
        for key, value in saved.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, loaded[key]), key
    from megatron.core.models.gpt import gpt_layer_specs

    if not gpt_layer_specs.HAVE_APEX:
        args = example.parse_args(["--spec", "local", "--sequence-parallel", "--tp", "2", *small])
        with pytest.raises(SystemExit, match="needs Apex's FusedLayerNorm"):
            example.build_model(args, example.transformer_config(args))


def test_the_example_token_stream_is_a_markov_walk_repeated():
    """--data markov-copy: the same batches for a seed, every token a successor of the one
    before in the first half, the second half the first again; --first-batch starts later
    in the same stream."""
    example = _load_example()
    args = example.parse_args(["--seq", "64", "--vocab", "97", "--branch", "3"])
    first = [b for _, b in zip(range(3), example.token_stream(args, 2))]
    again = [b for _, b in zip(range(3), example.token_stream(args, 2))]
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert first[0].shape == (2, 65) and not torch.equal(first[0], first[1])
    successors = {}
    for batch in first:
        for row in batch.tolist():
            half = row[:33]
            assert row[33:] == half[:32]
            for a, b in zip(half, half[1:]):
                successors.setdefault(a, set()).add(b)
    assert max(len(s) for s in successors.values()) <= 3
    args = example.parse_args(["--seq", "64", "--vocab", "97", "--branch", "3", "--first-batch", "2"])
    later = next(example.synthetic_batches(args, 0, 2, "cpu"))
    assert torch.equal(later["tokens"], first[2][:1, :-1]) and torch.equal(later["labels"], first[2][:1, 1:])
    prefetched = example.Prefetched(example.token_stream(args, 2))
    prefetched.prepare()
    prefetched.prepare()  # makes one item ahead, not two
    assert [torch.equal(next(prefetched), b) for b in first] == [True, True, True]
    uniform = example.parse_args(["--seq", "64", "--vocab", "97", "--data", "uniform"])
    assert next(example.token_stream(uniform, 2)).shape == (2, 65)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seq", "4095", "--cp", "2"], "multiple of 2 \\* --cp"),
        (["--save-after", "3"], "--save-after needs --save"),
        (["--save", "x", "--save-after", "7", "--steps", "5"], "--save-after must be in"),
        (["--experts", "4", "--topk", "5"], "--topk 5 is more than --experts 4"),
        (["--max-seconds", "0"], "--max-seconds must be positive"),
        (["--tp", "0"], "--tp must be at least 1"),
    ],
)
def test_the_example_refuses_bad_arguments(argv, message, capsys):
    example = _load_example()
    with pytest.raises(SystemExit):
        example.parse_args(argv)
    assert re.search(message, capsys.readouterr().err)


def test_torchrun_hands_every_option_of_the_example_to_it():
    """torchrun parses the whole command line, the script's arguments included: an option of
    the example that is one of torchrun's or abbreviates one would be taken, or refused as
    ambiguous, before the example sees it (`--log` stopped every run of a GPU call that way)."""
    from torch.distributed.run import get_args_parser

    def long_options(parser):
        return [o for a in parser._actions for o in a.option_strings if o.startswith("--")]

    theirs = long_options(get_args_parser())
    clashes = {o: [t for t in theirs if t.startswith(o)] for o in long_options(_load_example().build_parser())}
    assert not {o: t for o, t in clashes.items() if t and o != "--help"}


def test_the_example_parses_its_arguments():
    out = subprocess.run(
        [sys.executable, str(REPO / "examples/megatron/train_gpt.py"), "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "--spec {mkernel,local}" in out.stdout
