"""SyncBatchNorm across processes (torch.distributed, gloo on CPU, localhost).

Starting processes is slow (each needs torch imported), so the ranks are forked from a
forkserver that has imported torch once, each world size is launched once per backend (the torch
one, and the Triton kernels in Triton's interpreter) by one test, and its processes run every
scenario in turn; each rank records which scenarios passed, and the test reports every scenario
that failed on some rank. (A test per scenario would launch a world once per pytest worker that
runs one of its scenarios: twice the processes under ``-n 2``.) Every scenario is checked in
every rank against the full-batch float64 reference (``F.batch_norm`` + activation): outputs,
input gradients, weight/bias gradients (summed over the ranks) and running statistics.

Nothing can hang: the collectives have a timeout, and a launch in which no rank has finished a
scenario for ``STALL_SECONDS`` is killed (a deadline on progress, not on the whole launch, whose
length follows the machine's load).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
import time
import traceback
import warnings
from collections import Counter
from multiprocessing.connection import wait
from pathlib import Path

import gloo_group
import numpy as np
import pytest
import test_few_values as few_values
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers.rebuild_error import (
    EPS,
    allowed_errors,
    exact_input_gradient,
    exact_output_and_parameter_gradients,
    gradient_ratios,
    off_kink,
)
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from reference import activate
from torch import nn

import encoding_syncbn
from encoding_syncbn import SyncBatchNorm, compat, convert_inplace_abn, convert_sync_batchnorm
from encoding_syncbn.layer.inplace_policy import (
    MIN_FLOAT64_REBUILT_COUNT,
    MIN_OWN_PRECISION_COUNT,
)
from encoding_syncbn.testing import SimulatedDataParallel

C = 4
STALL_SECONDS = 180.0  # with no scenario finished by any rank (import and rendezvous included)
SLOPES = {"leaky_relu": 0.1, "elu": 0.7}
# (activation, inplace): every in-place activation, plus out-of-place ones.
MODES = [("leaky_relu", True), ("elu", True), ("identity", True), ("none", False),
         ("relu", False)]

# ---------------------------------------------------------------- helpers run in the children


def _check(actual, expected, what, dtype=torch.float64):
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(
        actual.detach().double(), expected.detach().double(), rtol=tol, atol=tol,
        msg=lambda m: f"rank {dist.get_rank()}: {what}: {m}",
    )


def _make_layer(activation, inplace, dtype=torch.float64, **kwargs):
    layer = SyncBatchNorm(C, activation=activation, slope=SLOPES.get(activation, 0.01),
                          inplace=inplace, **kwargs).to(dtype)
    with torch.no_grad():
        # Negative and zero gammas: the zero one is kept aside by the in-place layer.
        layer.weight.copy_(torch.tensor([1.5, -0.7, 0.0, 2.0]))
        layer.bias.copy_(torch.tensor([0.1, 0.2, -0.3, 0.0]))
    return layer


def _offsets(batches):
    starts = [sum(batches[:r]) for r in range(len(batches))]
    return [slice(s, s + n) for s, n in zip(starts, batches)]


def _full_batch(batches, step, seed=0):
    gen = torch.Generator().manual_seed(1000 * seed + step)
    shape = (sum(batches), C, 3, 2)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2.0 + 0.5
    grad = torch.randn(shape, generator=gen, dtype=torch.float64)
    return x, grad


def _reference(layer, x, grad, running_mean, running_var, activation):
    """Full-batch float64 BN + activation: output, dx, dw, db; updates the running stats."""
    x = x.detach().clone().requires_grad_()
    w = layer.weight.detach().double().clone().requires_grad_()
    b = layer.bias.detach().double().clone().requires_grad_()
    z = F.batch_norm(x, running_mean, running_var, w, b, True, layer.momentum, layer.eps)
    out = activate(z, activation, SLOPES.get(activation, 0.01))
    out.backward(grad)
    return out.detach(), x.grad, w.grad, b.grad


def _check_layer(batches, activation, inplace, *, dtype=torch.float64, replicas=1,
                 process_group=None, members=None, steps=2, seed=0):
    """Train one layer for a few steps in every rank; compare with the full-batch reference.

    ``batches[r]`` is global rank r's batch size; ``members`` the global ranks of
    ``process_group`` (None: all). A rank outside the group is compared with plain BN on its
    own batch.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    members = list(range(world)) if members is None else members
    synced = members if rank in members else [rank]
    layer = _make_layer(activation, inplace, dtype, process_group=process_group)
    model = SimulatedDataParallel(layer, replicas) if replicas > 1 else layer
    ref_mean = torch.zeros(C, dtype=torch.float64)
    ref_var = torch.ones(C, dtype=torch.float64)
    slices = _offsets(batches)
    for step in range(steps):
        full_x, full_grad = _full_batch(batches, step, seed)
        ref_x = torch.cat([full_x[slices[r]] for r in synced])
        ref_grad = torch.cat([full_grad[slices[r]] for r in synced])
        ref_out, ref_dx, ref_dw, ref_db = _reference(
            layer, ref_x, ref_grad, ref_mean, ref_var, activation
        )
        mine = _offsets([batches[r] for r in synced])[synced.index(rank)]

        leaf = full_x[slices[rank]].to(dtype).requires_grad_()
        out = model(leaf * 1)  # a non-leaf: the in-place layers really run in place
        out.backward(full_grad[slices[rank]].to(dtype))
        what = f"{activation} inplace={inplace} step {step}"
        assert out.shape == leaf.shape and out.dtype == dtype
        _check(out, ref_out[mine], what + " output", dtype)
        _check(leaf.grad, ref_dx[mine], what + " input grad", dtype)
        # Parameter gradients stay local (DDP averages them): their sum over the group is
        # the full-batch gradient.
        grads = torch.stack([layer.weight.grad, layer.bias.grad]).double()
        if len(synced) > 1:
            dist.all_reduce(grads, group=process_group)
        _check(grads[0], ref_dw, what + " weight grad", dtype)
        _check(grads[1], ref_db, what + " bias grad", dtype)
        _check(layer.running_mean, ref_mean, what + " running_mean", dtype)
        _check(layer.running_var, ref_var, what + " running_var", dtype)
        assert int(layer.num_batches_tracked) == step + 1
        layer.zero_grad()

    # Evaluation uses the running statistics and never synchronises.
    layer.eval()
    x = full_x[slices[rank]].to(dtype)
    with _CollectiveCounter() as counter:
        out = model(x * 1)
    assert counter.calls == {}, f"eval made collectives {counter.calls}"
    expected = activate(
        F.batch_norm(x.double(), ref_mean, ref_var, layer.weight.double(), layer.bias.double(),
                     False, 0.0, layer.eps),
        activation, SLOPES.get(activation, 0.01),
    )
    _check(out, expected, f"{activation} eval output", dtype)


