"""Trains a small GPT with Megatron-core's GPTModel, DDP, optimizer and schedule on synthetic data,
with the layer spec chosen by --spec: mkernel's (mkernel.megatron) or Megatron's local one.

    torchrun --nproc-per-node 2 examples/megatron/train_gpt.py --spec mkernel --tp 2 --sequence-parallel
    torchrun --nproc-per-node 2 examples/megatron/train_gpt.py --spec mkernel --cp 2
    torchrun --nproc-per-node 2 examples/megatron/train_gpt.py --spec mkernel --ep 2 --experts 8 --topk 2
    torchrun --nproc-per-node 2 examples/megatron/train_gpt.py --spec local --tp 2 --sequence-parallel

Every rank draws the same token stream from --seed (the data-parallel ranks take their own
micro-batches of it), so two runs that differ only in --spec see the same data. The default
stream (--data markov-copy) has something to learn that needs attention: each sequence is a
walk through a fixed random Markov chain of --branch successors per token (learnable from
the current token: ln(branch) nats) whose second half repeats its first half (learnable
only by attending back, across context-parallel shards too); --data uniform draws tokens
uniformly (nothing to learn: the loss stays at ln(vocab)).

Rank 0 appends one JSON line per step to --steps-log (the run's --label, the step, the batch's
index in the stream, the loss averaged over the data-parallel ranks, the step time) and a
last line with the run's arguments and how many steps it did. --save / --load write and
read a plain torch state dict of the model (rank-local shards), which both specs share;
with --save-after K the state after K steps is written and training goes on, so the loss of
step K is the loss of that state on batch K, which a run of the other spec can reproduce
with --load and --first-batch K. --max-seconds stops starting steps after that much
training time (the last line says so), for a caller with a time budget.

The mkernel spec's only lines beside the local one are marked `# mkernel` below.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def build_parser():
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
    p.add_argument("--data", choices=["markov-copy", "uniform"], default="markov-copy")
    p.add_argument("--branch", type=int, default=8, help="successors per token of --data markov-copy's chain")
    p.add_argument("--first-batch", type=int, default=0, help="index in the stream of the first step's batch")
    # Not --log: torchrun reads the whole command line and refuses an option that abbreviates
    # several of its own (--log-dir, --logs-specs).
    p.add_argument("--steps-log", default=None, help="append JSON lines of loss and step time here (rank 0)")
    p.add_argument("--label", default=None, help="the run's name in --steps-log (default: --spec)")
    p.add_argument("--save", default=None, help="state dict path prefix to write (after --save-after steps)")
    p.add_argument("--save-after", type=int, default=None, help="steps after which --save writes (default: all)")
    p.add_argument("--load", default=None, help="state dict path prefix to read before the first step")
    p.add_argument("--max-seconds", type=float, default=None, help="start no step after this much training time")
    p.add_argument("--dry-run", action="store_true",
                   help="check the arguments and build the TransformerConfig (no GPU, no process group), then exit")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(parser, args):
    """Refuses, before anything is built, what the run could not do."""
    for name in ("tp", "cp", "ep", "layers", "hidden", "heads", "ffn", "seq", "vocab", "micro_batch", "steps", "branch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    if args.experts < 0 or args.topk < 1 or args.first_batch < 0:
        parser.error("--experts and --first-batch must be at least 0, --topk at least 1")
    if args.experts and args.topk > args.experts:
        parser.error(f"--topk {args.topk} is more than --experts {args.experts}")
    if args.branch > args.vocab:
        parser.error(f"--branch {args.branch} is more than --vocab {args.vocab}")
    if args.seq % (2 * args.cp):
        parser.error(f"--seq {args.seq} must be a multiple of 2 * --cp = {2 * args.cp} (Megatron's CP sharding)")
    if args.save_after is not None:
        if args.save is None:
            parser.error("--save-after needs --save")
        if not 0 <= args.save_after <= args.steps:
            parser.error(f"--save-after must be in [0, --steps = {args.steps}], not {args.save_after}")
    if args.max_seconds is not None and args.max_seconds <= 0:
        parser.error(f"--max-seconds must be positive, not {args.max_seconds}")


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
        if experts:
            # megatron-core 0.16.1's router needs this without Transformer Engine (mkernel's spec does it itself).
            from mkernel.megatron import let_router_run_without_transformer_engine

            let_router_run_without_transformer_engine()
        spec = get_gpt_layer_local_spec(num_experts=experts, normalization="RMSNorm")
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.vocab,
        max_sequence_length=args.seq,
        position_embedding_type="rope",
    )
    return model, communicators


def token_stream(args, rows):
    """Batches of `rows` sequences of seq + 1 tokens, the same for every rank (see --data)."""
    import torch

    generator = torch.Generator().manual_seed(args.seed)
    length = args.seq + 1
    if args.data == "uniform":
        while True:
            yield torch.randint(0, args.vocab, (rows, length), generator=generator)
    successors = torch.randint(0, args.vocab, (args.vocab, args.branch), generator=generator).tolist()
    half = (length + 1) // 2
    while True:
        starts = torch.randint(0, args.vocab, (rows,), generator=generator).tolist()
        choices = torch.randint(0, args.branch, (rows, half), generator=generator).tolist()
        batch = []
        for token, picks in zip(starts, choices):
            walk = [token]
            for pick in picks[1:]:
                token = successors[token][pick]
                walk.append(token)
            batch.append((walk + walk)[:length])
        yield torch.tensor(batch, dtype=torch.int64)


def synthetic_batches(args, data_parallel_rank, data_parallel_size, device):
    """The token stream from batch --first-batch on; each data-parallel rank takes its micro-batches."""
    import torch

    stream = token_stream(args, data_parallel_size * args.micro_batch)
    for _ in range(args.first_batch):
        next(stream)
    while True:
        tokens = next(stream)
        mine = tokens[data_parallel_rank * args.micro_batch : (data_parallel_rank + 1) * args.micro_batch]
        position_ids = torch.arange(args.seq).unsqueeze(0).expand(args.micro_batch, -1)
        yield {
            "tokens": mine[:, :-1].to(device),
            "labels": mine[:, 1:].to(device),
            "loss_mask": torch.ones(args.micro_batch, args.seq, device=device),
            "position_ids": position_ids.to(device),
        }


class Prefetched:
    """An iterator over `source` whose next item prepare() makes ahead, so that making it
    (the token walk on the CPU, the copy to the GPU) stays out of the timed step."""

    def __init__(self, source):
        self.source, self.ready = source, None

    def prepare(self):
        if self.ready is None:
            self.ready = next(self.source)

    def __iter__(self):
        return self

    def __next__(self):
        self.prepare()
        item, self.ready = self.ready, None
        return item


def checkpoint_path(prefix, rank):
    return f"{prefix}.rank{rank}.pt"


def save_checkpoint(model, prefix, rank):
    """This rank's shard of the model's state dict (the same keys and layouts under both specs)."""
    import torch

    torch.save(model.state_dict(), checkpoint_path(prefix, rank))


def load_checkpoint(model, prefix, rank, device):
    import torch

    model.load_state_dict(torch.load(checkpoint_path(prefix, rank), map_location=device), strict=True)


def main(argv=None):
    args = parse_args(argv)
    if args.dry_run:
        config = transformer_config(args)
        print(f"train_gpt.py: arguments and TransformerConfig accepted ({args.spec} spec, tp {config.tensor_model_parallel_size}, "
              f"cp {config.context_parallel_size}, ep {config.expert_model_parallel_size}, "
              f"sequence parallel {config.sequence_parallel}, experts {config.num_moe_experts})")
        return
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
        load_checkpoint(model, args.load, dist.get_rank(), "cuda")
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

    batches = Prefetched(synthetic_batches(
        args, parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(), "cuda"
    ))

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
    label = args.label or args.spec
    log = open(args.steps_log, "a") if args.steps_log and dist.get_rank() == 0 else None
    save_after = args.steps if args.save_after is None else args.save_after
    if args.save and save_after == 0:
        save_checkpoint(model.module, args.save, dist.get_rank())
    started = time.perf_counter()
    done, stopped = 0, None
    for step in range(args.steps):
        # Every rank decides alike: rank 0's clock, broadcast (a rank that stopped alone would hang the rest).
        if args.max_seconds is not None:
            over = torch.tensor([float(time.perf_counter() - started > args.max_seconds)], device="cuda")
            dist.broadcast(over, src=0)
            if over.item():
                stopped = f"--max-seconds {args.max_seconds:g} reached after {done} of {args.steps} steps"
                break
        batches.prepare()
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
        done = step + 1
        if done == save_after and args.save:
            save_checkpoint(model.module, args.save, dist.get_rank())
        if losses:  # the last pipeline stage
            # The loss over the whole global batch: every data-parallel rank's tokens (CP is summed in loss_func).
            total = losses[0]["lm loss"].detach().clone()
            dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
            loss = (total[0] / total[1]).item()
            if log:
                line = {"run": label, "spec": args.spec, "step": step, "batch": args.first_batch + step,
                        "loss": loss, "step_s": elapsed}
                log.write(json.dumps(line) + "\n")
                log.flush()
            if dist.get_rank() == 0 and (step % 10 == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {loss:.4f}  {elapsed * 1e3:.1f} ms", flush=True)
    if stopped and dist.get_rank() == 0:
        print(f"train_gpt.py: stopped early: {stopped}", flush=True)
    if log:
        summary = {"run": label, "summary": True, "steps_asked": args.steps, "steps_done": done, "stopped": stopped,
                   "world_size": dist.get_world_size(),
                   "data_parallel_size": parallel_state.get_data_parallel_world_size(), "args": vars(args)}
        log.write(json.dumps(summary) + "\n")
        log.close()
    del model, optimizer
    if communicators is not None:
        communicators.close()  # mkernel
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
