"""Triton's NVIDIA launcher on a machine without a GPU: everything down to the driver's launch.

The host-time benchmark (``host_overhead.py``: per call, per launch, instructions) counts
what a GPU host pays for a launch: Triton's ``JITFunction.run`` (binding and specialising
the arguments, the cache key), its compiled C launcher (each argument extracted, each pointer
checked with ``cuPointerGetAttribute``) and the call of ``cuLaunchKernelEx``. Here none of that
needs a GPU: :func:`activate` builds (with the C compiler Triton itself uses) a stand-in
``libcuda.so.1`` from the C source below, whose functions answer as one H100 SXM would (132
SMs, 228 KB of shared memory a multiprocessor, compute capability 9.0) and whose
``cuLaunchKernelEx`` counts the launch and returns: no kernel runs, nothing is written. Triton
is pointed at it (``TRITON_LIBCUDA_PATH``: its C launcher links against it) and given an active
``CudaDriver`` that answers device 0, stream 0 and capability (9, 0) itself, where the stock one
asks ``torch.cuda`` (a CPU build of torch has none). Kernels are compiled for sm_90 on the CPU
(Triton's bundled ptxas) on first use and then come from Triton's cache.

What the stand-in does not count: the driver's own work in each launch (pushing the launch
into the stream, a few us on a real driver) and in ``cuPointerGetAttribute``; and the device
and stream queries ``JITFunction.run`` makes per launch, which here are plain functions where
torch's are ``torch.cuda.current_device`` and ``torch._C._cuda_getCurrentRawStream``.

Call :func:`activate` before ``triton`` is imported (it sets ``TRITON_INTERPRET=0``: the kernels
must be Triton's JIT functions, not the interpreter's).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

H100_SMS = 132
# The bytes of the last launch the stand-in keeps (``Stub.recorded``).
RECORD_BYTES = 4096

# Every driver function Triton's NVIDIA driver (driver.c, its launcher) calls or looks up by
# name, answering as an H100 SXM; ``cuLaunchKernelEx`` counts and returns. Declared through the
# cuda.h Triton ships, so each name is the (versioned) symbol its launcher links against.
STUB_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include "cuda.h"

static uint64_t launches = 0;
static int context = 1, module = 1, function = 1;

uint64_t stub_launches(void) { return launches; }

/* What the last launch handed the driver, for tests: its configuration, function and the
 * bytes of each kernel parameter, whose sizes (which only the kernel's signature knows) the
 * caller gives with stub_record for the next launch. */
static int record_count = 0, record_sizes[256];
static unsigned char record[RECORD_BYTES];
static size_t record_length = 0;

void stub_record(int count, const int *sizes) {
    record_count = count;
    memcpy(record_sizes, sizes, count * sizeof(int));
}

size_t stub_recorded(unsigned char *out) {
    memcpy(out, record, record_length < RECORD_BYTES ? record_length : RECORD_BYTES);
    return record_length;
}

static void append(const void *data, size_t size) {
    if (record_length + size <= RECORD_BYTES) memcpy(record + record_length, data, size);
    record_length += size;
}

CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **params,
                          void **extra) {
    ++launches;
    record_length = 0;
    /* Field by field: a struct's padding holds whatever the caller's stack held. */
    append(&config->gridDimX, sizeof(config->gridDimX));
    append(&config->gridDimY, sizeof(config->gridDimY));
    append(&config->gridDimZ, sizeof(config->gridDimZ));
    append(&config->blockDimX, sizeof(config->blockDimX));
    append(&config->blockDimY, sizeof(config->blockDimY));
    append(&config->blockDimZ, sizeof(config->blockDimZ));
    append(&config->sharedMemBytes, sizeof(config->sharedMemBytes));
    append(&config->hStream, sizeof(config->hStream));
    append(&config->numAttrs, sizeof(config->numAttrs));
    for (unsigned int i = 0; i < config->numAttrs; ++i) {
        append(&config->attrs[i].id, sizeof(config->attrs[i].id));
        /* The largest value Triton's launchers set: a cluster's three dimensions. */
        append(&config->attrs[i].value, 3 * sizeof(unsigned int));
    }
    append(&f, sizeof(f));
    for (int i = 0; i < record_count; ++i) append(params[i], record_sizes[i]);
    record_count = 0;  /* the next launch may be of another kernel */
    return CUDA_SUCCESS;
}

CUresult cuInit(unsigned int flags) { return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int *version) { *version = 12080; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int *count) { *count = 1; return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *device, int ordinal) { *device = ordinal; return CUDA_SUCCESS; }

CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attribute, CUdevice device) {
    switch ((int)attribute) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *value = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *value = 0; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *value = SM_COUNT; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *value = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *value = 227 * 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: *value = 228 * 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: *value = 65536; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = 1024; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: *value = 1980000; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: *value = 2619000; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *value = 5120; break;
    default: *value = 0;
    }
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *ctx) { *ctx = (CUcontext)&context; return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext ctx) { return CUDA_SUCCESS; }
CUresult cuCtxGetDevice(CUdevice *device) { *device = 0; return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device) {
    *ctx = (CUcontext)&context;
    return CUDA_SUCCESS;
}
CUresult cuCtxGetLimit(size_t *value, CUlimit limit) { *value = 1 << 20; return CUDA_SUCCESS; }
CUresult cuCtxSetLimit(CUlimit limit, size_t value) { return CUDA_SUCCESS; }

CUresult cuModuleLoadData(CUmodule *mod, const void *image) {
    *mod = (CUmodule)&module;
    return CUDA_SUCCESS;
}
CUresult cuModuleUnload(CUmodule mod) { return CUDA_SUCCESS; }
CUresult cuModuleGetFunction(CUfunction *f, CUmodule mod, const char *name) {
    *f = (CUfunction)&function;
    return CUDA_SUCCESS;
}
CUresult cuFuncGetAttribute(int *value, CUfunction_attribute attribute, CUfunction f) {
    switch ((int)attribute) {
    case CU_FUNC_ATTRIBUTE_NUM_REGS: *value = 32; break;
    case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *value = 1024; break;
    default: *value = 0;  /* no spills, no static shared memory */
    }
    return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute attribute, int value) {
    return CUDA_SUCCESS;
}
CUresult cuFuncSetCacheConfig(CUfunction f, CUfunc_cache config) { return CUDA_SUCCESS; }

/* The launcher checks each pointer argument this way: every address is a device pointer. */
CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
    if (attribute == CU_POINTER_ATTRIBUTE_DEVICE_POINTER) *(CUdeviceptr *)data = ptr;
    return CUDA_SUCCESS;
}
CUresult cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus *status) {
    *status = CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
}
CUresult cuOccupancyMaxActiveClusters(int *clusters, CUfunction f, const CUlaunchConfig *c) {
    *clusters = 1;
    return CUDA_SUCCESS;
}
CUresult cuGetErrorString(CUresult error, const char **text) {
    *text = "error from the stand-in libcuda of benchmarks/helpers/stub_driver.py";
    return CUDA_SUCCESS;
}
/* Tensor descriptors (TMA): the package's kernels take none. */
CUresult cuTensorMapEncodeTiled(
        CUtensorMap *map, CUtensorMapDataType dtype, cuuint32_t rank, void *address,
        const cuuint64_t *dims, const cuuint64_t *strides, const cuuint32_t *box,
        const cuuint32_t *element_strides, CUtensorMapInterleave interleave,
        CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill fill) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuTensorMapEncodeIm2col(
        CUtensorMap *map, CUtensorMapDataType dtype, cuuint32_t rank, void *address,
        const cuuint64_t *dims, const cuuint64_t *strides, const int *lower, const int *upper,
        cuuint32_t channels, cuuint32_t pixels, const cuuint32_t *element_strides,
        CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
        CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill fill) {
    return CUDA_ERROR_NOT_SUPPORTED;
}
"""


def _triton_dir() -> Path:
    """Triton's package directory, found without importing it (its import must come after
    ``TRITON_INTERPRET`` is set)."""
    import importlib.util

    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        raise SystemExit("the stand-in driver needs triton installed")
    return Path(spec.origin).parent


def build(sm_count: int = H100_SMS) -> Path:
    """The stand-in ``libcuda.so.1``, compiled once per source into a directory under the
    temporary directory named by its hash (the same path run after run, so that Triton's cache
    of its C launcher, keyed by that path, stays valid); returns the library's path."""
    include = _triton_dir() / "backends" / "nvidia" / "include"
    digest = hashlib.sha256(f"{STUB_SOURCE}{sm_count}{RECORD_BYTES}{include}".encode()
                            ).hexdigest()[:16]
    folder = Path(tempfile.gettempdir()) / f"encoding_syncbn-stub-libcuda-{digest}"
    library = folder / "libcuda.so.1"
    if library.exists():
        return library
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise SystemExit("the stand-in driver needs a C compiler (gcc or clang, or CC)")
    folder.mkdir(exist_ok=True)
    building = Path(tempfile.mkdtemp(dir=folder))
    source = building / "stub_libcuda.c"
    source.write_text(STUB_SOURCE)
    built = building / "libcuda.so.1"
    try:
        subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1",
                        f"-DSM_COUNT={sm_count}", f"-DRECORD_BYTES={RECORD_BYTES}",
                        f"-I{include}", str(source), "-o", str(built)], check=True)
        built.replace(library)  # atomic: a concurrent run sees the whole library or none
    finally:
        shutil.rmtree(building)
    return library