class _CollectiveCounter:
    """Counts calls to torch.distributed's collectives while active (wrapping the functions)."""

    NAMES = ("all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "reduce",
             "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "gather", "scatter",
             "barrier", "all_gather_object", "broadcast_object_list")

    def __enter__(self):
        self.calls: Counter[str] = Counter()
        self.reduced: list[int] = []  # elements of each all_reduce
        self._saved = {name: getattr(dist, name) for name in self.NAMES}
        for name, fn in self._saved.items():
            setattr(dist, name, self._wrap(name, fn))
        return self

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.calls[name] += 1
            if name == "all_reduce":
                self.reduced.append(args[0].numel())
            return fn(*args, **kwargs)

        return counted

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        return False

    def take(self):
        calls, self.calls = dict(self.calls), Counter()
        return calls


# ------------------------------------------------------------------------------ scenarios


def scenario_uneven(ctx):
    """Uneven batches in every rank, every activation mode; float32 too."""
    batches = [5, 3] if ctx["world"] == 2 else [2, 5, 3]
    for activation, inplace in MODES:
        _check_layer(batches, activation, inplace)
    _check_layer(batches, "leaky_relu", True, dtype=torch.float32, seed=1)


def scenario_empty_rank(ctx):
    """A rank with 0 samples takes part: count 0, zero gradients, same running stats."""
    batches = [0, 6] if ctx["world"] == 2 else [3, 0, 4]
    for activation, inplace in (("leaky_relu", True), ("none", False)):
        _check_layer(batches, activation, inplace)


def scenario_replicas(ctx):
    """2 SimulatedDataParallel replicas in each process (uneven chunks)."""
    batches = [5, 4] if ctx["world"] == 2 else [5, 4, 2]
    for activation, inplace in (("leaky_relu", True), ("elu", True), ("none", False)):
        _check_layer(batches, activation, inplace, replicas=2)


def _two_layer_model(**kwargs):
    return nn.Sequential(
        _make_layer("leaky_relu", True, **kwargs),
        nn.Conv2d(C, C, 1).double(),
        _make_layer("none", False, **kwargs),
    )


def scenario_collective_count(ctx):
    """Exactly one all_gather forward and one all_reduce of 2C values backward per layer
    call, whatever the world size."""
    rank = dist.get_rank()
    for replicas in (1, 2):
        model = _two_layer_model()
        runner = SimulatedDataParallel(model, replicas) if replicas > 1 else model
        # Enough values a channel in the group for float64's own backward (fewer gather
        # every rank's inputs instead: ``scenario_few_values_float64``).
        x = torch.randn(4 + rank, C, 4, 4, dtype=torch.float64, requires_grad=True)
        with _CollectiveCounter() as counter:
            out = runner(x * 1)
            forward = counter.take()
            counter.reduced.clear()
            out.square().sum().backward()
            backward = counter.take()
            assert counter.reduced == [2 * C, 2 * C], f"all_reduce sizes {counter.reduced}"
            model.eval()
            runner(x * 1)
            evaluation = counter.take()
        assert forward == {"all_gather": 2}, f"replicas={replicas} forward: {forward}"
        assert backward == {"all_reduce": 2}, f"replicas={replicas} backward: {backward}"
        assert evaluation == {}, f"replicas={replicas} eval: {evaluation}"
    # sync=False, and a process group of one rank: no collective at all.
    for kwargs in ({"sync": False}, {"process_group": ctx["solo"]}):
        model = _two_layer_model(**kwargs)
        x = torch.randn(4, C, 3, 2, dtype=torch.float64, requires_grad=True)
        with _CollectiveCounter() as counter:
            model(x * 1).square().sum().backward()
        assert counter.calls == {}, f"{kwargs}: {dict(counter.calls)}"


