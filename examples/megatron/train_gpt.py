"""Trains a small GPT with Megatron-core's GPTModel, DDP, optimizer and schedule on synthetic data,
with the layer spec chosen by --spec: mkernel's (mkernel.megatron) or Megatron's local one.

    torchrun --nproc-per-node 2 examples/megatron/train_gpt.py --spec mkernel --tp 2 --sequence-parallel
    torchrun --nproc-per-node 2 examples/megatron/train_gpt.py --spec mkernel --cp 2
    torchrun --nproc-per-node 2 examples/megatron/train_gpt.py --spec mkernel --ep 2 --experts 8 --topk 2
    torchrun --nproc-per-node 2 examples/megatron/train_gpt.py --spec local --tp 2 --sequence-parallel

Every rank draws the same token stream from --seed (the data-parallel ranks take their own
micro-batches of it), so two runs that differ only in --spec see the same data. Writes one
JSON line per step (loss, step time) to --log on rank 0; --save / --load write and read a
plain torch state dict of the model (rank-local shards), which both specs share.

The mkernel spec's only lines beside the local one are marked `# mkernel` below.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", choices=["mkernel", "local"], default="mkernel")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (the local spec refuses > 1)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--experts", type=int, default=0, help="MoE experts per layer (0: dense)")
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--moe-ffn", type=int, default=1024)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log", default=None, help="JSON lines of loss and step time (rank 0)")
    p.add_argument("--save", default=None, help="state dict path prefix to write after the last step")
    p.add_argument("--load", default=None, help="state dict path prefix to read before the first step")
    return p.parse_args(argv)


def transformer_config(args):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = dict(
        num_moe_experts=args.experts,
        moe_router_topk=args.topk,
        moe_ffn_hidden_size=args.moe_ffn,
        # AllGather/ReduceScatter dispatch for the local spec: libmkernel-nccl's standalone mode
        # (ranks sharing one GPU) has no send/receive for an all-to-all. mkernel's spec ignores it.
        moe_token_dispatcher_type="allgather",
        moe_aux_loss_coeff=0.0,
    ) if args.experts else {}
    return TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        ffn_hidden_size=args.ffn,
        tensor_model_parallel_size=args.tp,
        context_parallel_size=args.cp,
        expert_model_parallel_size=args.ep,
        sequence_parallel=args.sequence_parallel,
        params_dtype=torch.bfloat16,
        bf16=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        add_bias_linear=not args.experts,
        gated_linear_unit=bool(args.experts),
        activation_func=torch.nn.functional.silu if args.experts else torch.nn.functional.gelu,
        normalization="RMSNorm",
        pipeline_dtype=torch.bfloat16,
        **moe,
    )


def local_norm_takes_sequence_parallel() -> bool:
    from megatron.core.models.gpt import gpt_layer_specs

    return gpt_layer_specs.HAVE_APEX


def build_model(args, config, **communicator_options):
    """GPTModel with the chosen spec; for --spec mkernel also its Communicators (options passed on)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    experts = args.experts or None
    communicators = None
    if args.spec == "mkernel":
        import mkernel.megatron  # mkernel

        # mkernel: one per model, over parallel_state's groups
        communicators = mkernel.megatron.Communicators(**communicator_options)
        spec = mkernel.megatron.get_gpt_layer_mkernel_spec(  # mkernel
            communicators, num_experts=experts, normalization="RMSNorm"
        )
        if args.sequence_parallel:
            # A final norm that builds under sequence parallelism without Apex (mkernel.megatron.norm).
            spec = mkernel.megatron.get_gpt_block_spec(spec, args.layers)  # mkernel
    else:
        if args.sequence_parallel and not local_norm_takes_sequence_parallel():
            raise SystemExit(
                "train_gpt.py: --spec local --sequence-parallel needs Apex's FusedLayerNorm (Megatron's torch norm "
                "refuses sequence parallelism); without Apex, compare with --spec local at the same --tp without "
                "--sequence-parallel (the same model and math)"
            )
        spec = get_gpt_layer_local_spec(num_experts=experts, normalization="RMSNorm")
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.vocab,
        max_sequence_length=args.seq,
        position_embedding_type="rope",
    )
    return model, communicators


def synthetic_batches(args, data_parallel_rank, data_parallel_size, device):
    """The same token stream on every rank for a seed; each data-parallel rank takes its micro-batches."""
    import torch

    generator = torch.Generator().manual_seed(args.seed)
    while True:
        tokens = torch.randint(0, args.vocab, (data_parallel_size * args.micro_batch, args.seq + 1), generator=generator)
        mine = tokens[data_parallel_rank * args.micro_batch : (data_parallel_rank + 1) * args.micro_batch]
        position_ids = torch.arange(args.seq).unsqueeze(0).expand(args.micro_batch, -1)
        yield {
            "tokens": mine[:, :-1].to(device),
            "labels": mine[:, 1:].to(device),
            "loss_mask": torch.ones(args.micro_batch, args.seq, device=device),
            "position_ids": position_ids.to(device),
        }


def main(argv=None):
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.utils import get_batch_on_this_cp_rank

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group("nccl")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, context_parallel_size=args.cp, expert_model_parallel_size=args.ep
    )
    model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)

    config = transformer_config(args)
    model, communicators = build_model(args, config)
    model.cuda()
    if args.load:
        model.load_state_dict(torch.load(f"{args.load}.rank{dist.get_rank()}.pt", map_location="cuda"), strict=True)
    model = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False),
        module=model,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, bf16=True, use_distributed_optimizer=False, clip_grad=1.0),
        [model],
    )

    # As Megatron's training loop wires them: the data-parallel (and CP) gradient reduction and
    # the sum of sequence-parallel parameters' gradients over the TP group run in finalize_model_grads.
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = model.no_sync

    batches = synthetic_batches(
        args, parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(), "cuda"
    )

    def forward_step(data_iterator, model):
        batch = get_batch_on_this_cp_rank(next(data_iterator))  # Megatron's own load-balanced CP sharding
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

        def loss_func(output_tensor):
            mask = batch["loss_mask"].view(-1).float()
            loss = torch.sum(output_tensor.view(-1).float() * mask)
            count = mask.sum()
            total = torch.stack([loss, count])
            dist.all_reduce(total, group=parallel_state.get_context_parallel_group())
            return loss, count.to(torch.int), {"lm loss": total}

        return output, loss_func

    forward_backward = get_forward_backward_func()
    log = open(args.log, "w") if args.log and dist.get_rank() == 0 else None
    for step in range(args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(
            forward_step_func=forward_step,
            data_iterator=batches,
            model=[model],
            num_microbatches=1,
            seq_length=args.seq // args.cp,
            micro_batch_size=args.micro_batch,
            forward_only=False,
        )
        optimizer.step()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if losses:  # the last pipeline stage
            total = losses[0]["lm loss"]
            loss = (total[0] / total[1]).item()
            if log:
                log.write(json.dumps({"step": step, "loss": loss, "step_s": elapsed, "spec": args.spec}) + "\n")
                log.flush()
            if dist.get_rank() == 0 and (step % 10 == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {loss:.4f}  {elapsed * 1e3:.1f} ms", flush=True)
    if args.save:
        torch.save(model.module.state_dict(), f"{args.save}.rank{dist.get_rank()}.pt")
    if log:
        log.close()
    del model, optimizer
    if communicators is not None:
        communicators.close()  # mkernel
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
