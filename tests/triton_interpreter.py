"""Triton's interpreter without a walk it repeats on every device-function call (tests only).

Triton 3.9's interpreter runs a kernel with ``triton.language`` patched for it. Each call of a
``@triton.jit`` device function from inside a kernel (``InterpretedFunction.__call__``) patches
again every ``triton.language`` module that function sees: ``inspect.getmembers`` over
``tl``, ``tl.core``, ``tl.math`` and ``tl.tensor``, whether or not they are patched already
(they are while a kernel runs), and never undoes it. The kernels here call their helpers once
per tile, so that walk was about 40% of their interpreted time: a timm regnetx_002 conversion
test on the Triton backend took 112 s with it, 59 s without; the whole suite on two cores,
158 s and 122 s.

``install()`` makes a device call skip the walk when every ``triton.language`` module its
function sees is patched already (a builtin there has been replaced); otherwise Triton's own
call runs. The kernels compute the same: only a repeated patch is skipped. With a Triton that
has not this structure, ``install()`` changes nothing.

``install()`` also makes a scalar's ``__index__`` (a ``range`` bound) squeeze its 1-element array
before ``int()``: Triton 3.6's interpreter does ``int(array)``, which NumPy 2.4 refuses, so every
kernel loop with runtime bounds fails there (triton-lang/triton#9171; Triton 3.9 squeezes).

It runs a launch's programs with grid axis 0 fastest, as a GPU hands out its blocks: Triton's
interpreter runs axis 0 slowest, so a channel block's split programs (axis 1) all ran before
the next block's, and kernels that shared one arrival counter among all blocks passed. Now
the blocks' programs interleave, and such a kernel leaves channels unfinished.

And it makes a float32 -> bfloat16 cast round to nearest (even), as a GPU's does: Triton 3.9's
interpreter truncates it, which doubles a bfloat16 output's rounding error, and what the
half-precision tests bound is that error.

Three answers it memoises, each recomputed by every interpreted operation: the NumPy dtype of
a Triton type (a dict of 20 NumPy dtypes built at each call), a block type's shape, size and
name (validated and formatted at each of the several block types an operation makes), and a
tensor's attributes but its handle and type (its shape as a tuple of constexprs, its size,
its dtype). Each is a pure function of the arguments it is memoised by. A training step of
an in-place layer on an (8, 4, 3, 2) float64 input, CPU time, fastest of 30 steps: 82-85 ms
without the three, 58-66 ms with them (three runs of each, taking turns; the medians drift
with the machine's neighbours).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton.language as tl
from triton.runtime import interpreter

# Any builtin of tl and of tl.core: patched there exactly while the module is patched.
_PROBE = "full"


def _patched(module: Any) -> bool:
    builtin = getattr(module, _PROBE, None)
    return builtin is not None and not tl.core.is_builtin(builtin)


def _squeeze_index() -> None:
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "squeezes_index", False):
        return

    def patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.squeezes_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def _round_to_bfloat16(data: np.ndarray) -> np.ndarray:
    """float32 values as bfloat16 bits (uint16, the interpreter's storage), rounded to nearest
    even; a NaN stays a (quiet) NaN."""
    bits = np.asarray(data, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(data)
    rounded[nan] = ((bits[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    return rounded


def _round_bfloat16_casts() -> None:
    builder = getattr(interpreter, "InterpreterBuilder", None)
    cast = getattr(builder, "cast_impl", None)
    if cast is None or getattr(cast, "rounds_bfloat16", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_round_to_bfloat16(src.data), dst_type.scalar)
        return cast(self, src, dst_type)

    cast_impl.rounds_bfloat16 = True
    builder.cast_impl = cast_impl


def _axis_0_fastest() -> None:
    builder = getattr(interpreter, "InterpreterBuilder", None)
    set_dim = getattr(builder, "set_grid_dim", None)
    set_idx = getattr(builder, "set_grid_idx", None)
    if set_dim is None or set_idx is None or getattr(set_idx, "axis_0_fastest", False):
        return

    def set_grid_dim(self, nx, ny, nz):
        set_dim(self, nx, ny, nz)
        self.programs_started = 0

    def set_grid_idx(self, x, y, z):
        # The interpreter asks for (x, y, z) in axis-0-slowest order: the k-th program it
        # starts runs as the k-th in axis-0-fastest order instead.
        nx, ny, _ = self.grid_dim
        k = self.programs_started
        self.programs_started = k + 1
        set_idx(self, k % nx, (k // nx) % ny, k // (nx * ny))

    set_grid_idx.axis_0_fastest = True
    builder.set_grid_dim = set_grid_dim
    builder.set_grid_idx = set_grid_idx


def _memoise_np_dtype() -> None:
    get = getattr(interpreter, "_get_np_dtype", None)
    if get is None or getattr(get, "memoised", False):
        return
    np_dtypes: dict[Any, np.dtype] = {}

    def get_np_dtype(tt_dtype):
        # A block's is its element's; a pointer's (or a block of pointers') is uint64.
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(scalar, tl.pointer_type):
            scalar = tl.uint64
        np_dtype = np_dtypes.get(scalar)
        if np_dtype is None:
            np_dtype = np_dtypes[scalar] = get(scalar)
        return np_dtype

    get_np_dtype.memoised = True
    interpreter._get_np_dtype = get_np_dtype


def _memoise_init(cls: type, key_of, per_instance: tuple[str, ...] = ()) -> None:
    """``cls.__init__`` memoised: an instance made with the key of an earlier one gets the
    attributes that one's ``__init__`` set, but ``per_instance``: those set from ``__init__``'s
    arguments of the same names and order, each time."""
    init = cls.__init__
    if getattr(init, "memoised", False):
        return
    made: dict[tuple, dict] = {}

    def memoised_init(self, *args):
        try:
            key = key_of(*args)
            attributes = made.get(key)
        except (AttributeError, TypeError):  # arguments it cannot key: not memoised
            key = attributes = None
        if attributes is None:
            init(self, *args)  # validates, and raises on bad arguments
            if key is not None:
                made[key] = {k: v for k, v in vars(self).items() if k not in per_instance}
        else:
            vars(self).update(attributes)
            for name, value in zip(per_instance, args):
                setattr(self, name, value)

    memoised_init.memoised = True
    cls.__init__ = memoised_init


def _memoise_types_and_tensors() -> None:
    # A block type: all of it by (element type, shape in ints).
    _memoise_init(tl.core.block_type, lambda element_ty, shape: (
        element_ty, tuple(d if type(d) is int else d.value for d in shape)))
    # A tensor: all but its handle and type, by (shape, scalar type).
    _memoise_init(tl.core.tensor, lambda handle, ty: (
        ty.shape if ty.is_block() else (), ty.scalar), per_instance=("handle", "type"))


def _quiet_lanes() -> None:
    """A launch runs with NumPy's floating-point warnings off. The interpreter computes every
    lane of a block in NumPy, masked-out lanes too (the zeros their loads read, divided), and
    the infinities of inputs that overflow; a GPU computes those silently, and what the tests
    compare, the stored results, is the same either way."""
    executor = interpreter.GridExecutor
    if getattr(executor.__call__, "quiet_lanes", False):
        return
    launch = executor.__call__

    def call(self, *args, **kwargs):
        with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
            return launch(self, *args, **kwargs)

    call.quiet_lanes = True
    executor.__call__ = call


def install() -> None:
    _quiet_lanes()
    _squeeze_index()
    _round_bfloat16_casts()
    _axis_0_fastest()
    _memoise_np_dtype()
    _memoise_types_and_tensors()
    function = getattr(interpreter, "InterpretedFunction", None)
    if (function is None or not hasattr(function, "rewrite")
            or getattr(function.__call__, "skips_repeated_patch", False)):
        return
    device_call = function.__call__
    languages: dict[Any, list[Any]] = {}  # per Python function, the tl modules it sees

    def call(self, *args, **kwargs):
        langs = languages.get(self.fn)
        if langs is None:
            langs = languages[self.fn] = [value for value in self.fn.__globals__.values()
                                          if value is tl or value is tl.core]
        if not langs or not all(_patched(lang) for lang in langs):
            return device_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as error:  # as Triton's own call reports it
            raise interpreter.InterpreterError(repr(error)) from error

    call.skips_repeated_patch = True
    function.__call__ = call