def scenario_solo_group(ctx):
    """A process group of one rank is plain local BatchNorm."""
    rank = dist.get_rank()
    batches = [3, 4, 5][: ctx["world"]]
    _check_layer(batches, "leaky_relu", True, process_group=ctx["solo"], members=[rank])


def scenario_subgroup(ctx):
    """A 2-rank subgroup of 3 ranks; the rank outside it does plain local BN."""
    group, members = ctx["pair"], ctx["pair_ranks"]
    for activation, inplace in (("leaky_relu", True), ("elu", True), ("none", False)):
        with _CollectiveCounter() as counter:
            _check_layer([4, 3, 5], activation, inplace, process_group=group, members=members)
        if dist.get_rank() not in members:
            assert counter.calls == {}, f"non-member made collectives: {dict(counter.calls)}"


def _ddp_models(process_group):
    """A plain float64 reference net and its synchronised twin (fused in-place ABN + converted)."""
    torch.manual_seed(7)
    reference = nn.Sequential(
        nn.Conv2d(3, C, 3, padding=1, bias=False), nn.BatchNorm2d(C), nn.LeakyReLU(0.1),
        nn.Conv2d(C, C, 1), nn.BatchNorm2d(C), nn.ELU(0.7),
        nn.Conv2d(C, 2, 1),
    ).double()
    synced = convert_sync_batchnorm(copy.deepcopy(reference), process_group)
    fused = SyncBatchNorm(C, process_group=process_group, activation="leaky_relu", slope=0.1,
                          inplace=True).double()
    fused.load_state_dict(synced[1].state_dict())
    synced[1], synced[2] = fused, nn.Identity()
    assert isinstance(synced[4], SyncBatchNorm) and synced[4].process_group is process_group
    return reference, synced


def _check_ddp_training(batches, members, process_group, steps=3):
    """DDP-wrapped training vs single-process training of the whole batch of the group."""
    rank = dist.get_rank()
    reference, model = _ddp_models(process_group)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=process_group)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    slices = _offsets(batches)
    total = sum(batches)
    for step in range(steps):
        gen = torch.Generator().manual_seed(50 + step)
        x = torch.randn(total, 3, 4, 4, generator=gen, dtype=torch.float64)
        target = torch.randn(total, 2, 4, 4, generator=gen, dtype=torch.float64)
        ref_out = reference(x)
        ref_loss = (ref_out - target).square().sum() / total
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()

        out = ddp(x[slices[rank]])
        # DDP averages over the group, hence the group size: the average of these losses'
        # gradients is the full-batch loss's gradient.
        loss = (out - target[slices[rank]]).square().sum() * len(members) / total
        opt.zero_grad()
        loss.backward()
        opt.step()
        what = f"DDP step {step}"
        _check(out, ref_out[slices[rank]], what + " output")
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            _check(p, q, f"{what} parameter {name}")
        for (name, buf), ref_buf in zip(model.named_buffers(), reference.buffers()):
            _check(buf, ref_buf, f"{what} buffer {name}")
    return ddp


def scenario_ddp(ctx):
    """DDP + convert_sync_batchnorm + in-place ABN, a few SGD steps, uneven batches."""
    batches = [5, 3] if ctx["world"] == 2 else [2, 4, 3]
    ddp = _check_ddp_training(batches, list(range(ctx["world"])), None)
    # Two forwards, then one backward (gradient accumulation): the first, through frozen
    # (eval-mode) layers, must not have saved a buffer that the second, training, forward
    # (or DDP's buffer broadcast) then updates in place.
    x = torch.randn(3, 3, 4, 4, dtype=torch.float64)
    with ddp.no_sync():
        losses = []
        for frozen in (True, False):
            for module in ddp.modules():
                if isinstance(module, SyncBatchNorm):
                    module.train(not frozen)
            losses.append(ddp(x * (1 + frozen)).square().sum())
        sum(losses).backward()
    # Eval through DDP (buffers broadcast, no sync).
    ddp.eval()
    with torch.no_grad(), _CollectiveCounter() as counter:
        ddp(torch.randn(3, 3, 4, 4, dtype=torch.float64))
    assert "all_gather" not in counter.calls


def scenario_compiled_ddp(ctx):
    """torch.compile across processes: a model converted by either converter compiles to one
    graph with no break under plain ``torch.compile`` (the merge traced as functional
    collectives), in training and evaluation, and ``DDP(torch.compile(model))`` trains as
    the single-process model does on the whole batch."""
    batches = [5, 3]
    own = _offsets(batches)[dist.get_rank()]
    torch.manual_seed(7)
    base = nn.Sequential(
        nn.Conv2d(3, C, 3, padding=1, bias=False), nn.BatchNorm2d(C), nn.LeakyReLU(0.1),
        nn.Conv2d(C, C, 1), nn.BatchNorm2d(C), nn.LeakyReLU(0.1), nn.Conv2d(C, 2, 1),
    ).double()
    x = torch.randn(sum(batches), 3, 4, 4, dtype=torch.float64)
    for converter in (convert_inplace_abn, convert_sync_batchnorm):
        what = converter.__name__
        for training in (True, False):
            torch._dynamo.reset()
            model = converter(copy.deepcopy(base)).train(training)
            explained = torch._dynamo.explain(model)(x[own])
            assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
                (what, training, explained.break_reasons)
        _check_compiled_ddp_training(converter, base, x, batches)
    torch._dynamo.reset()


