"""Triton kernels for the ops of :mod:`encoding_syncbn.kernels.torch_ops`.

Same names, signatures, semantics and dtype rules as ``torch_ops`` (the reference); read its
docstring for the notation (``z``, ``y``, ``dz``, ``xhat``). One job a file: ``plan`` (geometry,
tiles, memoised launch planning), ``tiles`` (device functions addressing a tile),
``activations`` (the activation device functions), ``partials`` (a split reduction's merge by
its last program), ``double_double`` (float64's sums and finishing steps, rounded once), one
file per op with its kernels and launch planner (``finalize_stats``: what
follows the batch statistics per channel) and ``ops`` (launch, torch.library registration,
the public functions).

Memory traffic per element of an activation of B bytes, the least each pass can move
(``benchmarks/traffic.py`` counts what the kernels move):

    forward   channel_stats (read x)             + normalize_act (read x, write y)      = 3B
    backward  backward_reduce (read saved, dy)   + backward_dx (read saved, dy, write dx) = 5B

Tensor geometry. An ``(N, C, *)`` input is handled as ``N`` images of ``C`` channels and
``S = prod(*)`` positions, read where it lies:

* NCHW (contiguous): element ``(n, c, s)`` at ``(n*C + c)*S + s``. A program owns one channel and
  walks tiles of ``[BLOCK_A images, BLOCK_B positions]``.
* channels_last (C innermost, also 3-D/5-D and 2-D inputs): element at ``r*C + c`` with the row
  ``r = n*S + s``. A program owns ``BLOCK_B`` channels and walks tiles of ``[BLOCK_A rows,
  BLOCK_B channels]``.

Any other strides are copied once to NCHW. The grid is ``(channel blocks, splits)``: the tiles of
a channel block are dealt out to ``splits`` programs in contiguous ranges. A split reduction's
programs write one partial result each into a ``[splits, C]`` buffer, and the last of a channel
block to finish merges them in index order in the same launch (``partials``): the statistics
then finish there too (``finalize_stats``), so a training step is two launches forward and two
backward, evaluation one.

Accumulation is in float32 for half, bfloat16 and float32 inputs and in float64 for float64
inputs, which has no wider dtype: its kernels' sums and per-channel results are taken in
double-double and rounded once (``double_double``); per-channel vectors come in (contiguous:
see ``kernels.backend``) and go out in that statistics dtype.
"""
