"""Launching a planned kernel: through Triton's public launch the first time its specialisation
is seen, then its compiled kernel directly.

Triton's public launch (``kernel[grid](...)``, ``JITFunction.run``) binds and specialises every
argument and builds the cache key on every call. The compiled kernel it finds, called with the
bound arguments alone, does the launch itself: what Inductor's generated launchers do. So each
specialisation's compiled kernel is kept here, keyed by what Triton specialises on (each
tensor's dtype and 16-byte alignment, each integer's value, each other argument's type, the
constexprs, warps and device; where the planner names the memoised plan that fixes all but
the tensors, ``Launch.token``, by that and the dtypes of the tensors it does not fix, once
they all lie on 16 bytes),
and later launches of it call it with the arguments in the order Triton binds them: its C
launch itself where the Python launcher around it adds nothing these kernels use (scratch
memory, tensor descriptors, GSan) in a release read (``compat.triton_direct_launch``). Triton's
public launch still takes every launch

- the first of each specialisation (it compiles or finds the kernel, and loads it);
- under the interpreter, and with a Triton whose launch this module was not read against
  (``compat.triton_launch_knobs``);
- while a launch hook is set (``knobs.runtime.launch_enter_hook`` and ``launch_exit_hook``,
  the stages-inspection hook, the kernel's pre-run hooks): they see every launch.

The compilation knobs (debug, instrumentation) are those of each specialisation's first launch.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any, Callable, NamedTuple

import torch

from ... import compat
from .plan import COMPILE_OPTIONS, INTERPRET, Launch


class _Compiled(NamedTuple):
    """A specialisation's compiled kernel and what its launch passes besides the arguments."""

    kernel: Any  # Triton's CompiledKernel (kept: it owns the loaded module)
    # Its launch, and how it is called (``compat.triton_direct_launch``).
    launch: Callable[..., None]
    leading: tuple
    packed: bool
    constexprs: tuple  # the values of the parameters after the planned arguments, in order
    device: int  # as Triton's driver numbers it
    stream: Callable[[int], int]  # Triton's driver's current-stream query


# Specialisations seen, by :func:`_key`; forgotten all at once past the bound (plans change
# with shapes: a long-running process must not grow it without end).
_COMPILED: dict[tuple, _Compiled] = {}
_MAX_COMPILED = 4096

# Triton's launch hooks (``knobs.runtime``) where the direct launch is known for this Triton;
# resolved at the first launch.
_UNRESOLVED = object()
_knobs: Any = _UNRESOLVED


def launch(planned: Launch, device_index: int | None) -> None:
    """Launch ``planned`` on the current device (``device_index``: the torch device's index,
    part of the key: a compiled kernel is loaded on one device)."""
    launch_all((planned,), device_index)


def launch_all(launches: Sequence[Launch], device_index: int | None) -> None:
    """Launch each of ``launches`` in order, as :func:`launch` does: the launch hooks and the
    current stream asked once for all of them (one op's launches run on one device and
    stream, and no launch of theirs sets a hook)."""
    knobs = _knobs if _knobs is not _UNRESOLVED else _resolve_knobs()
    if knobs is None:
        for planned in launches:
            public(planned)
        return
    # Whether a launch hook is set: the hooks Triton keeps as ``HookChain``s are idle when
    # empty, any other hook when None (a kernel's own pre-run hooks: ``pre_run_hooks``).
    enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook
    hooked = (getattr(enter, "calls", enter) or getattr(leave, "calls", leave)
              or knobs.add_stages_inspection_hook is not None)
    stream = key = None
    for planned in launches:
        key = _key(planned, device_index, key)
        compiled = _COMPILED.get(key)
        if compiled is None or hooked or planned.kernel.pre_run_hooks:
            kernel = public(planned)
            if compiled is None and kernel is not None:
                _remember(key, planned, kernel)
            continue
        if stream is None:
            stream = compiled.stream(compiled.device)
        grid = planned.grid
        if compiled.packed:
            compiled.launch(grid[0], grid[1], 1, stream, *compiled.leading,
                            (*planned.args, *compiled.constexprs))
        else:
            compiled.launch(grid[0], grid[1], 1, stream, *compiled.leading, *planned.args,
                            *compiled.constexprs)