def scenario_compiled_empty_rank(ctx):
    """``DDP(torch.compile(model))`` in float32 with a rank of no samples: its statistics
    (zeros) stay on its graph, so that its backward joins the traced gather's collective as
    every other rank's does; the steps are those of the whole batch."""
    torch.manual_seed(7)
    base = nn.Sequential(
        nn.Conv2d(3, C, 3, padding=1, bias=False), nn.BatchNorm2d(C), nn.LeakyReLU(0.1),
        nn.Conv2d(C, 2, 1),
    ).double()
    batches = [0, 5] if ctx["world"] == 2 else [3, 0, 4]
    x = torch.randn(sum(batches), 3, 4, 4, dtype=torch.float64)
    for converter in (convert_inplace_abn, convert_sync_batchnorm):
        _check_compiled_ddp_training(converter, base, x, batches, torch.float32)
    torch._dynamo.reset()


def _check_compiled_ddp_training(converter, base, x, batches, dtype=torch.float64):
    """Two steps of ``DDP(torch.compile(converter(base)))`` (aot_eager) in ``dtype`` against
    ``base``'s on the whole batch ``x``, in float64: outputs, parameters, buffers."""
    rank, world = dist.get_rank(), dist.get_world_size()
    slices, total, what = _offsets(batches), sum(batches), converter.__name__
    torch._dynamo.reset()
    reference = copy.deepcopy(base)
    ddp = nn.parallel.DistributedDataParallel(
        torch.compile(converter(copy.deepcopy(base)).to(dtype), backend="aot_eager"))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(2):
        target = torch.randn(total, 2, 4, 4, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(step))
        ref_out = reference(x)
        ref_opt.zero_grad()
        ((ref_out - target).square().sum() / total).backward()
        ref_opt.step()
        out = ddp(x[slices[rank]].to(dtype))
        opt.zero_grad()
        ((out - target[slices[rank]].to(dtype)).square().sum() * world / total).backward()
        opt.step()
        _check(out, ref_out[slices[rank]], f"{what} compiled DDP step {step} output", dtype)
        for p, q in zip(ddp.module.parameters(), reference.parameters()):
            _check(p, q, f"{what} compiled DDP step {step} parameter", dtype)
        for b, ref_b in zip(ddp.module.buffers(), reference.buffers()):
            _check(b, ref_b, f"{what} compiled DDP step {step} buffer", dtype)


def scenario_ddp_subgroup(ctx):
    """DDP over a 2-rank subgroup; the third rank trains alone with plain local BN."""
    group, members = ctx["pair"], ctx["pair_ranks"]
    rank = dist.get_rank()
    if rank in members:
        _check_ddp_training([0, 3, 5], members, group)  # rank 0's slot stays empty
    else:
        # Outside the group: the converted model is local BN, and makes no collective.
        reference, model = _ddp_models(group)
        x = torch.randn(4, 3, 4, 4, dtype=torch.float64)
        with _CollectiveCounter() as counter:
            out = model(x)
            out.square().sum().backward()
        ref_out = reference(x)
        assert counter.calls == {}, f"non-member made collectives: {dict(counter.calls)}"
        _check(out, ref_out, "non-member output")


def scenario_inplace_abn(ctx):
    """mapillary's API (encoding_syncbn.inplace_abn): InPlaceABNSync and inplace_abn_sync
    merge over their group (WORLD, active_group's pair), ABN and InPlaceABN stay per process.
    Output, input gradient and running statistics vs y = elu(xhat * (|w| + eps) + b) (ABN: w)
    on the batch of the ranks that merge."""
    from encoding_syncbn import inplace_abn as iabn

    rank, world = dist.get_rank(), ctx["world"]
    pair = iabn.active_group(rank != 0)
    assert iabn.active_group(True) is dist.group.WORLD and iabn.active_group(False) is None
    everyone = list(range(world))
    cases = [(iabn.ABN, {}, [rank]), (iabn.InPlaceABN, {}, [rank]),
             (iabn.InPlaceABNSync, {}, everyone),
             (iabn.InPlaceABNSync, {"group": pair}, [1, 2] if rank else [0]),
             (iabn.inplace_abn_sync, {}, everyone)]
    batches = [3, 2, 4]
    x, grad = _full_batch(batches, 0, seed=5)
    pieces = _offsets(batches)
    for make, kwargs, ranks in cases:
        what = f"{make.__name__}{kwargs} over {ranks}"
        layer = _make_layer("elu", False)
        if make is not iabn.inplace_abn_sync:
            module = make(C, activation="elu", activation_param=SLOPES["elu"], **kwargs).double()
            module.load_state_dict(layer.state_dict())
            layer = module
        gamma = layer.weight.detach().clone()
        if make is not iabn.ABN:
            gamma = gamma.abs() + layer.eps
        merged = torch.cat([x[pieces[r]] for r in ranks]).requires_grad_()
        running = [torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)]
        expected = activate(F.batch_norm(merged, *running, gamma, layer.bias.detach(), True,
                                         0.1, layer.eps), "elu", SLOPES["elu"])
        mine = slice(sum(batches[r] for r in ranks if r < rank), None)
        expected.backward(torch.cat([grad[pieces[r]] for r in ranks]))
        leaf = x[pieces[rank]].clone().requires_grad_()
        if make is iabn.inplace_abn_sync:
            out = make(leaf * 1, layer.weight, layer.bias, layer.running_mean,
                       layer.running_var, True, 0.1, layer.eps, "elu", SLOPES["elu"])
        else:
            out = layer(leaf * 1)
        out.backward(grad[pieces[rank]])
        _check(out, expected[mine][: batches[rank]], what + " output")
        _check(leaf.grad, merged.grad[mine][: batches[rank]], what + " input grad")
        _check(layer.running_mean, running[0], what + " running_mean")
        _check(layer.running_var, running[1], what + " running_var")


