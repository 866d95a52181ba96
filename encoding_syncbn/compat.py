"""Every private torch and Triton API the package uses, in one place.

Each is looked up on first use, never at import time, so that a torch or Triton release that
moves one breaks only the feature that needs it: where a safe fallback exists it is used
(conservative: out of place rather than a wrong overwrite); where none does, the call raises
``RuntimeError`` naming the API and the installed version.
"""

from __future__ import annotations

import functools
import os
import types
from typing import Any, Callable

import torch


def _missing(api: str, error: Exception) -> RuntimeError:
    return RuntimeError(
        f"encoding_syncbn needs {api}, which this torch ({torch.__version__}) does not have "
        f"({type(error).__name__}: {error}); please report it with your torch version"
    )


# ---- nn.Module ---------------------------------------------------------------------------

# nn.Module's tables of the hooks registered on one module: those its calls run (forward,
# backward and their pre-hooks), their flags, and its state_dict's.
_CALL_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_CALL_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                    "_forward_hooks_always_called", "_is_full_backward_hook")
_STATE_DICT_HOOKS = ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                     "_load_state_dict_post_hooks")


def share_hooks(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Make ``target`` run the hooks registered on ``source``: the same tables, so that the
    handles ``register_*_hook`` returned remove them from both. A table this torch lacks is
    skipped."""
    for name in _CALL_HOOKS + _CALL_HOOK_FLAGS + _STATE_DICT_HOOKS:
        if hasattr(source, name):
            object.__setattr__(target, name, getattr(source, name))


def has_call_hooks(module: torch.nn.Module) -> bool:
    """Whether calls of ``module`` run hooks registered on it (forward, backward, pre-hooks;
    not the global ones of ``register_module_forward_hook``)."""
    return any(getattr(module, name, None) for name in _CALL_HOOKS)


# ---- autograd ---------------------------------------------------------------------------

def disable_torch_function_subclass() -> Any:
    """A context in which tensor subclasses' ``__torch_function__`` is not called (what a
    subclass's own ``__torch_function__`` runs torch under; ``inplace_policy``'s checked
    tensors). Only the opt-in checks need it."""
    try:
        return torch._C.DisableTorchFunctionSubclass()
    except AttributeError as error:
        raise _missing("torch._C.DisableTorchFunctionSubclass", error) from error


# Whether a torch.func transform runs: the dispatch-key query torch's own Function.apply asks,
# and functorch's innermost level (None outside any transform), which Dynamo knows. Resolved at
# import with fallbacks: a torch without one falls back to the other, or to "none runs".
_transforms_active: Callable[[], bool] = getattr(
    torch._C, "_are_functorch_transforms_active", lambda: False)
_functorch_level: Callable[[], int | None] = getattr(
    torch._C._functorch, "maybe_current_level", lambda: None)


# Whether torch.jit.trace records this call: what ``torch.jit.is_tracing()`` asks after its
# ``is_scripting()`` (always False here: the layer refuses scripting), without its two Python
# calls, in every call of the layer. Resolved at import, falling back to the public function.
_jit_tracing: Callable[[], bool] = getattr(torch._C, "_is_tracing", None) or torch.jit.is_tracing


#: Whether ``torch.export`` traces the call: torch.compiler's flag, read as it lies (in a C
#: call: no Python frame at each layer call); the public function where this torch has no flag.
#:
#: Not ``torch.compiler.is_exporting()`` where the flag is there: before torch 2.13 Dynamo
#: answers that call with True inside any ``torch.compile``, which would refuse every compiled
#: training layer as an export; the flag itself is set by ``torch.export`` alone.
exporting: Callable[[], bool] = (
    functools.partial(getattr, torch.compiler, "_is_exporting_flag")
    if hasattr(torch.compiler, "_is_exporting_flag") else torch.compiler.is_exporting)

#: The innermost open ``torch.autograd.forward_ad.dual_level`` (-1: none), read in a C call;
#: -1 where this torch keeps no such level.
forward_ad_level: Callable[[], int] = functools.partial(
    getattr, torch.autograd.forward_ad, "_current_level", -1)


def transformed_or_jit_traced() -> bool:
    """Whether a ``torch.func`` transform (grad, vjp, jvp, vmap, ...) is running, or
    ``torch.jit.trace`` records this call (``torch.jit.is_tracing()``).

    A transform eagerly by the dispatch-key query: ``maybe_current_level`` creates this
    thread's functorch state on first use, which every later ``backward()`` then copies with
    the thread's state: a cost to every layer call and to every other backward of the program.
    While compiling by the level, which Dynamo traces; and no jit trace (Dynamo need not trace
    that query). One question for both: the layer asks at every call."""
    if torch.compiler.is_compiling():
        return _functorch_level() is not None
    return _transforms_active() or _jit_tracing()


#: ``x``, or the plain tensor inside it where ``x`` is a tensor a finished ``torch.func``
#: transform left wrapped (which the kernels cannot read: no storage). Eagerly only (Dynamo
#: cannot trace it; its tensors are never such wrappers). torch's own function, resolved at
#: import (the layer asks at every call); the identity where this torch lacks it.
unwrap_if_dead: Callable[[torch.Tensor], torch.Tensor] = getattr(
    getattr(torch._C, "_functorch", None), "unwrap_if_dead", lambda x: x)


@functools.cache
def _graph_task_id() -> Callable[[], int]:
    try:
        return torch._C._current_graph_task_id
    except AttributeError as error:
        raise _missing("torch._C._current_graph_task_id", error) from error


def inside_backward() -> bool:
    """Whether this thread is running a backward pass (a checkpoint recomputation runs the
    forward again there). No public API tells; without this one the recompute cannot work."""
    return _graph_task_id()() != -1


def eager_untraced() -> bool:
    """Whether a call runs with no ``torch.func`` transform, ``torch.jit.trace``,
    ``torch.export`` or forward-mode AD recording it, outside a backward pass
    (``transformed_or_jit_traced``, ``exporting``, ``inside_backward`` all False and no
    ``forward_ad_level``), asked in one Python call: the layer's memo asks it at every call
    (``layer/call_memo.py``). Eagerly only: its caller asks ``torch.compiler.is_compiling()``
    first, which Dynamo folds."""
    return not (_transforms_active() or _jit_tracing() or exporting()
                or _graph_task_id()() != -1 or forward_ad_level() >= 0)


@functools.cache
def _top_saved_tensor_hooks() -> Callable[[bool], Any] | None:
    return getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def saved_tensor_hooks_may_be_active() -> bool:
    """Whether saved-tensor hooks (``torch.utils.checkpoint``'s non-reentrant mode) are set on
    this thread; True when this torch cannot tell (the safe answer for its callers)."""
    top = _top_saved_tensor_hooks()
    return top is None or top(True) is not None


@functools.cache
def _keeps_graph() -> Callable[[], bool] | None:
    return getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


@functools.cache
def _storage_use_count() -> Callable[[int], int] | None:
    return getattr(torch._C, "_storage_Use_Count", None)


#: The holders of a saved output's storage that its Function's backward sees when nothing else
#: holds it: the saved variable's own tensor (autograd saves an output as a detached copy of
#: its tensor, so that the output does not keep its own graph alive), the tensor
#: ``ctx.saved_tensors`` unpacked, and the storage handle the count is read through. The
#: caller's reference to the output, a view or detached alias of it, another node's saved
#: input: each is a tensor of its own, one holder more.
_SOLE_SAVED_OUTPUT_HOLDERS = 3


def saved_output_is_sole(y: torch.Tensor) -> bool:
    """Whether nothing reads ``y`` after this backward: ``y`` is an output its Function saved
    without saved-tensor hooks (a hook may hand backward the caller's own tensor) and unpacked
    once, this backward frees the graph (no ``retain_graph``; a node called outside a backward
    pass counts as keeping it), and no other tensor shares ``y``'s storage. False where this
    torch cannot tell. No public API tells either."""
    keeps_graph, use_count = _keeps_graph(), _storage_use_count()
    if keeps_graph is None or use_count is None or keeps_graph():
        return False
    storage = y.untyped_storage()
    return use_count(storage._cdata) == _SOLE_SAVED_OUTPUT_HOLDERS


def batched_gradient(grad: torch.Tensor) -> bool:
    """Whether ``grad`` is one of a batch of gradients a backward is vmapped over
    (``torch.autograd.grad(..., is_grads_batched=True)``, ``jacobian(vectorize=True)``): the
    dispatch key of torch's vmap (no public API tells). False where this torch cannot tell."""
    keys = getattr(torch._C, "_dispatch_keys", None)
    return keys is not None and "Batched" in str(keys(grad))


@functools.cache
def _execution_engine() -> Any:
    try:
        return torch.autograd.Variable._execution_engine
    except AttributeError as error:
        raise _missing("torch.autograd.Variable._execution_engine", error) from error


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends (only valid inside backward)."""
    _execution_engine().queue_callback(callback)


# ---- tensors and views ------------------------------------------------------------------

# torch._debug_has_internal_overlap's answers: 0, no two elements share memory; 1, some do;
# 2, too hard for it to tell (as_strided and unfold views, say).
_OVERLAP_ANSWERS = {0: False, 1: True}


def internal_overlap(x: torch.Tensor) -> bool | None:
    """Whether some elements of ``x`` share memory, as torch's own quick check tells from
    ``x``'s sizes and strides; None where it cannot tell, or where this torch lacks it."""
    check = getattr(torch, "_debug_has_internal_overlap", None)
    return None if check is None else _OVERLAP_ANSWERS.get(int(check(x)))


def view_base(x: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``x`` is a view of (autograd's notion), or None."""
    return x._base if x._is_view() else None


@functools.cache
def _creation_meta() -> tuple[Callable[[torch.Tensor], Any], Any] | None:
    autograd = torch._C._autograd
    try:
        return autograd._get_creation_meta, autograd.CreationMeta.DEFAULT
    except AttributeError:
        return None


def view_kind(x: torch.Tensor) -> str | None:
    """For a view autograd restricts in-place writes to (made by a multi-output op such as
    chunk/split/unbind, in a custom Function, or in no-grad mode), its kind's name; None for a
    plain view. Where this torch cannot tell, every view counts as restricted (``"unknown"``),
    which only costs an out-of-place computation."""
    meta = _creation_meta()
    if meta is None:
        return "unknown"
    get, plain = meta
    kind = get(x)
    return None if kind == plain else kind.name


# ---- dispatch ---------------------------------------------------------------------------

def _no_dispatch_modes() -> int:
    return 0


#: How many ``TorchDispatchMode``s are active (0: none; also where this torch lacks the query:
#: then modes are not detected and kernels launch directly). torch's own C function, which its
#: ``_get_current_dispatch_mode`` asks first: no Python frame on every op call.
dispatch_modes: Callable[[], int] = getattr(torch._C, "_len_torch_dispatch_stack",
                                            _no_dispatch_modes)


# ---- Triton -----------------------------------------------------------------------------

def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``triton.knobs`` since Triton 3.4; the
    environment variable it reads otherwise)."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def cuobjdump_path() -> str:
    """The ``cuobjdump`` shipped with Triton's NVIDIA backend."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return knobs.nvidia.cuobjdump.path
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")


# Triton releases whose ``JITFunction.run`` launches the ``CompiledKernel`` it finds or compiles
# as ``kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata,
# launch_metadata, launch_enter_hook, launch_exit_hook, *bound_args.values())``, the bound
# arguments all of the kernel's parameters in order, constexprs included (read in each
# release's runtime/jit.py and compiler/compiler.py).
_COMPILED_LAUNCH_RELEASES = ((3, 6), (3, 7), (3, 8), (3, 9))


def _release(version: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return None


def compiled_launch_release(version: str) -> bool:
    """Whether Triton ``version`` launches its compiled kernels as the direct launch of
    ``kernels/triton/launch.py`` repeats (a release it was read in); a later one takes Triton's
    public launch until checked."""
    return _release(version) in _COMPILED_LAUNCH_RELEASES


# Releases whose NVIDIA launcher (``CudaLauncher.__call__``, backends/nvidia/driver.py) calls
# its C launch, for a kernel with no scratch memory (both scratch pointers then None), no
# tensor descriptor and no GSan, with ``(grid_0, grid_1, grid_2, stream, function,
# launch_cooperative_grid, launch_pdl, ...)`` and then: where True, ``(kernel_metadata,
# launch_metadata, enter_hook, exit_hook, global_scratch, profile_scratch, arg_annotations,
# kernel_signature, args)``, the arguments as one tuple; where False, ``(global_scratch,
# profile_scratch, kernel_metadata, launch_metadata, enter_hook, exit_hook, *args)``.
_C_LAUNCH_PACKS_ARGUMENTS = {(3, 6): False, (3, 9): True}


def triton_c_launch_release(version: str) -> bool:
    """Whether Triton ``version``'s NVIDIA launcher was read for its C launch
    (``_C_LAUNCH_PACKS_ARGUMENTS``)."""
    return _release(version) in _C_LAUNCH_PACKS_ARGUMENTS


def triton_direct_launch(version: str, kernel: Any) -> tuple[Callable[..., None], tuple, bool]:
    """How a launch calls Triton ``version``'s compiled ``kernel`` with no launch metadata and
    no hooks: ``(launch, leading, packed)``, to be called as ``launch(grid_0, grid_1, grid_2,
    stream, *leading, args)`` where ``packed``, else ``launch(grid_0, grid_1, grid_2, stream,
    *leading, *args)``, ``args`` all of the kernel's parameters in order.

    Triton's C launch itself where this release's NVIDIA launcher was read
    (``_C_LAUNCH_PACKS_ARGUMENTS``) and the kernel needs nothing the Python launcher around it
    adds (scratch memory, tensor descriptors, GSan); else that launcher, ``kernel.run``."""
    launcher = kernel.run
    packed = _C_LAUNCH_PACKS_ARGUMENTS.get(_release(version))
    c_launch = getattr(launcher, "launch", None)
    if (packed is None or type(launcher).__name__ != "CudaLauncher"
            or type(c_launch) is not types.BuiltinFunctionType
            or launcher.global_scratch_size or launcher.profile_scratch_size
            or getattr(launcher, "gsan_enabled", False)):
        return launcher, (kernel.function, kernel.packed_metadata, None, None, None), False
    flags = (kernel.function, launcher.launch_cooperative_grid, launcher.launch_pdl)
    if packed:
        return c_launch, (*flags, kernel.packed_metadata, None, None, None, None, None,
                          launcher.arg_annotations, launcher.kernel_signature), True
    return c_launch, (*flags, None, None, kernel.packed_metadata, None, None, None), False


def triton_launch_knobs() -> Any | None:
    """``triton.knobs.runtime`` (the launch hooks), where this Triton launches its compiled
    kernels as :func:`compiled_launch_release` knows; None otherwise: then every launch takes
    Triton's public path."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is None or not compiled_launch_release(triton.__version__):
        return None
    return knobs.runtime


@functools.cache
def _raw_stream_getter() -> Callable[[int], int] | None:
    return getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_handle(device_index: int) -> int:
    """The handle of the current CUDA stream of a device, as Triton's launcher asks for it
    (``torch._C._cuda_getCurrentRawStream``: no Stream object is built); the public
    ``torch.cuda.current_stream(...).cuda_stream`` where this torch lacks it."""
    getter = _raw_stream_getter()
    if getter is not None:
        return getter(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream
