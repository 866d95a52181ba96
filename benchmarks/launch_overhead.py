"""Host time of Triton's own launcher, the part of it that runs without a GPU, per launch.

    python benchmarks/launch_overhead.py [--iters 20000] [--repeats 5]

``host_overhead.py`` times everything the layer's host path does for a call but the launches.
On a GPU each launch then goes through Triton's ``JITFunction.run``: it binds the arguments and
specialises each one (a pointer's dtype and 16-byte alignment, an int equal to 1 or divisible
by 16), turns that into the compiled kernel's cache key, and only then asks the driver to
launch (launch metadata, ``cuLaunchKernel``). The binding and the key need no GPU: this script
times them for each launch of one single-replica training call, (8, 256, 128, 128) fp16 NCHW
in place with leaky_relu, planned for sm_90 with 132 SMs, with the key cache warm as in a
training loop. The driver's part needs a GPU and is not timed here.

Uses Triton's internals (``create_function_from_signature``, ``compute_cache_key``,
``make_backend``), as ``JITFunction.run`` calls them in Triton 3.6 to 3.9; with another Triton
it may say it cannot measure and exit (0, nothing recorded). Times are
thread CPU time, the fastest of ``--repeats`` means. Prints the table (``--record``: into
benchmarks/RESULTS.md too); the last line is one JSON object with ``launcher_us_per_call``.
"""

from __future__ import annotations

import argparse
import json
import time

import results
import torch

SHAPE, DTYPE, C = (8, 256, 128, 128), torch.float16, 256
H100_SMS = 132


def planned_launches():
    """The launches of one single-replica in-place training call, in order, with the op that
    plans each (the layer's own planners, on CPU tensors: nothing is launched)."""
    from encoding_syncbn.kernels.triton.backward_dx import _plan_batch_backward
    from encoding_syncbn.kernels.triton.channel_stats import _plan_batch_stats
    from encoding_syncbn.kernels.triton.normalize_act import _plan_normalize_act
    from encoding_syncbn.kernels.triton.plan import Target

    target = Target(False, H100_SMS)
    x, dy = torch.empty(SHAPE, dtype=DTYPE), torch.empty(SHAPE, dtype=DTYPE)
    ones, zeros, batches = torch.ones(C), torch.zeros(C), torch.zeros((), dtype=torch.long)
    count = x.numel() // C
    vectors = (zeros, ones, ones, zeros)  # mean, invstd, weight, bias
    stats, _ = _plan_batch_stats(x, 1e-5, zeros.clone(), ones.clone(), batches, 0.1, ones,
                                 zeros, 0.016, target)
    normalize, _ = _plan_normalize_act(x, *vectors, "leaky_relu", 0.01, x, target)
    backward, _ = _plan_batch_backward(x, dy, *vectors, "leaky_relu", 0.01, True, count, target)
    ops = [("batch_stats", stats), ("normalize_act", normalize), ("batch_backward", backward)]
    return [(op, launch) for op, launches in ops for launch in launches]


def launcher_step(launch, backend):
    """What ``JITFunction.run`` does for ``launch`` before the driver: the arguments bound and
    specialised, and the cache key (its per-device key cache warm)."""
    from triton import knobs
    from triton.runtime import jit

    kernel = launch.kernel
    binder = jit.create_function_from_signature(kernel.signature, kernel.params, backend)
    options = {**launch.constexprs, "num_warps": launch.num_warps, "enable_fp_fusion": True}
    key_cache: dict = {}

    # The compilation knobs run() passes: Triton 3.6 has the first, 3.9 both.
    knob_names = [name for name in ("instrumentation_mode", "fpsan_homomorphic_casts")
                  if hasattr(knobs.compilation, name)]

    def step():
        kwargs = dict(options, debug=kernel.debug or knobs.runtime.debug,
                      **{name: getattr(knobs.compilation, name) for name in knob_names})
        _, specialization, bound_options = binder(*launch.args, **kwargs)
        return jit.compute_cache_key(key_cache, specialization, bound_options)

    step()
    return step


def time_us(step, iters: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(iters):
            step()
        best = min(best, (time.thread_time() - start) / iters * 1e6)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20000, help="launches per repeat")
    parser.add_argument("--repeats", type=int, default=5,
                        help="repeats; the fastest is reported (default 5)")
    results.add_arguments(parser)
    args = parser.parse_args()
    from encoding_syncbn.kernels.triton.plan import INTERPRET

    if INTERPRET:
        print("TRITON_INTERPRET is set: the kernels are interpreted, not launched through "
              "Triton's launcher; run without it (no GPU is needed)")
        return
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend

        backend = make_backend(GPUTarget("cuda", 90, 32))
        steps = [(op, launch, launcher_step(launch, backend))
                 for op, launch in planned_launches()]
    except (ImportError, AttributeError, TypeError) as error:
        print(f"cannot measure Triton's launcher with this Triton: {type(error).__name__}: "
              f"{error}")
        return
    rows = []
    for op, launch, step in steps:
        kernel_name = launch.kernel.fn.__name__
        rows.append([op, kernel_name, len(launch.args),
                     round(time_us(step, args.iters, args.repeats), 2)])
        print(" ".join(str(cell) for cell in rows[-1]), flush=True)
    total = round(sum(row[3] for row in rows), 1)
    table = results.markdown_table(["op", "kernel", "arguments", "binding + key us"], rows)
    table += f"\n\nPer layer call ({len(rows)} launches): {total} us."
    print(table)
    import triton

    results.record(args, f"launch_overhead.py (cpu, triton {triton.__version__})", table, notes=(
        "Triton's JITFunction.run before the driver (arguments bound and specialised, the cache "
        "key from its warm key cache), per launch of one single-replica in-place training call "
        f"{SHAPE} fp16 NCHW, leaky_relu, planned for sm_90 with {H100_SMS} SMs: thread CPU time, "
        f"the fastest of {args.repeats} means over {args.iters} calls. Not timed: the driver's "
        "part of each launch (launch metadata, cuLaunchKernel), which needs a GPU. Not part of "
        "host_overhead.py's figures, which replace the launches with no-ops."))
    print(json.dumps({"launcher_us_per_call": total, "launches": len(rows)}))


if __name__ == "__main__":
    main()
