"""Train a small fusedpar Transformer on real text with every kind of parallelism the world
allows: tensor parallelism (fused all-gather / reduce-scatter GEMMs), sequence-parallel ring
attention, expert-parallel MoE, and data or pipeline parallelism on top; with validation, metrics,
checkpoints that resume exactly (at any layout) and recovery from a rank failure under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 4 -m fusedpar.demo

On a machine without CUDA it runs on CPU tensors under Triton's interpreter (gloo); with CUDA,
compiled kernels on NCCL (one GPU per rank). The layout defaults to tp=2, sp=2 when the world
has 4 ranks per data/pipeline replica (the rest becomes dp, or pp with ``--pp``); experts are
split over the sp x tp ranks (``--ep``). The data (:mod:`fusedpar.data`): byte-level text from
``--data`` (a file or a directory), by default the Python standard library's sources (no
download), or pre-tokenized ``.bin`` ids with ``--vocab``; the last ``--val-fraction`` is held out
and the validation loss is reported against the unigram baseline (the validation loss of a
context-free model fitted to the training split).

With ``--ckpt-dir`` the run saves every ``--save-every`` steps (model, optimizer, LR schedule,
data position, step, every rank's RNG state) and, when the directory already holds a
checkpoint, resumes from the newest complete one, continuing with the losses the uninterrupted
run would have had. ``--simulate-failure STEP`` makes rank 1 fail at that step on the first
attempt only (``TORCHELASTIC_RESTART_COUNT`` 0): under ``torchrun --max-restarts 1`` the restarted
workers resume from the last checkpoint.
"""
from __future__ import annotations

import argparse
import json
import math
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
        raise UsageError(f"--device cuda needs one GPU per local rank ({local_world}), "
                         f"got {torch.cuda.device_count()} GPUs")
    return usable


def _setup_env(use_cuda: bool):
    # the interpreter must be chosen before triton is imported (fusedpar.kernels imports it); once
    # triton is imported (main() called in a process that already uses it, e.g. a GPU test worker)
    # the choice is made, and setting the variable would only leak into later child processes
    if not use_cuda and "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"