def scenario_few_values_float64(ctx):
    """Float64 over 3 to ``few_values.FEW`` values a channel in the whole group, on uneven
    ranks with 1-2 DataParallel replicas in each (generated as tests/test_few_values.py
    generates its cases, the same in every rank): every rank's input gradient within the
    README's bound against the exact one (``assert_float64_bound``), from every rank's inputs
    and dy gathered in backward (``layer/whole_batch.py``), in one all_gather."""
    world = ctx["world"]

    @settings(max_examples=12, deadline=None, derandomize=True, database=None,
              phases=[Phase.generate])  # no shrinking: the ranks must draw alike
    @given(activation=st.sampled_from(["identity", "leaky_relu", "elu", "relu"]),
           replicas=st.integers(1, 2), spatial=st.sampled_from([(1, 1), (1, 2), (3, 1)]),
           data=st.data())
    def case(activation, replicas, spatial, data):
        shape, gamma, beta, x, dy = few_values.bound_case(activation, world * replicas,
                                                          spatial, data, most=few_values.FEW)
        cuts = sorted(data.draw(st.lists(st.integers(1, shape[0] - 1), min_size=world - 1,
                                         max_size=world - 1, unique=True), label="cuts"))
        batches = [end - start for start, end in zip([0, *cuts], [*cuts, shape[0]])]
        mine = _offsets(batches)[dist.get_rank()]
        layer = SyncBatchNorm(shape[1], activation=activation,
                              slope=SLOPES.get(activation, 0.01), dtype=torch.float64)
        with torch.no_grad():
            layer.weight.copy_(gamma)
            layer.bias.copy_(beta)
        model = SimulatedDataParallel(layer, replicas) if replicas > 1 else layer
        leaf = x[mine].clone().requires_grad_()
        out = model(leaf * 1)
        with _CollectiveCounter() as counter:
            (grad,) = torch.autograd.grad(out, leaf, dy[mine])
        assert counter.calls == {"all_gather": 1}, f"backward: {dict(counter.calls)}"
        grads = [None] * world
        dist.all_gather_object(grads, grad)
        theirs = _reference(layer, x, dy, torch.zeros(shape[1], dtype=torch.float64),
                            torch.ones(shape[1], dtype=torch.float64), activation)[1]
        few_values.assert_float64_bound(torch.cat(grads), theirs, x, dy, gamma, beta,
                                        activation, f"{activation} {batches} x{replicas} "
                                        f"{shape}")

    case()


def scenario_far_from_zero_float64(ctx):
    """Float64 over 1024 to 2048 values a channel whose mean lies 10^2.5 to 10^4 standard
    deviations from 0 (``few_values._far_from_zero_case``), in place or not, on uneven ranks
    with 1-2 DataParallel replicas in each (the same cases in every rank): every rank's
    input gradient within the README's bound (``helpers.rebuild_error``). Each rank's rounded
    mean shifts every normalised value of the group unless the ranks gather their means'
    errors with their means (``distributed._MergeAcrossProcesses``). ``along``: over 112 to
    256 values a channel, an output gradient half along xhat (``few_values.along_xhat``), where
    the gap between a replica's merged mean and the ranks' is taken exact
    (``functional._mean_gap``)."""
    _far_from_zero_scenario(ctx["world"], torch.float64, 2.5, st.booleans())


def scenario_far_from_zero_float32(ctx):
    """``scenario_far_from_zero_float64`` in float32, means 10 to 10^4 standard deviations
    from 0, output gradients as drawn: each rank's float32 mean goes to the gather with its
    rounding, the ranks merge in float64, and the merged mean's rounding to float32 is taken
    out of xhat (``functional._mean_offset``). Elements within their rounding of the
    activation's kink are moved off it (``off_kink``, as
    ``few_values.test_float32_bound_on_inputs_far_from_zero`` does)."""
    _far_from_zero_scenario(ctx["world"], torch.float32, 1.0, st.just(False))


def scenario_compiled_far_from_zero_float64(ctx):
    """``scenario_far_from_zero_float64`` through ``DDP(torch.compile(layer))`` (aot_eager),
    means 10 to 10^4 standard deviations from 0: the layer is traced as its formula with the
    ranks' merge in functional collectives (``distributed.merge_traced``). Each rank gathers
    its mean's error with its mean (``compiled_mean.rank_stats``, whose M2 differentiates
    into exact deviations), and the formula normalises with the merged mean's error taken
    out through the bias (``compiled_mean.shifted_bias``): a rounded float64 mean shifts
    every xhat of its channel alike, hundreds of ulps at 10^3."""
    _far_from_zero_scenario(ctx["world"], torch.float64, 1.0, st.booleans(), "aot_eager")


