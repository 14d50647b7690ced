"""Train a small fusedpar Transformer on synthetic data with every kind of parallelism the world
allows: tensor parallelism (fused all-gather / reduce-scatter GEMMs), sequence-parallel ring
attention, expert-parallel MoE, and data or pipeline parallelism on top.

    python -m torch.distributed.run --standalone --nproc-per-node 4 -m fusedpar.demo

On a machine without CUDA it runs on CPU tensors under Triton's interpreter (gloo); with CUDA,
compiled kernels on NCCL (one GPU per rank). The layout defaults to tp=2, sp=2 when the world
has 4 ranks per data/pipeline replica (the rest becomes dp, or pp with ``--pp``); experts are
split over the sp x tp ranks (``--ep``). The data: sequences that follow a fixed random
permutation of the vocabulary (``x[t+1] = perm[x[t]]``) from random starting tokens, so the
loss can fall from ``ln(vocab)`` towards 0 within a few dozen steps.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def _use_cuda(device: str) -> bool:
    """CUDA when asked, or (``auto``) when every local rank can have its own GPU."""
    import torch

    if device == "cpu":
        return False
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    usable = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    if device == "cuda" and not usable:
        raise RuntimeError(f"--device cuda needs one GPU per local rank ({local_world}), "
                           f"found {torch.cuda.device_count()}")
    return usable


def _setup_env(use_cuda: bool):
    # the interpreter must be chosen before triton is imported (fusedpar.kernels imports it)
    if not use_cuda:
        os.environ["TRITON_INTERPRET"] = "1"


def parse_args(argv):
    """The command line (``python -m fusedpar.demo --help``)."""
    p = argparse.ArgumentParser(prog="python -m fusedpar.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default 2 when the world allows)")
    p.add_argument("--sp", type=int, default=None, help="sequence-parallel (ring attention) size (default 2 when "
                   "the world allows)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (1F1B schedule); the rest of the world is dp")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default sp*tp)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=2, help="sequences per data-parallel replica and step")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2, help="blocks; every second one is an MoE block")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-2)
    p.add_argument("--microbatches", type=int, default=2, help="pipeline microbatches (with --pp > 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="parameter/activation dtype (bf16 only on GPU: the interpreter's bf16 dot is wrong)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: NCCL + CUDA when every local rank has a GPU, else gloo + CPU tensors under the "
                        "Triton interpreter")
    return p.parse_args(argv)


def default_layout(world: int, pp: int, tp, sp):
    """``(tp, sp)``: the given sizes, or 2 each where the ranks of one pipeline stage allow."""
    rest = world // pp if world % pp == 0 else world
    if tp is None:
        tp = 2 if rest % 2 == 0 else 1
    if sp is None:
        sp = 2 if rest % (2 * tp) == 0 else 1
    return tp, sp


def synthetic_batch(step: int, batch: int, seq: int, vocab: int, seed: int, device):
    """``batch`` sequences following the fixed permutation from random starts (same on every
    rank for a given step), and their next-token targets."""
    import torch

    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 100003 + step)
    x = torch.empty(batch, seq + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    for t in range(seq):
        x[:, t + 1] = perm[x[:, t]]
    return x[:, :-1].to(device), x[:, 1:].to(device)


def build(args, use_cuda: bool):
    """The parallel layout, the model (this rank's pipeline stage of it) and its config."""
    import torch

    from fusedpar.nn import Transformer, TransformerConfig
    from fusedpar.parallel import init_parallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp, sp = default_layout(world, args.pp, args.tp, args.sp)
    ep = args.ep if args.ep is not None else sp * tp
    state = init_parallel(pp=args.pp, tp=tp, sp=sp, ep=ep, backend="nccl" if use_cuda else "gloo")
    if args.dtype == "bf16" and state.device.type != "cuda":
        raise ValueError("--dtype bf16 needs CUDA (under the interpreter bf16 tl.dot is wrong)")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    config = TransformerConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
        num_kv_heads=args.heads, ffn_hidden_size=2 * args.hidden, num_experts=args.experts, top_k=args.top_k,
        moe_every=2, sp_mode="ring", layout="zigzag", causal=True,
    )
    if args.layers % args.pp:
        raise ValueError(f"--layers {args.layers} must be divisible by --pp {args.pp}")
    per_stage = args.layers // args.pp
    layers = range(state.pp_rank * per_stage, (state.pp_rank + 1) * per_stage)
    model = Transformer(config, tp_group=state.tp_group, sp_group=state.sp_group, ep_group=state.ep_group,
                        layers=layers, embed=state.is_first_stage, head=state.is_last_stage, seed=args.seed,
                        aux_loss_scale=1.0 / state.tp, device=state.device, dtype=dtype)
    return state, config, model, dtype