class UsageError(SystemExit):
    """A user mistake on the command line or in what it names (data, checkpoint directory, sizes
    that do not fit the world): :func:`main` prints its one line on rank 0 and returns its code 2
    (no traceback; ``--debug`` keeps it). A ``SystemExit`` so that a caller of :func:`parse_args`
    sees what argparse raises."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self):
        return self.message


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print usage on every rank and exit
        raise UsageError(message)


def parse_args(argv):
    """The command line (``python -m fusedpar.demo --help``); :class:`UsageError` names a bad option."""
    p = _Parser(prog="python -m fusedpar.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default 2 when the world allows)")
    p.add_argument("--sp", type=int, default=None, help="sequence-parallel (ring attention) size (default 2 when "
                   "the world allows)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (1F1B schedule); the rest of the world is dp")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size (default sp*tp)")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps in all (a resumed run counts its past ones)")
    p.add_argument("--batch", type=int, default=4, help="sequences per data-parallel replica and step")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--data", default=None, help="a text file, a directory of text files (byte-level, vocab 256) or "
                   "a .bin of pre-tokenized ids (uint16, uint32 above 65536 ids; needs --vocab); default: the Python "
                   "standard library's sources")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary of a .bin token file (text: 256)")
    p.add_argument("--max-bytes", type=int, default=4 << 20, help="read at most this many bytes of text")
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of the tokens held out for validation")
    p.add_argument("--eval-every", type=int, default=4, help="validation loss every N steps (and at the last)")
    p.add_argument("--eval-batches", type=int, default=2, help="global batches per validation")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2, help="blocks; every second one is an MoE block")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--router-score", choices=["softmax", "sigmoid"], default="softmax",
                   help="router score function (sigmoid: DeepSeek-V3 style, weights renormalised)")
    p.add_argument("--bias-update-rate", type=float, default=0.0,
                   help="auxiliary-loss-free balancing: per-expert selection bias moved by this much per step")
    p.add_argument("--seq-aux-coef", type=float, default=0.0, help="DeepSeek-V3 sequence-wise balance loss weight")
    p.add_argument("--lr", type=float, default=2e-2, help="peak learning rate (linear warm-up, cosine decay)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps")
    p.add_argument("--microbatches", type=int, default=2, help="pipeline microbatches (with --pp > 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: bf16 parameters and activations, fp32 master weights, gradient reductions and "
                        "optimizer")
    p.add_argument("--fp8", choices=["rowwise", "blockwise"], default=None,
                   help="the blocks' tensor-parallel projections and MoE experts in fp8 (e4m3) forward and "
                        "backward, with this scaling recipe (a compute format: --dtype still sets parameters and "
                        "activations); needs fp8 tensor cores on a GPU (compute capability >= 8.9)")
    p.add_argument("--ckpt-dir", default=None, help="save checkpoints here; resume from the newest complete one")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps (and at the end); 0: only at "
                   "the end (with --ckpt-dir)")
    p.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    p.add_argument("--simulate-failure", type=int, default=None, metavar="STEP",
                   help="rank 1 raises at step STEP on the first attempt (TORCHELASTIC_RESTART_COUNT 0)")
    p.add_argument("--metrics", default=None, help="write one JSON line per step to this file")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: NCCL + CUDA when every local rank has a GPU, else gloo + CPU tensors under the "
                        "Triton interpreter")
    p.add_argument("--debug", action="store_true", help="on a user error, show the traceback too")
    args = p.parse_args(argv)
    check_args(args)
    return args


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_args(args) -> None:
    """The options' own ranges (no world needed); :class:`UsageError` naming the option."""
    for name in ("steps", "batch", "seq", "eval_every", "eval_batches", "keep", "max_bytes", "hidden", "heads",
                 "layers", "experts", "top_k", "microbatches", "pp", "tp", "sp", "ep", "vocab"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise UsageError(f"{_option(name)} must be positive, got {value}")
    for name in ("save_every", "warmup"):
        if getattr(args, name) < 0:
            raise UsageError(f"{_option(name)} must be >= 0, got {getattr(args, name)}")
    if not 0.0 < args.val_fraction < 1.0:
        raise UsageError(f"--val-fraction must be in (0, 1), got {args.val_fraction}")
    if not args.lr > 0:
        raise UsageError(f"--lr must be positive, got {args.lr}")
    for name in ("bias_update_rate", "seq_aux_coef"):
        if not getattr(args, name) >= 0:
            raise UsageError(f"{_option(name)} must be >= 0, got {getattr(args, name)}")
    if args.pp > 1 and args.batch % args.microbatches:
        raise UsageError(f"--batch must be a multiple of --microbatches ({args.microbatches}) with --pp > 1, "
                         f"got {args.batch}")
    if args.top_k > args.experts:
        raise UsageError(f"--top-k must be <= --experts ({args.experts}), got {args.top_k}")
    if args.hidden % args.heads or (args.hidden // args.heads) % 2:
        raise UsageError(f"--hidden must be a multiple of --heads ({args.heads}) with an even head size, "
                         f"got {args.hidden}")
    if (args.save_every or args.simulate_failure is not None) and not args.ckpt_dir:
        raise UsageError(f"--save-every and --simulate-failure need --ckpt-dir, got --save-every {args.save_every}"
                         f" and --simulate-failure {args.simulate_failure} without it")
    if args.ckpt_dir:
        check_ckpt_dir(args.ckpt_dir)


def check_ckpt_dir(path: str) -> None:
    """``--ckpt-dir``: a directory this process can read and write, or one it can create."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise UsageError(f"--ckpt-dir must be a directory, got {path!r} (a file)")
        if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
            raise UsageError(f"--ckpt-dir must be a directory this process can read and write, got {path!r}")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--ckpt-dir must be a directory that can be created, got {path!r} ({parent!r} is not "
                         "a writable directory)")


def check_layout(args, world: int, tp: int, sp: int, ep: int) -> None:
    """The sizes fit the world and the model (every rank finds the same, before joining the world)."""
    if world % (args.pp * tp * sp):
        raise UsageError(f"--pp {args.pp} x --tp {tp} x --sp {sp} = {args.pp * tp * sp} must divide the world "
                         f"size {world}")
    stage = world // args.pp
    for name, value, n, what in (("--ep", ep, stage, "the ranks of one pipeline stage"),
                                 ("--layers", args.pp, args.layers, "--layers"),
                                 ("--tp", tp, args.heads, "--heads"), ("--ep", ep, args.experts, "--experts")):
        if n % value:
            raise UsageError(f"{name} {value} must divide {what} ({n})" if name != "--layers" else
                             f"--layers must be divisible by --pp {args.pp}, got {args.layers}")
    need = sp * tp if sp == 1 else math.lcm(2 * sp, sp * tp)  # zigzag: 2 chunks per sp rank, then tp pieces
    if args.seq % need:
        raise UsageError(f"--seq must be divisible by {need} (--sp {sp}, --tp {tp}, zigzag layout), got {args.seq}")

def default_layout(world: int, pp: int, tp, sp):
    """``(tp, sp)``: the given sizes, or 2 each where the ranks of one pipeline stage allow."""
    rest = world // pp if world % pp == 0 else world
    if tp is None:
        tp = 2 if rest % 2 == 0 else 1
    if sp is None:
        sp = 2 if rest % (2 * tp) == 0 else 1
    return tp, sp


def build(args, use_cuda: bool, vocab: int):
    """The parallel layout, the model (this rank's pipeline stage of it) and its config."""
    import torch

    from fusedpar.kernels.fp8 import FP8UnsupportedError, check_fp8_device
    from fusedpar.nn import Transformer, TransformerConfig
    from fusedpar.parallel import init_parallel

    import torch.distributed as dist

    # the world joined already (a caller's), else the one torchrun describes
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    tp, sp = default_layout(world, args.pp, args.tp, args.sp)
    ep = args.ep if args.ep is not None else sp * tp
    check_layout(args, world, tp, sp, ep)
    state = init_parallel(pp=args.pp, tp=tp, sp=sp, ep=ep, backend="nccl" if use_cuda else "gloo")
    if args.fp8 is not None:  # an old GPU is the user's mistake: one line naming the device and --fp8
        try:
            check_fp8_device(torch.empty(0, device=state.device), option=f"--fp8 {args.fp8}")
        except FP8UnsupportedError as e:
            raise UsageError(str(e)) from e
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    config = TransformerConfig(
        vocab_size=vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
        num_kv_heads=args.heads, ffn_hidden_size=2 * args.hidden, num_experts=args.experts, top_k=args.top_k,
        moe_every=2, sp_mode="ring", layout="zigzag", causal=True, score_func=args.router_score,
        bias_update_rate=args.bias_update_rate, seq_aux_loss_coef=args.seq_aux_coef, fp8=args.fp8,
    )
    per_stage = args.layers // args.pp
    layers = range(state.pp_rank * per_stage, (state.pp_rank + 1) * per_stage)
    model = Transformer(config, tp_group=state.tp_group, sp_group=state.sp_group, ep_group=state.ep_group,
                        layers=layers, embed=state.is_first_stage, head=state.is_last_stage, seed=args.seed,
                        aux_loss_scale=1.0 / state.tp, device=state.device, dtype=dtype,
                        return_hidden=True)  # the loss fuses the head: no logits in training
    return state, config, model, dtype


def pipeline_schedule(model, state, args):
    """A 1F1B schedule over the pipeline stages (``None`` without pipeline parallelism); the
    stages' shapes are given, so no shape-inference pass runs the blocks on uninitialised memory."""
    if state.pp == 1:
        return None
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    inputs, outputs = model.pipeline_args(args.batch // args.microbatches, args.seq)
    stage = PipelineStage(model, state.pp_rank, state.pp, state.device, input_args=inputs, output_args=outputs,
                          group=state.pp_group)
    return Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=model.loss)


def load_data(args, state, tokens):
    """``(training loader, validation loader, unigram baseline)`` of ``tokens`` for this rank;
    the baseline is that of exactly the validation targets every evaluation reads."""
    import numpy as np

    from fusedpar.data import BatchLoader, split, unigram_baseline

    train, val = split(tokens, args.val_fraction, args.seq)
    kw = dict(dp=state.dp, dp_rank=state.dp_rank, seed=args.seed)
    evaluated = BatchLoader(val, args.seq, args.batch * state.dp, seed=args.seed)
    targets = np.concatenate([y.numpy().ravel() for _, y in evaluated.eval_batches(args.eval_batches)])
    return (BatchLoader(train, args.seq, args.batch, **kw), BatchLoader(val, args.seq, args.batch, **kw),
            unigram_baseline(train, targets, tokens.vocab))


def lr_at(step: int, args) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, cosine decay to 10%."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))


class MasterWeights:
    """What the optimizer updates: the parameters themselves (fp32), or fp32 master copies of
    bf16 parameters, whose gradients are the bf16 ones upcast before the (fp32) reductions."""

    def __init__(self, model):
        import torch

        self.model = model
        self.params = dict(model.named_parameters())
        self.mixed = any(p.dtype != torch.float32 for p in self.params.values())
        self.tensors = ({n: p.detach().float().clone() for n, p in self.params.items()} if self.mixed
                        else self.params)

    def grads_to_master(self) -> None:
        if self.mixed:
            for n, p in self.params.items():
                self.tensors[n].grad = None if p.grad is None else p.grad.float()

    def master_to_model(self) -> None:
        import torch

        if self.mixed:
            with torch.no_grad():
                for n, p in self.params.items():
                    p.copy_(self.tensors[n])


def forward_loss(ids, tgt, state, model, schedule, train: bool):
    """This rank's loss on one batch (a pipeline stage that holds no loss: 0); backward when training."""
    import torch

    if schedule is None:
        loss = model.loss(model(ids), tgt)
        if train:
            loss.backward()
        return loss.detach().float()
    losses = []
    run = schedule.step if train else schedule.eval
    # later stages pass no input at all: torch 2.11 reads a positional None as an input
    run(*((ids,) if state.is_first_stage else ()), target=tgt, losses=losses)
    return torch.stack(losses).mean().detach().float() if state.is_last_stage else torch.zeros((), device=state.device)


def global_mean(value, state) -> float:
    """Mean of a per-rank loss over the loss-holding ranks (the same value on every rank)."""
    import torch.distributed as dist

    report = value.reshape(1).clone()
    dist.all_reduce(report, group=state.data_group)
    return (report / state.data_size).item()


def local_rows(loader_batch, state, config):
    from fusedpar.nn import shard_tokens

    tokens, targets = loader_batch
    ids, tgt = shard_tokens(tokens, targets, sp_size=state.sp, sp_rank=state.sp_rank, tp_size=state.tp,
                            tp_rank=state.tp_rank, layout=config.layout)
    return ids.to(state.device), tgt.to(state.device)


def train_step(step: int, run) -> float:
    """Optimizer step ``step`` (0-based) on the loader's next batch; the global mean loss."""
    from fusedpar.parallel import sync_gradients

    for group in run.opt.param_groups:
        group["lr"] = lr_at(step, run.args)
    ids, tgt = local_rows(run.train.next_batch(), run.state, run.config)
    run.opt.zero_grad(set_to_none=True)
    run.model.zero_grad(set_to_none=True)
    loss = forward_loss(ids, tgt, run.state, run.model, run.schedule, train=True)
    run.master.grads_to_master()
    sync_gradients(run.master.tensors.items(), run.state, run.plan)
    run.opt.step()
    run.master.master_to_model()
    # the step's per-expert counts summed over this stage's ranks; the routers' bias update
    run.router_loads = run.model.update_router_bias(run.state.data_tp_group)
    return global_mean(loss, run.state)


def evaluate(run) -> float:
    """Mean validation loss over ``--eval-batches`` fixed global batches."""
    import torch

    total = 0.0
    with torch.no_grad():
        for batch in run.val.eval_batches(run.args.eval_batches):
            ids, tgt = local_rows(batch, run.state, run.config)
            total += global_mean(forward_loss(ids, tgt, run.state, run.model, run.schedule, train=False), run.state)
    return total / run.args.eval_batches


class Run:
    """Everything one training run holds (built by :func:`setup`)."""

    def __init__(self, **parts):
        self.__dict__.update(parts)


def checkpoint_extra(run, step: int):
    """``(extra tensors, optional keys)`` a checkpoint holds besides model and optimizer: step,
    data position and fingerprint, LR schedule, this rank's RNG states (optional: a run resumed at
    another world size has other ranks)."""
    import torch

    extra = {"step": torch.tensor(step, dtype=torch.int64),
             "data.position": torch.tensor(run.train.position, dtype=torch.int64),
             "data.fingerprint": torch.tensor(run.tokens.fingerprint(), dtype=torch.int64),
             "schedule": torch.tensor([run.args.lr, run.args.warmup, run.args.steps], dtype=torch.float64),
             f"rng.cpu.rank{run.state.rank}": torch.get_rng_state()}
    if run.state.device.type == "cuda":
        extra[f"rng.cuda.rank{run.state.rank}"] = torch.cuda.get_rng_state()
    return extra, tuple(k for k in extra if k.startswith("rng."))


def save_checkpoint(run, step: int) -> None:
    extra, _ = checkpoint_extra(run, step)
    path = run.ckpt.save(step, run.model, optimizer=run.opt, params=run.master.tensors if run.master.mixed else None,
                         extra=extra)
    run.say(f"[checkpoint] saved {path}")


def resume(run) -> int:
    """Load the newest complete checkpoint of ``--ckpt-dir`` (if any); the step to continue from."""
    import torch

    if run.ckpt is None:
        return 0
    extra, optional = checkpoint_extra(run, 0)
    step, loaded = run.ckpt.resume(run.model, optimizer=run.opt, extra=extra, optional=optional,
                                   params=run.master.tensors if run.master.mixed else None)
    if step is None:
        return 0
    run.train.position = int(extra["data.position"])
    if int(extra["data.fingerprint"]) != run.tokens.fingerprint():
        run.say("[checkpoint] WARNING: the checkpoint was trained on other data than --data gives now")
    if extra["schedule"].tolist() != [run.args.lr, run.args.warmup, run.args.steps]:
        run.say(f"[checkpoint] note: LR schedule (lr, warmup, steps) was {extra['schedule'].tolist()}, now "
                f"{[run.args.lr, run.args.warmup, run.args.steps]}")
    if set(optional) <= loaded:
        torch.set_rng_state(extra[f"rng.cpu.rank{run.state.rank}"])
        if run.state.device.type == "cuda":
            torch.cuda.set_rng_state(extra[f"rng.cuda.rank{run.state.rank}"])
    else:
        run.say("[checkpoint] RNG states not restored: the checkpoint was saved at another world size")
    run.master.master_to_model()
    return int(extra["step"])


def open_metrics(path: str | None, resumed: int):
    """The metrics file, holding only the lines of steps up to ``resumed`` (a restarted run
    rewrites the steps it repeats)."""
    if path is None:
        return None
    kept = []
    if resumed and os.path.exists(path):
        with open(path) as f:
            kept = [ln for ln in f if ln.strip() and json.loads(ln).get("step", 0) <= resumed]
    f = open(path, "w")
    f.writelines(kept)
    f.flush()
    return f


def setup(args, use_cuda: bool):
    """Data, model, optimizer, schedule and checkpoint manager of this rank."""
    import torch

    from fusedpar.checkpoint import CheckpointManager
    from fusedpar.data import load_tokens

    tokens = load_tokens(args.data, args.vocab, args.max_bytes)
    state, config, model, dtype = build(args, use_cuda, tokens.vocab)
    train, val, baseline = load_data(args, state, tokens)
    master = MasterWeights(model)
    reporter = state.rank == (state.pp - 1) * state.dp * state.sp * state.tp  # last stage, dp/sp/tp rank 0

    def say(msg):
        if reporter:
            print(msg, flush=True)

    run = Run(args=args, state=state, config=config, model=model, dtype=dtype, plan=model.gradient_sync_plan(),
              master=master, opt=torch.optim.AdamW(list(master.tensors.values()), lr=args.lr, weight_decay=0.0),
              schedule=pipeline_schedule(model, state, args), tokens=tokens, train=train, val=val,
              baseline=baseline, reporter=reporter, say=say)
    rank0 = print if state.rank == 0 else (lambda *a, **k: None)
    run.ckpt = CheckpointManager(args.ckpt_dir, args.keep, log=lambda m: rank0(m, flush=True)) if args.ckpt_dir else None
    return run


def describe(run) -> str:
    s, c, a = run.state, run.config, run.args
    on_gpu = s.device.type == "cuda"
    return (f"fusedpar demo: world {s.world_size} = dp {s.dp} x pp {s.pp} x sp {s.sp} x tp {s.tp} (ep {s.ep}); "
            f"{'NCCL on CUDA' if on_gpu else 'gloo on CPU, Triton interpreter'}; {run.dtype}"
            f"{'' if c.fp8 is None else f', fp8 {c.fp8} projections and experts'}; {c.num_layers} blocks "
            f"(MoE every 2nd: {c.num_experts} experts, top-{c.top_k}), hidden {c.hidden_size}, vocab {c.vocab_size}, "
            f"seq {a.seq}, {a.batch * s.dp} sequences/step\n"
            f"data: {run.tokens.source}: {len(run.train.ids)} training / {len(run.val.ids)} validation tokens; "
            f"unigram baseline {run.baseline:.4f} nats/token (the evaluated tokens under "
            f"the training unigram distribution; uniform: ln {c.vocab_size} = {math.log(c.vocab_size):.4f})")


def router_record(loads: dict) -> dict:
    """``{layer: {"counts": [...], "max_violation": v}}`` of :meth:`Transformer.update_router_bias`."""
    return {name: {"counts": load.counts.tolist(), "max_violation": round(load.max_violation, 4)}
            for name, load in loads.items()}


def log_step(run, rec: dict, metrics) -> None:
    val = f"  val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
    load = "".join(f"  layer {name.split('.')[-1]} load {r['counts']} maxvio {r['max_violation']:.2f}"
                   for name, r in rec.get("router", {}).items())
    run.say(f"step {rec['step']:4d}/{run.args.steps}  loss {rec['loss']:.4f}{val}  lr {rec['lr']:.2e}  "
            f"{rec['tokens_per_s']:9.1f} tokens/s  {rec['elapsed_s']:8.1f} s{load}")
    if metrics is not None:
        metrics.write(json.dumps(rec) + "\n")
        metrics.flush()


def summary(run, first: dict | None, last: dict | None, val: float | None, tokens: int, seconds: float) -> None:
    if last is None:
        run.say(f"nothing to do: the checkpoint is at step {run.args.steps} of {run.args.steps}")
        return
    verdict = "" if val is None else (f", val loss {val:.4f}: " + ("BELOW" if val < run.baseline else "NOT below") +
                                      f" the unigram baseline {run.baseline:.4f}")
    run.say(f"summary: train loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} "
            f"(step {last['step']}){verdict}; {tokens / max(seconds, 1e-9):.1f} tokens/s over "
            f"{last['step'] - first['step'] + 1} steps")


def main(argv=None) -> int:
    """Run the demo; a user mistake (:class:`UsageError`, a bad ``--data`` source, a checkpoint
    directory that does not fit the model) prints one line on rank 0 and returns 2, on every rank
    (``--debug``: raise it with its traceback)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _run(parse_args(argv))
    except (Exception, UsageError) as e:  # noqa: BLE001 - only user errors are caught, the rest re-raised
        if "--debug" in argv or not _is_user_error(e):
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"fusedpar.demo: error: {_one_line(e)}", file=sys.stderr, flush=True)
        _leave_world()
        return 2


def _is_user_error(e: BaseException) -> bool:
    from fusedpar.data import DataError

    if isinstance(e, (UsageError, DataError)):
        return True
    from fusedpar.checkpoint import CheckpointError

    return isinstance(e, CheckpointError)


def _one_line(e: BaseException) -> str:
    from fusedpar.checkpoint import CheckpointError

    msg = " ".join(str(e).split())
    return f"--ckpt-dir: {msg}" if isinstance(e, CheckpointError) else msg


def _leave_world() -> None:
    """Leave the process group after a user error (every rank found the same), so that an
    in-process caller is back where it started."""
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _run(args) -> int:
    use_cuda = _use_cuda(args.device)
    _setup_env(use_cuda)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.simulate_failure is not None and int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise UsageError("--simulate-failure fails rank 1: it needs at least 2 ranks, got a world of 1")
    run = setup(args, use_cuda)
    run.say(describe(run))
    start = resume(run)
    metrics = open_metrics(args.metrics, start) if run.reporter else None
    t_start, tokens, first, last, val = time.perf_counter(), 0, None, None, None
    per_step = args.batch * run.state.dp * args.seq
    for step in range(start, args.steps):
        if (step + 1 == args.simulate_failure and run.state.rank == 1
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            raise RuntimeError(f"simulated failure of rank 1 at step {step + 1} (--simulate-failure)")
        t0 = time.perf_counter()
        rec = {"step": step + 1, "loss": train_step(step, run), "lr": lr_at(step, args)}
        dt = time.perf_counter() - t0
        tokens += per_step
        rec.update(tokens_per_s=per_step / dt, elapsed_s=time.perf_counter() - t_start)
        rec["router"] = router_record(getattr(run, "router_loads", {}))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            rec["val_loss"] = val = evaluate(run)
        log_step(run, rec, metrics)
        first, last = first or rec, rec
        if run.ckpt is not None and ((args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps):
            save_checkpoint(run, step + 1)
    summary(run, first, last, val, tokens, time.perf_counter() - t_start)
    if metrics is not None:
        metrics.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