def scenario_compiled_far_from_zero_float32(ctx):
    """``scenario_compiled_far_from_zero_float64`` in float32, output gradients as drawn: the
    merged float64 mean's rounding to float32 is taken out through the bias, per channel (a
    float32 mean rounded apart from nn.BatchNorm2d's shifts every xhat of its channel alike,
    which ELU's slope carries)."""
    _far_from_zero_scenario(ctx["world"], torch.float32, 1.0, st.just(False), "aot_eager")


def _far_from_zero_scenario(world: int, dtype: torch.dtype, fewest_decades: float,
                            along_xhat: st.SearchStrategy[bool],
                            compiler: str | None = None) -> None:
    """``compiler``: a ``torch.compile`` backend the layer runs under, wrapped in DDP, one
    replica a rank (None: eager, 1-2 simulated DataParallel replicas a rank)."""
    @settings(max_examples=4 if compiler is None else 6, deadline=None, derandomize=True,
              database=None, phases=[Phase.generate])  # no shrinking: the ranks draw alike
    @given(activation=st.sampled_from(["identity", "leaky_relu", "elu"]),
           inplace=st.booleans(),
           replicas=st.integers(1, 2) if compiler is None else st.just(1),
           decades=st.floats(fewest_decades, 4.0), along=along_xhat, data=st.data())
    def case(activation, inplace, replicas, decades, along, data):
        values = (112, 256) if along else (1024, 2048)
        shape, x, dy, gamma, beta = few_values._far_from_zero_case(data, decades, activation,
                                                                  values)
        if along:
            gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="dy"))
            dy = few_values.along_xhat(x, gen)
        x, dy, gamma, beta = (t.to(dtype) for t in (x, dy, gamma, beta))
        x = off_kink(x, gamma, beta, activation)
        samples, channels = shape[:2]
        cuts = sorted(data.draw(st.lists(st.integers(1, samples - 1), min_size=world - 1,
                                         max_size=world - 1, unique=True), label="cuts"))
        batches = [end - start for start, end in zip([0, *cuts], [*cuts, samples])]
        mine = _offsets(batches)[dist.get_rank()]
        slope = few_values.SLOPES.get(activation, 0.01)
        layer = SyncBatchNorm(channels, eps=EPS, activation=activation, slope=slope,
                              inplace=inplace, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(gamma)
            layer.bias.copy_(beta)
        model = SimulatedDataParallel(layer, replicas) if replicas > 1 else layer
        if compiler is not None:
            torch._dynamo.reset()
            model = nn.parallel.DistributedDataParallel(torch.compile(layer, backend=compiler))
        leaf = x[mine].clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the out-of-place fallback's warning, where it runs
            out = model(leaf * 1)
        out.backward(dy[mine])  # DDP's reducer waits for the parameters' gradients
        grads = [None] * world
        dist.all_gather_object(grads, leaf.grad)
        ratios = gradient_ratios(torch.cat(grads), x, dy, gamma, beta, activation, slope)
        few_values._assert_within_bound(ratios, gamma, beta,
                                        f"{activation} inplace={inplace} {batches} "
                                        f"x{replicas} mean/std 1e{decades:.2g} along={along} "
                                        f"compiler={compiler} {shape}")

    case()


def scenario_mixed_precision_ranks(ctx):
    """Uneven ranks of which some take their statistics in float64 and the others do not:
    an fp32, fp16 or bf16 call computes in float64 on a rank of fewer than
    ``MIN_OWN_PRECISION_COUNT`` values a channel (``functional.computes_in`` judges each
    process's count) and in float32 on the others, so every rank gathers float64 rows of one
    layout (``distributed._MergeAcrossProcesses``) and all-reduces float64 gradients; fp64 on
    either side of ``MIN_FLOAT64_REBUILT_COUNT``. In place or not, half inputs into float32
    parameters: each rank's output and input gradient and the ranks' summed weight and bias
    gradients within the README's bound (``_assert_bound_on_the_whole_batch``)."""
    world = ctx["world"]

    @settings(max_examples=10, deadline=None, derandomize=True, database=None,
              phases=[Phase.generate])  # no shrinking: the ranks must draw alike
    @given(dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16,
                                  torch.float64]),
           activation=st.sampled_from(["identity", "leaky_relu", "elu"]),
           inplace=st.booleans(), spatial=st.sampled_from([(1, 1), (2, 2), (3, 1)]),
           few=st.lists(st.booleans(), min_size=world, max_size=world).filter(
               lambda few: any(few) and not all(few)),
           data=st.data())
    def case(dtype, activation, inplace, spatial, few, data):
        limit = MIN_FLOAT64_REBUILT_COUNT if dtype == torch.float64 else MIN_OWN_PRECISION_COUNT
        per_sample = spatial[0] * spatial[1]
        fewest, most = -(-2 // per_sample), (limit - 1) // per_sample
        batches = [data.draw(st.integers(fewest, most) if under else
                             st.integers(most + 1, (limit + 40) // per_sample),
                             label="batch") for under in few]
        shape = (sum(batches), C * 2, *spatial)
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
        # ELU: |gamma| <= 1 and beta >= 0, z above about -4 (``few_values.bound_case``).
        largest = 1.0 if activation == "elu" else 10.0
        gamma = (torch.empty(shape[1]).uniform_(0.1, largest, generator=gen)
                 * torch.randn(shape[1], generator=gen).sign())
        beta = gamma.abs() * torch.empty(shape[1]).uniform_(-3.0, 3.0, generator=gen)
        if activation == "elu":
            beta = beta.abs()
        x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.5).to(dtype)
        dy = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        params = torch.float64 if dtype == torch.float64 else torch.float32
        slope = SLOPES.get(activation, 0.01)
        layer = SyncBatchNorm(shape[1], activation=activation, slope=slope, inplace=inplace,
                              dtype=params)
        twin = nn.BatchNorm2d(shape[1], dtype=params)
        for norm in (layer, twin):
            with torch.no_grad():
                norm.weight.copy_(gamma)
                norm.bias.copy_(beta)
        mine = _offsets(batches)[dist.get_rank()]
        leaf = x[mine].clone().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the out-of-place fallback's warning, where it runs
            out = layer(leaf * 1)
        assert out.dtype == dtype
        out.backward(dy[mine])
        pieces = [None] * world
        dist.all_gather_object(pieces, (out.detach(), leaf.grad))
        ours = [torch.cat([piece[i] for piece in pieces]) for i in range(2)]
        summed = torch.stack([layer.weight.grad, layer.bias.grad]).double()
        dist.all_reduce(summed)
        leaf = x.clone().requires_grad_()
        theirs = activate(twin(leaf), activation, slope)
        theirs.backward(dy)
        _assert_bound_on_the_whole_batch(
            (*ours, *summed), (theirs.detach(), leaf.grad, twin.weight.grad, twin.bias.grad),
            x, dy, gamma, beta, activation, world,
            f"{dtype} {activation} inplace={inplace} {batches} {shape}")

    case()


def _assert_bound_on_the_whole_batch(ours, theirs, x, dy, gamma, beta, activation: str,
                                     world: int, what: str) -> None:
    """``ours`` and ``theirs`` (nn.BatchNorm2d + the activation on the whole batch, in x's
    precision): ``(y, dx, dw, db)``. Per channel, ours' error against the long-double
    reference (``helpers.rebuild_error``) within the README's bound (``allowed_errors``: 3x
    the largest of theirs, half an ulp of x's dtype at the value's size and, for dx, torch's
    typical relative error times its xhat term; y's size: the largest of z's terms; dx's:
    the channel's largest |dx|; dw, db: the root of their terms' squares,
    ``test_half_precision``'s rule, rounded once a rank and once in the sum of the ranks' dw
    and db)."""
    slope = SLOPES.get(activation, 0.01)
    y, dw, db, y_size, dw_size, db_size = exact_output_and_parameter_gradients(
        x, dy, gamma, beta, activation, slope)
    dx, xhat_term = exact_input_gradient(x, dy, gamma, beta, activation, slope)
    dims = (0, 2, 3)
    for name, got, torch_got, exact, size, roundings, term in (
            ("y", ours[0], theirs[0], y, y_size, 1, None),
            ("dx", ours[1], theirs[1], dx, np.abs(dx).max(axis=dims), 1, xhat_term),
            ("dw", ours[2], theirs[2], dw, dw_size, world + 1, None),
            ("db", ours[3], theirs[3], db, db_size, world + 1, None)):
        def error(value, exact=exact):
            error = np.abs(value.detach().double().numpy().astype(np.longdouble) - exact)
            return error.max(axis=dims) if error.ndim > 1 else error
        allowed = allowed_errors(error(torch_got), size, x.dtype, term, roundings)
        ratio = torch.from_numpy((error(got) / allowed).astype(np.float64))
        few_values._assert_within_bound(ratio, gamma, beta, f"{what} {name}")


def scenario_mixed_dtype_ranks(ctx):
    """A float32 layer fed float64 on one rank and float32 on the others, over few values a
    channel: the float64 rank alone could take a whole-batch backward
    (``layer.whole_batch``), which the others cannot join; every rank's forward row says so, and
    all take the merge's own backward. Outputs, input gradients, the summed parameter
    gradients and the running statistics are the whole batch's (float32's tolerance)."""
    rank, world = dist.get_rank(), ctx["world"]
    batches = [3] * world
    x, dy = _full_batch(batches, 0)
    own = _offsets(batches)[rank]
    dtype = torch.float64 if rank == 0 else torch.float32
    for activation, inplace in (("none", False), ("leaky_relu", True)):
        layer = _make_layer(activation, inplace, dtype=torch.float32)
        running = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
        ref_out, ref_dx, ref_dw, ref_db = _reference(layer, x, dy, *running, activation)
        leaf = x[own].to(dtype).requires_grad_()
        out = layer(leaf * 1)
        out.backward(dy[own].to(dtype))
        what = f"{activation} inplace={inplace} rank input {dtype}"
        _check(out, ref_out[own], f"{what} output", torch.float32)
        _check(leaf.grad, ref_dx[own], f"{what} input gradient", torch.float32)
        grads = torch.stack([layer.weight.grad, layer.bias.grad]).double()
        dist.all_reduce(grads)
        _check(grads[0], ref_dw, f"{what} weight gradient", torch.float32)
        _check(grads[1], ref_db, f"{what} bias gradient", torch.float32)
        _check(layer.running_mean, running[0], f"{what} running_mean", torch.float32)
        _check(layer.running_var, running[1], f"{what} running_var", torch.float32)


def scenario_double_backward(ctx):
    """A gradient penalty through a layer synchronised across processes: a clear error on
    every rank (before any collective of that backward), never a silently wrong graph."""
    layer = SyncBatchNorm(C, activation="leaky_relu", inplace=False, dtype=torch.float64)
    x = torch.randn(4, C, 3, dtype=torch.float64, requires_grad=True)
    out = layer(x * 1)
    try:
        torch.autograd.grad(out.square().sum(), x, create_graph=True)
    except RuntimeError as error:
        assert "double backward" in str(error) and "across processes" in str(error), error
    else:
        raise AssertionError("double backward across processes did not raise")


SCENARIOS = {
    2: ["uneven", "empty_rank", "replicas", "collective_count", "solo_group", "ddp",
        "double_backward", "compiled_ddp", "compiled_empty_rank", "few_values_float64",
        "far_from_zero_float64", "far_from_zero_float32", "compiled_far_from_zero_float64",
        "compiled_far_from_zero_float32", "mixed_precision_ranks", "mixed_dtype_ranks"],
    3: ["uneven", "empty_rank", "replicas", "collective_count", "subgroup", "ddp_subgroup",
        "inplace_abn", "compiled_empty_rank", "few_values_float64", "mixed_precision_ranks",
        "mixed_dtype_ranks"],
}


def _write(path, results):
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results))
    tmp.replace(path)


