"""The host harness of ``host_overhead.py``: the Triton backend on CPU tensors, planned for an
H100 and launched through Triton's own launcher onto the stand-in driver
(``helpers/stub_driver.py``), and the layers it is compared with.

``StubLaunches`` routes the backend's launches there and clears the small-gamma flags no kernel
writes where the layer reads them; ``FloorLayer`` is what any in-place layer's autograd costs
(an empty in-place Function), ``BareLayer`` the backend's three ops and nothing else;
``steps`` times layers chained with ``Link`` between them, each step's input a ``Fresh``
non-leaf tensor;
``CountAten`` counts the ATen ops outside the backend's, ``launch_paths`` the ways its launches
go; ``cache_freed_memory`` makes glibc keep freed blocks, as a GPU's caching allocator does.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import time
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from encoding_syncbn.kernels import GammaCheck, NormParams, RunningStats, key_ops

from .stub_driver import H100_SMS

# glibc's mallopt parameters (malloc.h), and the largest value its C int takes: ctypes
# passes a Python int as a C int, truncating (2**62 arrived as 0: a trim on every free).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_C_INT_MAX = 2**31 - 1


def cache_freed_memory() -> None:
    """Make glibc's malloc behave like a caching allocator for this process: every block from
    its heap (no mmap), nothing given back to the system (no trim), so a block freed by one call
    serves the next as CUDA's caching allocator does."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, _C_INT_MAX)):
        raise SystemExit("glibc's mallopt refused to keep freed blocks (host_overhead.py "
                         "--allocator system leaves glibc as it is)")


class Fresh(torch.autograd.Function):
    """A new uninitialised tensor shaped like ``like``, attached to it (a non-leaf input that
    the in-place layer may overwrite, without the cost of computing one)."""

    @staticmethod
    def forward(ctx, like, channels_last):
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        return torch.empty(like.shape, dtype=like.dtype, memory_format=fmt)

    @staticmethod
    def backward(ctx, grad):
        return None, None  # accumulating into ``like`` would be a full pass


class Link(torch.autograd.Function):
    """Between stacked layers: ``buffer`` (preallocated) as a fresh non-leaf input, attached to
    ``x``; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, x, buffer):
        return buffer.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class EmptyInPlace(torch.autograd.Function):
    """The floor: what the autograd of any in-place layer does, and nothing else."""

    @staticmethod
    def forward(ctx, x, weight, bias, param_grads):
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, weight, bias)
        ctx.param_grads = param_grads
        return x

    @staticmethod
    def backward(ctx, grad):
        _ = ctx.saved_tensors  # unpacked, with its version checks, as every layer's backward
        return grad, *ctx.param_grads, None


class BareOps(torch.autograd.Function):
    """The backend's ops and nothing else: an in-place autograd Function whose forward
    calls ``batch_stats`` (running statistics and the small-gamma check included, as the
    layer's) and ``normalize_act``, and whose backward calls ``batch_backward``: the same
    launches with the same arguments as the layer's, made the same way (``BareLayer.ops``),
    none of its checks, configuration or bookkeeping. Above the floor, what the ops cost;
    below the layer, what the layer's own Python adds."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ops = layer.ops
        mean, invstd, _ = ops.batch_stats(x, layer.eps, layer.running, layer.check)
        params = NormParams(mean, invstd, weight, bias, "leaky_relu", layer.slope)
        ops.normalize_act(x, params, x)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, mean, invstd, weight, bias)
        ctx.layer, ctx.count = layer, x.numel() // x.shape[1]
        return x

    @staticmethod
    def backward(ctx, grad):
        y, mean, invstd, weight, bias = ctx.saved_tensors
        ops = ctx.layer.ops
        params = NormParams(mean, invstd, weight, bias, "leaky_relu", ctx.layer.slope)
        dx, sum_dz, sum_dz_xhat = ops.batch_backward(y, grad, params, True, ctx.count)
        return dx, sum_dz_xhat, sum_dz, None


