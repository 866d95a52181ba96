"""Every specialisation the launchers can produce (compiled ahead of time by check_kernels.py)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from encoding_syncbn.kernels.backend import BatchSums, DxCoefs, NormParams, RunningParams
from encoding_syncbn.kernels.torch_ops import stats_dtype
from encoding_syncbn.kernels.triton.backward_dx import plan_backward_dx
from encoding_syncbn.kernels.triton.backward_reduce import plan_backward_reduce
from encoding_syncbn.kernels.triton.channel_stats import plan_batch_stats, plan_channel_stats
from encoding_syncbn.kernels.triton.normalize_act import plan_normalize_act, plan_normalize_running
from encoding_syncbn.kernels.triton.plan import (
    BACKWARD_VARIANTS,
    DTYPES,
    KERNEL_ACTIVATIONS,
    Launch,
    Target,
    _offsets_fit,
    geometry_of,
    tile_choices,
)

# (shape, memory format) of the planned launches above: a split reduction (C small) and one
# program per channel block (C large); a single odd image; one plane of over 2**31 elements;
# C*S over 2**31; 2-D rows; rows past 2**31 in channels_last; and rows (S positions, C
# channels) that are multiples of 8, 4 and 2 but not of 16, each ``ALIGN`` below Triton's
# own hint of 16 (``plan.row_align``).
_SPECIALISATION_SHAPES = (
    ((32, 16, 64, 64), torch.contiguous_format),
    ((4, 4096, 8, 8), torch.contiguous_format),
    ((1, 3, 7, 9), torch.contiguous_format),
    ((1, 2, 46341, 46341), torch.contiguous_format),
    ((4, 65537, 128, 128), torch.contiguous_format),
    ((32, 64, 32, 32), torch.channels_last),
    ((8, 7), torch.contiguous_format),
    ((2**17, 3, 128, 128), torch.channels_last),
    ((2, 64, 4, 6), torch.contiguous_format),
    ((2, 64, 14, 14), torch.contiguous_format),
    ((2, 64, 5, 2), torch.contiguous_format),
    ((4, 24, 8, 8), torch.channels_last),
    ((4, 12, 8, 8), torch.channels_last),
    ((4, 6, 8, 8), torch.channels_last),
)


# The batch statistics' finishing variants are compiled for each statistics dtype on these
# shapes: a split reduction in each layout, and one program per channel block.
_FINISH_SHAPES = (
    ((32, 16, 64, 64), torch.contiguous_format),
    ((32, 64, 32, 32), torch.channels_last),
    ((4, 4096, 8, 8), torch.contiguous_format),
)


def _running_variants(c: int) -> Iterator[tuple[tuple, torch.Tensor | None, float | None]]:
    """``(buffers, batches, momentum)``: no running statistics, or buffers of each dtype, with
    and without the counter, with a momentum or (counter only) the cumulative average."""
    yield (None, None), None, 0.1
    counter = torch.empty((), dtype=torch.int64, device="meta")
    for running_dtype in DTYPES:
        buffers = tuple(torch.empty(c, dtype=running_dtype, device="meta") for _ in range(2))
        for batches, momentum in ((None, 0.1), (counter, 0.1), (counter, None)):
            yield buffers, batches, momentum


def _batch_stats_launch(x: torch.Tensor, target: Target, tile, buffers: tuple,
                        batches: torch.Tensor | None, momentum: float | None,
                        check: bool) -> Launch:
    vec = torch.empty(x.shape[1], dtype=stats_dtype(x.dtype), device="meta")
    gamma = (vec, vec) if check else (None, None)
    launches, _ = plan_batch_stats(x, 1e-5, *buffers, batches, momentum, *gamma, 0.016, target,
                                   tile)
    return launches[0]


def _finish_specialisations(target: Target) -> Iterator[tuple[str, Launch]]:
    """batch_stats for each statistics dtype, running statistics (:func:`_running_variants`),
    with and without the gamma check, on :data:`_FINISH_SHAPES`."""
    for dtype, (shape, fmt) in itertools.product((torch.float32, torch.float64),
                                                 _FINISH_SHAPES):
        x = torch.empty(shape, dtype=dtype, device="meta", memory_format=fmt)
        for (buffers, batches, momentum), check in itertools.product(
                _running_variants(shape[1]), (False, True)):
            running_dtype = None if buffers[0] is None else buffers[0].dtype
            yield (f"{dtype} {tuple(shape)} running={running_dtype} "
                   f"counter={batches is not None} momentum={momentum} check={check}"
                   ), _batch_stats_launch(x, target, None, buffers, batches, momentum, check)


def launch_specialisations(target: Target) -> Iterator[tuple[str, Launch]]:
    """Every kernel specialisation the launchers can produce for ``target``, as planned launches
    over meta tensors (never run): what ``check_kernels.py`` compiles ahead of time.

    Walks the same choices the launchers make: dtypes, both layouts, every tile of
    :func:`tile_choices` whose offsets fit, every activation and saved input/output, the merge
    kernels, normalising from the batch's or the running statistics, and shapes that change
    how Triton types the integer arguments: sizes of 1 (constants), odd sizes (no divisibility
    hint), 2-D inputs, and sizes past 2**31 (int64); and every finishing variant of
    batch_stats.
    """
    yield from _finish_specialisations(target)
    for dtype in DTYPES:
        acc = stats_dtype(dtype)
        for shape, fmt in _SPECIALISATION_SHAPES:
            x = torch.empty(shape, dtype=dtype, device="meta", memory_format=fmt)
            vec = torch.empty(shape[1], dtype=acc, device="meta")
            geo = geometry_of(x)
            layout = "channels_last" if geo.channels_last else "nchw"
            for tile in tile_choices(geo.channels_last, dtype, target.interpret):
                if not _offsets_fit(geo, tile):
                    continue
                where = f"{dtype} {layout} {tuple(shape)} tile={tile.block_a}x{tile.block_b}"
                launches, _ = plan_channel_stats(x, target, tile)
                yield where, launches[0]
                # As an in-place layer in training runs it: running statistics, the check.
                running = tuple(torch.empty(shape[1], dtype=acc, device="meta")
                                for _ in range(2))
                counter = torch.empty((), dtype=torch.int64, device="meta")
                yield where, _batch_stats_launch(x, target, tile, running, counter, 0.1, True)
                for act in KERNEL_ACTIVATIONS:
                    launches, _ = plan_normalize_act(
                        x, NormParams(vec, vec, vec, vec, act, 0.01), x, target, tile)
                    yield f"{where} {act}", launches[0]
                    # Evaluating: from running statistics in the statistics dtype.
                    launches, *_ = plan_normalize_running(
                        x, RunningParams(vec, vec, 1e-5, vec, vec, act, 0.01), x, target, tile)
                    yield f"{where} {act} running", launches[0]
                for saved_is_output, act in BACKWARD_VARIANTS:
                    label = f"{where} {act} saved={'y' if saved_is_output else 'x'}"
                    params = NormParams(vec, vec, vec, vec, act, 0.01)
                    launches, _ = plan_backward_reduce(x, x, *params, saved_is_output, target,
                                                       tile)
                    yield label, launches[0]
                    # Coefficients given, or derived from sums.
                    for coefs in (DxCoefs(vec, vec, vec), BatchSums(vec, vec, 8)):
                        launches, _ = plan_backward_dx(x, x, params, saved_is_output, coefs,
                                                       target, tile)
                        from_sums = isinstance(coefs, BatchSums)
                        yield f"{label} from_sums={from_sums}", launches[0]