def pipeline_schedule(model, state, microbatches: int):
    """A 1F1B schedule over the pipeline stages (``None`` without pipeline parallelism)."""
    if state.pp == 1:
        return None
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage = PipelineStage(model, state.pp_rank, state.pp, state.device, group=state.pp_group)
    return Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=model.loss)


def train_step(step: int, args, state, config, model, schedule, opt, plan):
    """One optimizer step on this step's synthetic batch; returns the global mean loss (the
    same value on every rank)."""
    import torch
    import torch.distributed as dist

    from fusedpar.nn import shard_tokens
    from fusedpar.parallel import sync_gradients

    tokens, targets = synthetic_batch(step, args.batch * state.dp, args.seq, args.vocab, args.seed, state.device)
    rows = slice(state.dp_rank * args.batch, (state.dp_rank + 1) * args.batch)
    ids, tgt = shard_tokens(tokens[rows], targets[rows], sp_size=state.sp, sp_rank=state.sp_rank,
                            tp_size=state.tp, tp_rank=state.tp_rank, layout=config.layout)
    opt.zero_grad(set_to_none=True)
    if schedule is None:
        loss = model.loss(model(ids), tgt)
        loss.backward()
        loss = loss.detach()
    else:
        losses = []
        schedule.step(ids if state.is_first_stage else None, target=tgt, losses=losses)
        loss = torch.stack(losses).mean().detach() if state.is_last_stage else torch.zeros((), device=state.device)
    sync_gradients(model.named_parameters(), state, plan)
    opt.step()
    report = loss.float().reshape(1).clone()
    dist.all_reduce(report, group=state.data_group)
    report /= state.data_size
    if state.device.type == "cuda":
        torch.cuda.synchronize()
    return report.item()


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    use_cuda = _use_cuda(args.device)
    _setup_env(use_cuda)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    state, config, model, dtype = build(args, use_cuda)
    plan = model.gradient_sync_plan()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = pipeline_schedule(model, state, args.microbatches)
    reporter = state.rank == (state.pp - 1) * state.dp * state.sp * state.tp  # last stage, dp/sp/tp rank 0
    if reporter:
        on_gpu = state.device.type == "cuda"
        print(f"fusedpar demo: world {state.world_size} = dp {state.dp} x pp {state.pp} x sp {state.sp} x tp {state.tp}"
              f" (ep {state.ep}); {'NCCL on CUDA' if on_gpu else 'gloo on CPU, Triton interpreter'}; {dtype}; "
              f"{config.num_layers} blocks (MoE every 2nd: {config.num_experts} experts, top-{config.top_k}), "
              f"hidden {config.hidden_size}, vocab {config.vocab_size}, seq {args.seq}, "
              f"{args.batch * state.dp} sequences/step", flush=True)
    first = last = None
    tokens_per_step = args.batch * state.dp * args.seq
    for step in range(args.steps):
        t0 = time.perf_counter()
        last = train_step(step, args, state, config, model, schedule, opt, plan)
        dt = time.perf_counter() - t0
        first = last if first is None else first
        if reporter:
            print(f"step {step + 1:3d}/{args.steps}  loss {last:.4f}  {dt * 1e3:8.1f} ms  "
                  f"{tokens_per_step / dt:10.1f} tokens/s", flush=True)
    if reporter and args.steps > 1:
        print(f"loss {first:.4f} -> {last:.4f} over {args.steps} steps "
              f"({'falling' if last < first else 'NOT falling'})", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