def _worker(rank, world, port, outdir, backend):
    results = {}
    path = Path(outdir) / f"rank{rank}.json"
    try:
        encoding_syncbn.set_backend(backend)
        if backend == "triton" and compat.triton_interpreting():
            # As conftest does in the parent (a rank does not run it): Triton 3.6's
            # interpreter needs it to run the kernels' loops under NumPy 2.4.
            import triton_interpreter

            triton_interpreter.install()
        gloo_group.join(rank, world, port)
        # Every rank creates every group, in the same order.
        solos = [dist.new_group([r]) for r in range(world)]
        ctx = {"world": world, "solo": solos[rank]}
        if world == 3:
            ctx["pair_ranks"] = [1, 2]  # group ranks differ from global ranks
            ctx["pair"] = dist.new_group(ctx["pair_ranks"])
        for name in SCENARIOS[world]:
            started = time.perf_counter()
            try:
                globals()[f"scenario_{name}"](ctx)
            except BaseException:
                results[name] = traceback.format_exc()
                _write(path, results)
                # The peers are left inside a collective: leave at once, they fail fast.
                os._exit(1)
            results[name] = f"ok {time.perf_counter() - started:.2f}s"
            _write(path, results)
            dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        results["<setup>"] = traceback.format_exc()
        _write(path, results)
        os._exit(1)


