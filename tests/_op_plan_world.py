"""Run as a script (no GPU, not under the interpreter): the ring schedules' chunk GEMMs launched by
Triton's own compiled-launch path, by their launch plans one GEMM at a time, and replayed as a
whole op (``schedules.ChunkGemms``); the symmetric schedules' persistent GEMM and reduction the
same way (their launches recorded with the schedule's spec, ``symmetric._launch``); with Triton's compiler and the driver replaced by stand-ins
that record every launch (kernel specialisation, grid, stream, arguments). Prints a JSON report per
case; ``tests/test_tensor_parallel_op_plans.py`` reads it."""
import json
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ["FUSEDPAR_TUNE_CONFIGS"] = "1"  # one config per key: nothing to benchmark

import torch  # noqa: E402
import triton  # noqa: E402
import triton.compiler  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import CompiledKernel  # noqa: E402
from triton.runtime import driver  # noqa: E402

LOG: list = []


class FakeKernel(CompiledKernel):
    """A kernel never compiled: its identity is the specialisation Triton asked for; its launcher records."""

    def __init__(self, src, options):
        self.identity = (src.fn.__name__, repr(sorted(src.signature.items())), repr(sorted(src.constants.items())),
                         repr(sorted(src.attrs.items())), options.get("num_warps"), options.get("num_stages"))
        self.function = hash(self.identity)
        self.packed_metadata = ("packed", self.function)
        self.module = object()

    @property
    def run(self):
        return lambda gx, gy, gz, stream, fn, meta, lmeta, enter, exit_, *args: LOG.append(
            (self.identity, (gx, gy, gz), stream, args))

    def launch_metadata(self, grid, stream, *args):
        return None


class FakeDriver:
    def __init__(self):
        self.utils = type("U", (), {"get_device_properties": lambda self, d: {
            "max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}})()

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 7

    def get_device_capability(self, device=None):
        return (9, 0)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise AssertionError("nothing is benchmarked (FUSEDPAR_TUNE_CONFIGS=1)")


triton.compiler.compile = lambda src, target=None, options=None, **kw: FakeKernel(src, options or {})
driver.set_active(FakeDriver())
torch.cuda.get_device_capability = lambda device=None: (9, 0)
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_properties = lambda device=None: type("Props", (), {"multi_processor_count": 132})()

from fusedpar.kernels import checks, launch  # noqa: E402
from fusedpar.ops import all_gather_matmul, matmul_reduce_scatter  # noqa: E402
from fusedpar.ops.comm.transport import EmulatedTransport  # noqa: E402
from fusedpar.ops.tensor_parallel import schedules, symmetric  # noqa: E402

checks.allow_cpu_launches()


def rnd(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def cases():
    """``{name: (inputs, call)}``: one rank of tp 4 emulated, the forwards and a backward."""
    t, tw = EmulatedTransport(4, 1), EmulatedTransport(4, 1, in_kernel_waits=True)
    x, w, b = rnd(12, 64, seed=1), rnd(48, 64, seed=2), rnd(48, seed=3)
    x3, xr, wr = rnd(2, 6, 64, seed=4), rnd(2, 24, 16, seed=5), rnd(48, 16, seed=6)
    xm = rnd(2, 24, 24, seed=7)
    xm, xa = xm[..., 3:19], xm[..., 8:24]  # the same shapes and strides at two alignments: one op plan each

    def backward(x, w, b):
        y = all_gather_matmul(x.requires_grad_(), w.requires_grad_(), b, gather_dim=0, transport=t, activation="gelu")
        y.backward(torch.ones_like(y))
        x.grad = w.grad = None
    return {
        "ag_gelu_bias": ((x, w, b), lambda x, w, b: all_gather_matmul(x, w, b, gather_dim=0, transport=t,
                                                                      activation="gelu")),
        "ag_seq_dim": ((x3, w), lambda x, w: all_gather_matmul(x, w, gather_dim=1, transport=t)),
        "rs_misaligned": ((xm, wr), lambda x, w: matmul_reduce_scatter(x, w, scatter_dim=1, transport=t)),
        "rs_aligned_same_shape": ((xa, wr), lambda x, w: matmul_reduce_scatter(x, w, scatter_dim=1, transport=t)),
        "rs_bias": ((xr, wr, b), lambda x, w, b: matmul_reduce_scatter(x, w, b, scatter_dim=1, transport=t)),
        "rs_fp16_partials": ((xr, wr), lambda x, w: matmul_reduce_scatter(x, w, scatter_dim=1, transport=t,
                                                                          partial_dtype=None)),
        "ag_backward": ((x.clone(), w.clone(), b), backward),
        "ag_waits_gelu_bias": ((x, w, b), lambda x, w, b: all_gather_matmul(x, w, b, gather_dim=0, transport=tw,
                                                                            activation="gelu")),
        "ag_waits_seq_dim": ((x3, w), lambda x, w: all_gather_matmul(x, w, gather_dim=1, transport=tw)),
        "rs_waits_misaligned": ((xm, wr), lambda x, w: matmul_reduce_scatter(x, w, scatter_dim=1, transport=tw)),
        "rs_waits_aligned_same_shape": ((xa, wr), lambda x, w: matmul_reduce_scatter(x, w, scatter_dim=1,
                                                                                     transport=tw)),
        "rs_waits_bias": ((xr, wr, b), lambda x, w, b: matmul_reduce_scatter(x, w, b, scatter_dim=1, transport=tw)),
    }


def record(inputs, fn):
    """The launches of one call, tensors named: an input by position and offset, anything else by
    shape, strides, dtype and address mod 16."""
    LOG.clear()
    fn(*inputs)
    ids = {id(t): i for i, t in enumerate(inputs)}
    out = []
    for identity, grid, stream, args in LOG:
        named = [("input", ids[id(v)]) if id(v) in ids else
                 ("tensor", tuple(v.shape), v.stride(), str(v.dtype), v.data_ptr() % 16) if isinstance(v, torch.Tensor)
                 else (type(v).__name__, repr(v)) for v in args]
        out.append((identity, grid, stream, named))
    return out


def main():
    report = {}
    calls = [0]  # launcher calls (a chunk GEMM's matmul_checked, a symmetric schedule's launchers)

    def counting(real):
        def launcher(*args, **kwargs):
            calls[0] += 1
            return real(*args, **kwargs)
        return launcher

    schedules.matmul_checked = counting(schedules.matmul_checked)
    symmetric.persistent_matmul = counting(symmetric.persistent_matmul)
    symmetric.chunk_reduce = counting(symmetric.chunk_reduce)
    table = cases()
    triton_path, per_gemm = {}, {}
    for name, (inputs, fn) in table.items():
        launch.clear_plans()
        triton_path[name] = record(inputs, fn)  # every GEMM through Triton's path
        fn(*inputs)  # builds the per-GEMM plans
        per_gemm[name] = record(inputs, fn)  # every GEMM by its own plan: the call is recorded as one op
    launch.clear_plans()
    for _ in range(3):  # the plans of every case at once: an op key coarser than its GEMMs' keys would mix them
        for inputs, fn in table.values():
            fn(*inputs)
    for name, (inputs, fn) in table.items():
        calls[0] = 0
        replayed = record(inputs, fn)
        report[name] = {"launches": len(triton_path[name]), "per_gemm_same": per_gemm[name] == triton_path[name],
                        "replayed_same": replayed == triton_path[name], "checked_calls_in_replay": calls[0]}
    report["op_plans"] = len(schedules._OP_PLANS)
    print(json.dumps(report))


if __name__ == "__main__":
    sys.exit(main())