class _Direct(NamedTuple):
    """A compiled kernel's launch on one grid, called as ``launch(blocks, splits, 1, stream,
    *leading, args + constexprs)`` where ``packed``, else ``launch(blocks, splits, 1, stream,
    *leading, *args, *constexprs)`` (``compat.triton_direct_launch``)."""

    launch: Callable[..., None]
    blocks: int
    splits: int
    leading: tuple
    constexprs: tuple
    packed: bool


class Prepared(NamedTuple):
    """An op's launches for one key of its memo (:func:`prepared_memo`), once each has been
    launched through Triton's public path: the op's memoised ``plan`` and each launch's
    direct launch (:func:`prepare`).

    The key is the op's: whatever fixes its plan and everything Triton specialises its
    launches on but where their tensors lie (sizes, strides, dtypes of every tensor its
    launches do not allocate, the device, the options). A repeat call of the op builds its
    launches' arguments and hands them to :func:`launch_prepared`: no plan lookup, no launch
    key, no ``Launch``."""

    plan: Any
    direct: tuple[_Direct, ...]
    # Per launch with tensors its token does not fix: its index and their positions.
    keyed: tuple[tuple[int, tuple[int, ...]], ...]
    # Each launch's kernel's pre-run hooks (``JITFunction.pre_run_hooks``, the list itself,
    # which hooks are added to): they see every launch.
    pre_run_hooks: tuple[list, ...]
    # The device the kernels are loaded on (as Triton's driver numbers it) and Triton's
    # driver's current-stream query: one op's launches run on one device and stream.
    device: int
    stream: Callable[[int], int]
    # Each launch's kernel's name: what a count of the launches reads (they name no kernel).
    kernels: tuple[str, ...]


# Every op's memo of its prepared launches by its key (a dict: its ``get`` is the op's one
# lookup a call): forgotten with the compiled kernels they call, and each all at once past the
# bound (plans change with shapes: a long-running process must not grow it without end).
_PREPARED_MEMOS: list[dict] = []
_MAX_PREPARED = 1024

#: How many times every compiled kernel kept was forgotten (:func:`forget_compiled`): a holder
#: of ``Prepared`` launches outside the memos (``ops.TrainingStep``) drops them when it changes.
generation = 0


def prepared_memo() -> dict:
    """A new op's memo of :class:`Prepared` launches by its key (filled by :func:`prepare`,
    cleared by :func:`forget_compiled`)."""
    memo: dict = {}
    _PREPARED_MEMOS.append(memo)
    return memo


def prepare(memo: dict, key: tuple, plan: Any, launches: Sequence[Launch],
            device_index: int | None) -> None:
    """Remember in ``memo`` under ``key`` the direct launches of ``launches``, just launched
    (:func:`launch_all`) as ``plan`` plans them, where each has a compiled kernel kept under
    its plan token's key (its tensors on 16 bytes: what :func:`launch_prepared` then asks of
    a repeat call's); nothing under the interpreter, an unknown Triton, or a launch keyed by
    every argument."""
    if _knobs is None or _knobs is _UNRESOLVED:  # every launch public: nothing kept
        return
    direct, keyed, before = [], [], None
    for index, planned in enumerate(launches):
        before = _token_key(planned, device_index, before)
        compiled = None if before is None else _COMPILED.get(before)
        if compiled is None:
            return
        direct.append(_Direct(compiled.launch, *planned.grid, compiled.leading,
                              compiled.constexprs, compiled.packed))
        positions = _TENSOR_PICKERS[(id(planned.kernel), planned.token)][1]
        if positions:
            keyed.append((index, positions))
    if len(memo) >= _MAX_PREPARED:
        memo.clear()
    memo[key] = Prepared(plan, tuple(direct), tuple(keyed),
                         tuple(planned.kernel.pre_run_hooks for planned in launches),
                         compiled.device, compiled.stream,
                         tuple(planned.kernel.fn.__name__ for planned in launches))