class Stub:
    """The active stand-in: ``launches()`` counts ``cuLaunchKernelEx`` calls so far;
    ``record(sizes)`` before a launch, then ``recorded()``, give what it handed the driver."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._library = library
        self._launches = library.stub_launches
        self._launches.restype = ctypes.c_uint64
        library.stub_recorded.restype = ctypes.c_size_t

    def launches(self) -> int:
        return self._launches()

    def record(self, sizes: list[int]) -> None:
        """Record the parameters of the next launch as ``sizes`` bytes each (its kernel's
        parameters as its launcher passes them)."""
        self._library.stub_record(len(sizes), (ctypes.c_int * len(sizes))(*sizes))

    def recorded(self) -> bytes:
        """The last launch's configuration (grid, block, shared memory, stream, attributes),
        function and parameters."""
        out = ctypes.create_string_buffer(RECORD_BYTES)
        length = self._library.stub_recorded(out)
        if length > len(out):
            raise RuntimeError(f"a launch of {length} bytes overflows the stand-in's record")
        return out.raw[:length]


def real_driver_present() -> bool:
    """Whether this machine has a CUDA driver (its device node, or a libcuda the loader finds)."""
    import ctypes.util

    return Path("/dev/nvidiactl").exists() or ctypes.util.find_library("cuda") is not None


def activate(sm_count: int = H100_SMS) -> Stub:
    """Make Triton launch through the stand-in driver in this process (before ``triton`` is
    imported)."""
    if "triton" in sys.modules:
        raise RuntimeError("stub_driver.activate() must run before triton is imported")
    if real_driver_present():
        raise SystemExit(
            "the stand-in driver is for machines without a GPU: this one has a CUDA driver, "
            "whose libcuda.so.1 the process would load beside the stand-in (same soname), so "
            "launches would reach the real driver with stand-in handles. Time the real launcher "
            "with host_profile.py --device cuda instead")
    os.environ["TRITON_INTERPRET"] = "0"
    library_path = build(sm_count)
    os.environ["TRITON_LIBCUDA_PATH"] = str(library_path.parent)
    # Loaded first, globally: the launcher's module, linked against libcuda.so.1, then finds
    # this one by its soname (nothing on the loader's path provides one).
    library = ctypes.CDLL(str(library_path), mode=ctypes.RTLD_GLOBAL)

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime import driver

    target = GPUTarget("cuda", 90, 32)
    cuda = CudaDriver()  # builds Triton's C utilities and launcher against the stand-in
    # What the stock driver asks torch.cuda, answered here: device 0, its default stream.
    cuda.get_current_device = lambda: 0
    cuda.set_current_device = lambda device: None
    cuda.get_current_stream = lambda device=None: 0
    cuda.get_device_capability = lambda device=None: (9, 0)
    cuda.get_current_target = lambda: target
    driver.set_active(cuda)
    return Stub(library)