# ------------------------------------------------------------------------------ the parent


def _process_context():
    """A forkserver whose one process has imported torch, DDP's imports and this module, so
    that each rank is a cheap fork of it (spawn would import torch again in every rank)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                    _worker.__module__])
    return context


def _launch(world, backend):
    """Run every scenario of this world size on ``backend``; return {scenario: [per-rank
    record]}."""
    outdir = tempfile.mkdtemp(prefix=f"syncbn_dist{world}_")
    # The parent holds the rendezvous store, so the port is free and stays ours.
    store = gloo_group.rendezvous(world)
    context = _process_context()
    processes = [
        context.Process(target=_worker, args=(rank, world, store.port, outdir, backend),
                        daemon=True)
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    _join_while_progressing(processes, outdir)
    hung = [rank for rank, p in enumerate(processes) if p.is_alive()]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(timeout=10)
    records = {}
    for rank in range(world):
        path = Path(outdir) / f"rank{rank}.json"
        records[rank] = json.loads(path.read_text()) if path.exists() else {}
    shutil.rmtree(outdir, ignore_errors=True)
    del store
    return {"records": records, "hung": hung,
            "exitcodes": [p.exitcode for p in processes]}


def _join_while_progressing(processes, outdir) -> None:
    """Wait for the ranks to exit, or until none has written a record (finished a scenario)
    for ``STALL_SECONDS``."""
    def progress():
        return sorted((p.name, p.stat().st_mtime_ns) for p in Path(outdir).glob("rank*.json"))

    seen, since = progress(), time.monotonic()
    while any(p.is_alive() for p in processes):
        wait([p.sentinel for p in processes if p.is_alive()], timeout=1.0)
        now = progress()
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since > STALL_SECONDS:
            return


# The ranks are processes of their own: each_backend's choice reaches them as an argument (its
# ATen slabs, a monkeypatch of this process, would not).
@pytest.mark.parametrize("each_backend", ["torch", "triton"], indirect=True)
@pytest.mark.parametrize("world", sorted(SCENARIOS))
def test_distributed(world, each_backend):
    """Every scenario of ``SCENARIOS[world]`` passes on every rank."""
    backend = each_backend
    launch = _launch(world, backend)
    records = launch["records"]
    problems = []
    for scenario in SCENARIOS[world]:
        for rank in range(world):
            record = records[rank].get(scenario)
            if record is None:
                setup = records[rank].get("<setup>", "")
                problems.append(f"{scenario}, rank {rank}: not reached {setup}")
            elif not record.startswith("ok"):
                problems.append(f"{scenario}, rank {rank}:\n{record}")
    if problems:
        if launch["hung"]:
            problems.append(f"ranks {launch['hung']} were killed, stalled")
        pytest.fail(f"{world} ranks on {backend}:\n" + "\n".join(problems))