def launch_prepared(prepared: Prepared, device: torch.device, *launch_args: tuple) -> bool:
    """Launch ``prepared``'s launches directly, each with its arguments of ``launch_args``
    (the planned ones, as its ``Launch`` would hold them), where they may be taken: the
    tensors their keys read on 16 bytes (what Triton specialises pointers on, and
    :func:`prepare` found), and as :func:`launch_direct` takes them. False: nothing launched,
    the caller launches through :func:`launch_all`."""
    for index, positions in prepared.keyed:
        args = launch_args[index]
        for position in positions:
            if args[position].data_ptr() & 15:
                return False
    return launch_direct(prepared, device, *launch_args)


def launch_direct(prepared: Prepared, device: torch.device, *launch_args: tuple) -> bool:
    """Launch ``prepared``'s launches directly, each with its arguments of ``launch_args``,
    where they may be taken: no launch hook set (hooks see every launch) and ``device`` the
    current one (Triton launches there; a DataParallel replica's thread has switched to its
    own). False: nothing launched.

    A tensor's place may hold its address instead (``data_ptr()``, an int), which Triton's C
    launch takes as it is: no ``data_ptr()`` call of its own and no driver query of where
    the address points, the query that refuses a CPU tensor. So the caller vouches for what
    the keys do not: each address it hands on 16 bytes where its key does not fix it
    (``Prepared.keyed``), and on the launch's device."""
    knobs = _knobs
    enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook
    if (getattr(enter, "calls", enter) or getattr(leave, "calls", leave)
            or knobs.add_stages_inspection_hook is not None
            or any(prepared.pre_run_hooks)
            # (a GPU's tensors alone carry a device index: ``device.type`` builds a string)
            or device.index is not None and device.index != torch.cuda.current_device()):
        return False
    stream = prepared.stream(prepared.device)
    for (launch, blocks, splits, leading, constexprs, packed), args in zip(prepared.direct,
                                                                           launch_args):
        if packed:
            # ``args + constexprs``: one concatenation, where ``(*args, *constexprs)`` builds
            # a list first.
            launch(blocks, splits, 1, stream, *leading, args + constexprs)
        else:
            launch(blocks, splits, 1, stream, *leading, *args, *constexprs)
    return True


def public(planned: Launch) -> Any:
    """Launch ``planned`` through Triton's public launch; its compiled kernel (None from the
    interpreter)."""
    return planned.kernel[planned.grid](*planned.args, **planned.constexprs,
                                        num_warps=planned.num_warps, **COMPILE_OPTIONS)


def forget_compiled() -> None:
    """Forget every compiled kernel kept: later launches take Triton's public launch first
    again, which compiles (or finds) each kernel with the compile options then set."""
    global generation
    generation += 1
    _COMPILED.clear()
    _TENSOR_PICKERS.clear()
    for memo in _PREPARED_MEMOS:
        memo.clear()


def compiled_for(planned: Launch, device_index: int | None) -> Any | None:
    """The compiled kernel that launches of ``planned`` call directly, or None (not launched
    yet, or launched through Triton's public path only)."""
    compiled = _COMPILED.get(_key(planned, device_index))
    return None if compiled is None else compiled.kernel


def _resolve_knobs() -> Any:
    global _knobs
    _knobs = None if INTERPRET else compat.triton_launch_knobs()
    return _knobs


# The classes of the tensor arguments seen (``torch.Tensor``, ``nn.Parameter``, ...): a set
# lookup, where ``isinstance`` with torch.Tensor goes through its metaclass on every call.
_TENSOR_CLASSES: set[type] = {torch.Tensor}

# Per kernel and plan token (``Launch.token``): what picks the launch's tensors from its
# arguments (where they lie is the token's to fix), and their positions. Forgotten with the
# compiled kernels.
_TENSOR_PICKERS: dict[tuple, tuple[Callable[[tuple], tuple], tuple[int, ...]]] = {}
_data_ptr = torch.Tensor.data_ptr
_dtype_of = operator.attrgetter("dtype")