class BareLayer(torch.nn.Module):
    """``BareOps`` on ``backend``'s ops as the layer's repeat calls of one key run them
    (``kernels.key_ops``: the Triton kernels' eager ops as a ``TrainingStep`` of this layer's
    own, which launches each op's kept launches with the tensors' addresses), not the ops'
    own calls, which build each op's key and look its launches up at every call."""

    def __init__(self, channels: int, backend) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(channels))
        self.bias = torch.nn.Parameter(torch.zeros(channels))
        self.ops, self.eps, self.slope = key_ops(backend), 1e-5, 0.01
        self.running = RunningStats(torch.zeros(channels), torch.ones(channels),
                                    torch.zeros((), dtype=torch.long), 0.1)
        self.check = GammaCheck(self.weight.detach(), self.bias.detach(), 0.016)

    def forward(self, x):
        return BareOps.apply(x, self.weight, self.bias, self)


class FloorLayer(torch.nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(channels))
        self.bias = torch.nn.Parameter(torch.zeros(channels))
        self.param_grads = (torch.zeros(channels), torch.zeros(channels))

    def forward(self, x):
        return EmptyInPlace.apply(x, self.weight, self.bias, self.param_grads)


class CountAten(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "encoding_syncbn":
            self.ops += 1
        return func(*args, **(kwargs or {}))


# The Triton backend's launch functions, each a way a launch goes: ``Launch``es (``_run``), an
# op's prepared launches with its tensors (``launch_prepared``), and those with each tensor as
# its address (``launch_direct``: a layer key's ``TrainingStep``). None calls another of them
# through the ops module: a wrapper around each sees each launch once.
LAUNCHERS = ("_run", "launch_prepared", "launch_direct")


def launchers_of(triton_ops) -> dict[str, Callable]:
    """The :data:`LAUNCHERS` this checkout's ops module has (an older one lacks
    ``launch_direct``), by name."""
    return {name: getattr(triton_ops, name) for name in LAUNCHERS if hasattr(triton_ops, name)}


def launch_paths(triton_ops, step) -> dict[str, int]:
    """How many times ``step()`` calls each of the backend's launch functions."""
    launchers = launchers_of(triton_ops)
    calls = dict.fromkeys(launchers, 0)

    def counted(name, launcher):
        def call(*args, **kwargs):
            calls[name] += 1
            return launcher(*args, **kwargs)
        return call

    for name, launcher in launchers.items():
        setattr(triton_ops, name, counted(name, launcher))
    try:
        step()
    finally:
        for name, launcher in launchers.items():
            setattr(triton_ops, name, launcher)
    return calls


def steps(layers, links, make_input, dy, iters):
    """Mean (forward, backward) thread CPU seconds per step of ``layers`` chained (``links``
    between them), one ``backward()`` a step."""
    fwd = bwd = 0.0
    for _ in range(iters):
        x = make_input()
        start = time.thread_time()
        for i, layer in enumerate(layers):
            x = layer(x if i == 0 else Link.apply(x, links[i]))
        middle = time.thread_time()
        x.backward(dy)
        end = time.thread_time()
        fwd += middle - start
        bwd += end - middle
    return fwd / iters, bwd / iters


def as_on_a_gpu(layer: torch.nn.Module) -> torch.nn.Module:
    """``layer`` (an in-place ``SyncBatchNorm`` on CPU parameters) as it is on a GPU: without
    the hook that counts, after each backward that accumulates its weight's gradient, the
    channels a compiled in-place layer keeps aside (``layer/compiled_inplace.watch``
    registers it only for CPU parameters, which it reads where they lie). A GPU's layer runs
    no Python hook in its backward; this harness's layers would run one."""
    from encoding_syncbn.layer import compiled_inplace

    handle = layer.__dict__.get(compiled_inplace._HANDLE)
    if handle is not None:
        handle.remove()
        layer.__dict__[compiled_inplace._HANDLE] = None
    return layer


class StubLaunches:
    """The Triton backend on CPU tensors, planned for an H100 and launched through Triton's
    launcher onto the stand-in driver (``stub_driver.activate()`` first).

    No kernel runs, so the small-gamma flags the statistics kernel would write stay as the
    allocator left them; the layer reads them where its channels kept aside take this call's check
    (``ChannelsAside.index``), and there they are zeroed, as a check that finds no small gamma
    leaves them, once per buffer (one ``zero_``; a training step's flags lie in one buffer of its
    own, which only the kernel would write, the ops' own calls allocate theirs at each call).
    Timed calls run without that wrapper (``settled``): the harness adds no Python frame to a
    layer call, nor between the ops and Triton's launcher. A timer or a counter may wrap the
    backend's launch functions (:data:`LAUNCHERS`).

    The gradients the backward kernels would write (of the weight and bias) hold what the
    allocator left too, which autograd adds into ``.grad`` on the CPU: among those bytes,
    denormal floats (a heap pointer's upper half is one), whose every addition costs the CPU a
    microcode assist. A GPU's accumulation is a launch, whose host cost does not depend on the
    values, so the CPU here treats denormals as zero (``torch.set_flush_denormal``), for every
    harness alike."""

    def __init__(self, triton_ops) -> None:
        from encoding_syncbn.kernels.triton.plan import Target
        from encoding_syncbn.layer import exchange, functional
        from encoding_syncbn.layer.inplace_policy import ChannelsAside

        # kernels.ops_for hands a CPU tensor to the Triton backend only where its kernels are
        # interpreted (this flag, which nothing else reads): told so, it routes CPU tensors to
        # the compiled kernels' launches.
        triton_ops.INTERPRET = True
        self._triton_ops = triton_ops
        h100 = Target(False, H100_SMS)
        triton_ops.launch_target = lambda device: h100  # the real one is memoised per device
        # A GPU's statistics are device tensors, which the far-from-zero check does not read
        # (it would wait for the device); here they are CPU tensors no kernel wrote, whose
        # garbage would send every call down the CPU's extra pass over x.
        functional.far_from_zero = exchange.far_from_zero = lambda mean, invstd: False
        if not torch.set_flush_denormal(True):
            raise SystemExit("this CPU cannot flush denormals: the gradients no kernel writes "
                             "would make autograd's accumulation slow by their values")
        index = ChannelsAside.index
        if getattr(index, "zeroes_flags", False):  # a StubLaunches made before this one
            self._index, self._zeroed_index = index.unwrapped, index
            return
        zeroed = [None]  # the flags zeroed last (held: no other tensor takes its id)

        def zeroed_index(self, weight, bias, recomputing=False, flags=None, running=None):
            if flags is not None and flags is not zeroed[0]:
                flags.zero_()
                zeroed[0] = flags
            return index(self, weight, bias, recomputing, flags, running)

        zeroed_index.zeroes_flags, zeroed_index.unwrapped = True, index
        self._index, self._zeroed_index = index, zeroed_index
        ChannelsAside.index = zeroed_index

    @contextlib.contextmanager
    def settled(self, layers):
        """Timed calls of ``layers`` (warmed up), whose flags need no zeroing at each call:
        ``ChannelsAside.index`` unwrapped. Each layer's training step launches its statistics
        into its one flags buffer, zeroed by a warm-up call; a call that falls back to the ops'
        own launches (none should) allocates fresh flags, which the harness zeroes where the
        ops hand them out, off the step's path. Checked on the way out: no layer kept a
        channel aside."""
        from encoding_syncbn.layer.inplace_policy import ChannelsAside

        ops = self._triton_ops
        eager_batch_stats = ops._eager_batch_stats

        def zeroed_batch_stats(*args):
            mean, invstd, flags = eager_batch_stats(*args)
            if flags is not None:
                flags.zero_()
            return mean, invstd, flags

        ChannelsAside.index, ops._eager_batch_stats = self._index, zeroed_batch_stats
        try:
            yield
        finally:
            ChannelsAside.index, ops._eager_batch_stats = self._zeroed_index, eager_batch_stats
        for layer in layers:
            aside = getattr(layer, "_channels_aside", None)
            if aside is not None and aside.known:
                raise SystemExit(f"a timed call kept channels {aside.known} aside: it read "
                                 "flags no warm-up call zeroed")
