"""Triton's real compiled-launch path on a machine without a GPU, for measuring host cost per call.

Everything but the GPU is real: kernels are compiled for sm_90 (ptxas, from Triton's wheel),
Triton's driver module (``driver.c``: ``load_binary``, the generic ``launch``) is built by Triton
itself, against a stand-in ``libcuda.so.1`` built here from :data:`STUB_SOURCE` whose driver
calls return success at once (``cuLaunchKernelEx`` counts its calls). CPU tensors stand for device
tensors: their ``data_ptr()`` is an address the stub accepts and nothing reads. Outputs are
garbage; this measures the host's work per call and nothing else.

Use it in a fresh process before ``triton`` is imported (:func:`activate`):
``python -m benchmarks launch --stub-driver`` runs ``benchmarks._stub_launch`` so.
"""
from __future__ import annotations

import ctypes
import os
import subprocess

STUB_SOURCE = r"""
#include <stddef.h>
#include <stdint.h>
typedef int CUresult;
unsigned long long fusedpar_stub_launches = 0;
static int ctx_handle, module_handle, function_handle;
CUresult cuInit(unsigned flags) { return 0; }
CUresult cuDriverGetVersion(int *v) { *v = 13000; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDeviceGet(int *d, int ordinal) { *d = ordinal; return 0; }
CUresult cuGetErrorString(CUresult e, const char **s) { *s = "stub driver"; return 0; }
CUresult cuCtxGetCurrent(void **c) { *c = &ctx_handle; return 0; }
CUresult cuCtxSetCurrent(void *c) { return 0; }
CUresult cuCtxGetDevice(int *d) { *d = 0; return 0; }
CUresult cuCtxGetLimit(size_t *v, int limit) { *v = 0; return 0; }
CUresult cuCtxSetLimit(int limit, size_t v) { return 0; }
CUresult cuDevicePrimaryCtxRetain(void **c, int d) { *c = &ctx_handle; return 0; }
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) {
  switch (attr) {               /* an H100 SXM */
    case 1: *v = 1024; break;   /* max threads per block */
    case 10: *v = 32; break;    /* warp size */
    case 12: *v = 65536; break; /* registers per block */
    case 13: *v = 1980000; break;
    case 16: *v = 132; break;   /* SMs */
    case 36: *v = 2619000; break;
    case 37: *v = 5120; break;
    case 75: *v = 9; break;     /* compute capability */
    case 76: *v = 0; break;
    case 81: *v = 233472; break; /* shared memory per SM */
    case 97: *v = 232448; break; /* shared memory per block, opt-in */
    default: *v = 0;
  }
  return 0;
}
CUresult cuModuleLoadData(void **m, const void *image) { *m = &module_handle; return 0; }
CUresult cuModuleUnload(void *m) { return 0; }
CUresult cuModuleGetFunction(void **f, void *m, const char *name) { *f = &function_handle; return 0; }
CUresult cuFuncGetAttribute(int *v, int attr, void *f) {
  *v = attr == 0 ? 1024 : attr == 4 ? 128 : 0; /* max threads, registers; no spills, no static smem */
  return 0;
}
CUresult cuFuncSetAttribute(void *f, int attr, int v) { return 0; }
CUresult cuFuncSetCacheConfig(void *f, int config) { return 0; }
CUresult cuPointerGetAttribute(void *data, int attr, unsigned long long ptr) {
  *(unsigned long long *)data = ptr; return 0;
}
CUresult cuPointerGetAttributes(unsigned n, int *attrs, void **data, unsigned long long ptr) { return 0; }
CUresult cuStreamIsCapturing(void *stream, int *status) { *status = 0; return 0; }
CUresult cuOccupancyMaxActiveClusters(int *n, void *f, const void *config) { *n = 1; return 0; }
CUresult cuLaunchKernelEx(const void *config, void *f, void **params, void **extra) {
  fusedpar_stub_launches++; return 0;
}
CUresult cuTensorMapEncodeTiled(void *map, ...) { return 0; }
CUresult cuTensorMapEncodeIm2col(void *map, ...) { return 0; }
"""


def cache_dir() -> str:
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(home, "fusedpar", "stub_driver")


def build_stub(folder: str) -> str:
    """``folder/libcuda.so.1`` from :data:`STUB_SOURCE` (rebuilt when the source changes)."""
    os.makedirs(folder, exist_ok=True)
    lib, src = os.path.join(folder, "libcuda.so.1"), os.path.join(folder, "stubcuda.c")
    if not (os.path.exists(lib) and os.path.exists(src) and open(src).read() == STUB_SOURCE):
        with open(src, "w") as f:
            f.write(STUB_SOURCE)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", lib, src], check=True)
        link = os.path.join(folder, "libcuda.so")
        if not os.path.exists(link):
            os.symlink("libcuda.so.1", link)
    return lib


def activate():
    """Build the stub, point Triton at it and make the stub driver Triton's active driver; returns
    a function giving the number of kernel launches the stub has seen. Call before anything imports
    ``triton`` (the interpreter must be off)."""
    folder = cache_dir()
    lib = build_stub(folder)
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_LIBCUDA_PATH"] = folder
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(folder, "triton_cache"))
    os.environ.setdefault("FUSEDPAR_TUNE_CONFIGS", "1")  # one config per key: nothing is benchmarked
    stub = ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)

    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime import driver

    class StubDriver(CudaDriver):
        """Triton's CUDA driver over the stub; device and stream queries answer device 0, stream 0
        as torch's would (CPU torch has no CUDA runtime to ask)."""

        def __init__(self):
            super().__init__()
            self.get_current_device = lambda: 0
            self.get_current_stream = lambda device=None: 0
            self.get_device_capability = lambda device=None: (9, 0)
            self.set_current_device = lambda device: None

        def get_benchmarker(self):
            # only where FUSEDPAR_TUNE_CONFIGS is set to keep several configs (a lone one is never
            # timed): one call, no timing (triton.testing.do_bench would synchronise CUDA, which
            # CPU torch lacks)
            return lambda kernel_call, quantiles=None, **kwargs: (kernel_call(), [1.0] * len(quantiles or (1,)))[1]

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(StubDriver())
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_properties = lambda device=None: type("Props", (), {"multi_processor_count": 132})()

    from fusedpar.kernels import checks
    checks.allow_cpu_launches()
    return lambda: ctypes.c_ulonglong.in_dll(stub, "fusedpar_stub_launches").value