def _key(planned: Launch, device_index: int | None, before: tuple | None = None) -> tuple:
    """What Triton specialises a launch of ``planned`` on, or finer. With a plan token whose
    tensors all lie on 16 bytes: the kernel, the token and the dtypes of the tensors it does
    not fix (``Launch.fixed``; it fixes the rest), and ``before``, the key of the launch
    before it in its op's launches (None: the first), which holds those of a launch that
    ``follows`` it; else from every argument (:func:`_argument_key`)."""
    key = _token_key(planned, device_index, before)
    return key if key is not None else _argument_key(planned, device_index)


def _token_key(planned: Launch, device_index: int | None, before: tuple | None) -> tuple | None:
    """:func:`_key` from ``planned``'s plan token; None where it has none, where it
    ``follows`` no launch (``before`` None), or where a tensor it does not fix is off 16
    bytes."""
    token = planned.token
    if token is None or (before is None and planned.follows):
        return None
    kernel = id(planned.kernel)
    found = _TENSOR_PICKERS.get((kernel, token))
    pick = found[0] if found is not None else _tensor_picker(planned, kernel)
    tensors = pick(planned.args)
    if functools.reduce(operator.or_, map(_data_ptr, tensors), 0) & 15:
        return None
    return (kernel, token, device_index, before, *map(_dtype_of, tensors))


def _tensor_picker(planned: Launch, kernel: int) -> Callable[[tuple], tuple]:
    fixed = planned.fixed
    positions = [i for i, arg in enumerate(planned.args)
                 if i not in fixed
                 and (arg.__class__ in _TENSOR_CLASSES or _is_tensor_class(arg.__class__))]
    if len(positions) == 1:  # itemgetter of one position answers the item, not a tuple
        def pick(args: tuple, only: int = positions[0]) -> tuple:
            return (args[only],)
    elif not positions:  # every tensor fixed (by the launch it follows)
        def pick(args: tuple) -> tuple:
            return ()
    else:
        pick = operator.itemgetter(*positions)
    if len(_TENSOR_PICKERS) >= _MAX_COMPILED:
        _TENSOR_PICKERS.clear()
    _TENSOR_PICKERS[(kernel, planned.token)] = pick, tuple(positions)
    return pick


def _argument_key(planned: Launch, device_index: int | None) -> tuple:
    """What Triton specialises a launch of ``planned`` on, or finer: a tensor by its dtype and
    whether its address is a multiple of 16 (the two in a row: a dtype comes from no other
    argument), an integer by its value (1, multiples of 16 and 64-bit values are typed apart), a
    float or a bool by its type (never by value); the kernel by identity (its own hash is
    Triton's cache key, computed on every call)."""
    parts: list = [id(planned.kernel), device_index, planned.num_warps]
    append = parts.append
    for arg in planned.args:
        cls = arg.__class__
        if cls is int:
            append(arg)
        elif cls is float or cls is bool:
            append(cls)
        elif cls in _TENSOR_CLASSES or _is_tensor_class(cls):
            append(arg.dtype)
            append(arg.data_ptr() % 16 == 0)
        else:
            append(arg)
    parts.extend(planned.constexprs.items())
    return tuple(parts)


def _is_tensor_class(cls: type) -> bool:
    if issubclass(cls, torch.Tensor):
        _TENSOR_CLASSES.add(cls)
        return True
    return False


def _remember(key: tuple, planned: Launch, kernel: Any) -> None:
    """Keep the compiled ``kernel`` of ``planned``'s first launch for the launches after it."""
    import triton
    from triton.runtime import driver

    if len(_COMPILED) >= _MAX_COMPILED:
        forget_compiled()
    bound = planned.kernel.signature.bind(*planned.args, **planned.constexprs)
    bound.apply_defaults()
    rest = tuple(bound.arguments.values())[len(planned.args):]
    active = driver.active
    _COMPILED[key] = _Compiled(kernel, *compat.triton_direct_launch(triton.__version__, kernel),
                               rest, active.get_current_device(), active.get_current_stream)
