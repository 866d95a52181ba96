"""Reliability: failures, timeouts, recovery, ordering, copies, threads, soak, checkpointing,
bad inputs, late replicas and nested wrappers. Every numerical check compares with plain
PyTorch (``nn.BatchNorm1d`` on the whole batch) in float64. No test can hang:
``ENCODING_SYNCBN_TIMEOUT`` is small unless a test sets it. Whether a call waited on a peer is
read from the waits it made (the ``replica_waits`` fixture), never from the clock: a bound in
seconds fails on a loaded machine.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
import random
import re
import threading
import time
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from backends import each_backend, one_backend
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from merge import merge_stats
from replica_waits import (
    assert_waited_only_on_this_step,
    ended_by_an_error,
    gave_up_at_the_deadline,
)
from torch import nn
from torch.optim.swa_utils import AveragedModel, update_bn
from torch.utils.checkpoint import checkpoint

from encoding_syncbn import SyncBatchNorm, SyncError
from encoding_syncbn.sync import group as sbn_sync
from encoding_syncbn.testing import SimulatedDataParallel, replicate

DT = torch.float64
TOL = {"rtol": 1e-9, "atol": 1e-11}
# Every test runs on every backend (the Triton kernels under the interpreter on the CPU): what
# lives above the kernels must hold whichever ops run under it (a recompute compares
# statistics of the original call's backend; failures, threads and freed graphs pass through
# the kernels' launches). Those marked ``one_backend`` run on the torch backend only: they
# call no op, or copy modules (20 s a run interpreted), or run 300 steps.
pytestmark = each_backend


@pytest.fixture(autouse=True)
def _short_timeout(monkeypatch):
    monkeypatch.setenv(sbn_sync.TIMEOUT_ENV, "3")


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    # Tiny tensors: intra-op threads only add OpenMP barriers, which crawl on a busy machine
    # (the timing bounds below are about the replica threads, not about OpenMP).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class UserError(Exception):
    """Raised by user code inside a replica."""


# ---- models ---------------------------------------------------------------------------------


class Net(nn.Module):
    """fc1 -> bn1 (+ leaky_relu) -> fc2 -> bn2 -> bn2 again -> head.

    ``sync=True``: SyncBatchNorm layers (bn1 with the activation fused, in place);
    ``sync=False``: the plain PyTorch reference, for the whole batch.
    ``fault(where, x, tag)`` lets a test break or delay one replica (``tag`` holds the replica
    index) at ``where``: "before" bn1, "inside" (bn1's input), "between" bn1 and bn2, "after"
    the last sync layer.
    """

    def __init__(self, sync: bool = True, features: int = 5, width: int = 6, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.fc1 = nn.Linear(features, width, dtype=DT)
        self.fc2 = nn.Linear(width, width, dtype=DT)
        self.head = nn.Linear(width, 3, dtype=DT)
        if sync:
            self.bn1 = SyncBatchNorm(width, activation="leaky_relu", slope=0.1, dtype=DT)
            self.bn2 = SyncBatchNorm(width, dtype=DT)
            self.act1 = nn.Identity()
        else:
            self.bn1 = nn.BatchNorm1d(width, dtype=DT)
            self.bn2 = nn.BatchNorm1d(width, dtype=DT)
            self.act1 = nn.LeakyReLU(0.1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator, dtype=DT) * 0.5)
            for bn in (self.bn1, self.bn2):
                bn.weight.add_(1.0)
        self.fault = None

    def forward(self, x, tag=None):
        h = self.fc1(x)
        self._maybe_fault("before", h, tag)
        h = self.act1(self.bn1(self._maybe_fault("inside", h, tag)))
        self._maybe_fault("between", h, tag)
        h = self.bn2(self.fc2(h))
        h = self.bn2(h * 0.5 + 1.0)
        self._maybe_fault("after", h, tag)
        return self.head(h)

    def _maybe_fault(self, where, h, tag):
        if self.fault is not None and tag is not None:
            out = self.fault(where, h, int(tag[0]))
            if out is not None:
                return out
        return h


def reference_of(net: Net) -> Net:
    ref = Net(sync=False, features=net.fc1.in_features, width=net.fc1.out_features)
    ref.load_state_dict(net.state_dict())
    return ref


def tags(batch: int, replicas: int) -> torch.Tensor:
    """For each sample, the index of the replica that ``torch.chunk`` sends it to."""
    pieces = torch.chunk(torch.empty(batch), replicas)
    return torch.cat([torch.full((len(p),), j) for j, p in enumerate(pieces)])


def batch(n: int, seed: int, features: int = 5):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, features, generator=g, dtype=DT) * 2 + 0.5,
        torch.randn(n, 3, generator=g, dtype=DT),
    )


def step(model, optimizer, x, y, replicas=None, *extra):
    """One SGD step; under SimulatedDataParallel when ``replicas`` is given."""
    runner = SimulatedDataParallel(model, replicas) if replicas else model
    return train_step(runner, model, optimizer, x, y, *extra)


def train_step(runner: nn.Module, model: nn.Module, optimizer, x, y, *extra):
    """One SGD step of ``model``, called through ``runner``."""
    out = runner(x, *extra)
    loss = F.mse_loss(out, y)
    optimizer.zero_grad()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    return out.detach(), grads


def assert_step_exact(net: Net, ref: Net, runner: nn.Module, opts, x, y, *extra):
    """A step of ``net`` through ``runner`` (given ``extra`` arguments) matches one of its
    reference ``ref`` on the whole batch: output, gradients, state afterwards."""
    out, grads = train_step(runner, net, opts[0], x, y, *extra)
    ref_out, ref_grads = train_step(ref, ref, opts[1], x, y)
    torch.testing.assert_close(out, ref_out, **TOL)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, **TOL)
    assert_same_state(net, ref)


def assert_same_state(a: nn.Module, b: nn.Module, **tol):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], msg=key, **(tol or TOL))


def snapshot(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_unchanged(model: nn.Module, before: dict):
    after = model.state_dict()
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0, equal_nan=True, msg=key)


def run_replicas(model: nn.Module, inputs: list[tuple]):
    """Replicate ``model`` and run replica j on ``inputs[j]`` in its own thread; returns what
    each replica returned or raised."""
    return run_replicas_from(replicate(model, len(inputs)), inputs)


def scattered(x: torch.Tensor, replicas: int):
    t = tags(len(x), replicas)
    return [(xc.clone(), tc) for xc, tc in zip(torch.chunk(x, replicas), torch.chunk(t, replicas))]


def waited_for(message: str) -> list[int]:
    found = re.search(r"waiting for ranks \[([\d, ]*)\]", message)
    assert found, message
    return [int(r) for r in found.group(1).split(",") if r.strip()]


# ---- 1. a failing replica: peers raise SyncError fast, the caller sees the original ----------


def _bad_channels(rank):
    def fault(where, h, r):
        if where == "inside" and r == rank:
            return h[:, :-1]  # wrong channel count into bn1, on this replica only
        return None

    return fault


def _raise_at(spot, rank):
    def fault(where, h, r):
        if where == spot and r == rank:
            raise UserError(f"user code failed on replica {r}")
        return None

    return fault


@pytest.mark.parametrize("bad", [0, 1, 3])
@pytest.mark.parametrize("spot", ["inside", "between"])
def test_replica_failing_inside_or_after_joining_fails_peers_fast(monkeypatch, replica_waits,
                                                                 spot, bad):
    """inside: wrong channels into bn1 on one replica; between: that replica joined at bn1,
    then user code raised and its thread ended before bn2. Fast: no peer waits for the
    timeout (60 s), each sees the failure."""
    monkeypatch.setenv(sbn_sync.TIMEOUT_ENV, "60")
    x, _ = batch(8, seed=1)
    net = Net()
    if spot == "inside":
        net.fault, original, label = _bad_channels(bad), ValueError, net.bn1._label()
    else:
        net.fault, original, label = _raise_at("between", bad), UserError, net.bn2._label()
    results = run_replicas(net, scattered(x, 4))
    assert ended_by_an_error(replica_waits) and not gave_up_at_the_deadline(replica_waits)
    assert isinstance(results[bad], original)
    for rank in {0, 1, 2, 3} - {bad}:
        error = results[rank]
        assert isinstance(error, SyncError), (rank, error)
        message = str(error)
        assert f"{label}, rank {rank}:" in message, message
        # names the replica that failed, or the ranks that did not arrive
        assert f"replica {bad} raised" in message or f"ranks [{bad}]" in message, message
        if rank == 0 and spot == "inside":
            assert bad in waited_for(message), message
        if rank == 0 and spot == "between":
            assert f"ranks [{bad}] exited without reaching call 0" in message, message
    # Through SimulatedDataParallel: the original exception, not the SyncErrors.
    replica_waits.clear()
    with pytest.raises(original):
        SimulatedDataParallel(net, 4)(x, tags(8, 4))
    assert ended_by_an_error(replica_waits) and not gave_up_at_the_deadline(replica_waits)


# ---- 2. a replica that dies before any sync layer: caught by the timeout ---------------------


def test_failure_before_first_sync_layer_is_bounded_by_timeout(monkeypatch, replica_waits):
    monkeypatch.setenv(sbn_sync.TIMEOUT_ENV, "0.5")
    x, _ = batch(6, seed=2)
    net = Net()
    net.fault = _raise_at("before", 2)
    results = run_replicas(net, scattered(x, 3))
    # Waited out: the timeout ended a wait, and no wait ended otherwise than in an error.
    assert gave_up_at_the_deadline(replica_waits)
    assert all(w.error is not None for w in replica_waits)
    assert isinstance(results[2], UserError)
    for rank in (0, 1):
        assert isinstance(results[rank], SyncError)
        assert net.bn1._label() in str(results[rank])
    assert "did not arrive within 0.5 s" in str(results[0])
    assert "ENCODING_SYNCBN_TIMEOUT" in str(results[0])
    with pytest.raises(UserError):
        SimulatedDataParallel(net, 3)(x, tags(6, 3))
    # The value is read at call time.
    monkeypatch.setenv(sbn_sync.TIMEOUT_ENV, "1.5")
    assert sbn_sync.timeout_seconds() == 1.5
    monkeypatch.delenv(sbn_sync.TIMEOUT_ENV)
    assert sbn_sync.timeout_seconds() == sbn_sync.DEFAULT_TIMEOUT_SECONDS


@one_backend
@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "1s"])
def test_bad_timeout_value_is_a_clear_value_error(monkeypatch, replica_waits, value):
    monkeypatch.setenv(sbn_sync.TIMEOUT_ENV, value)
    with pytest.raises(ValueError, match="ENCODING_SYNCBN_TIMEOUT"):
        sbn_sync.timeout_seconds()
    net = Net()
    before = snapshot(net)
    x, _ = batch(8, seed=3)
    with pytest.raises(ValueError, match="ENCODING_SYNCBN_TIMEOUT"):
        SimulatedDataParallel(net, 4)(x)
    # Each wait raised at once (reading the bound) or on a peer's failure: none waited it out.
    assert replica_waits and all(w.error is not None for w in replica_waits)
    assert any("ENCODING_SYNCBN_TIMEOUT must be" in w.error for w in replica_waits)
    assert_unchanged(net, before)


# ---- 3. the step after a failed one ----------------------------------------------------------


def _everyone_raises_at(spot):
    def fault(where, h, r):
        if where == spot:
            raise UserError(f"replica {r}")
        return None

    return fault


# The failed step's timeout: short only where a peer's wait must end by it (a replica that
# raises before bn1 never joins its group); elsewhere every replica must first reach bn1, which
# a loaded machine's threads may take longer than a short timeout to do.
@pytest.mark.parametrize(
    "fault, timeout",
    [
        (_bad_channels(2), "60"),
        (_raise_at("between", 1), "60"),
        (_raise_at("before", 3), "0.5"),
        (_everyone_raises_at("before"), "60"),  # no replica reaches a sync layer
        (_everyone_raises_at("between"), "60"),  # bn2 is replicated but never run
    ],
    ids=["inside", "between", "before", "all-before", "all-between"],
)
def test_step_after_failed_step_is_correct(monkeypatch, replica_waits, fault, timeout):
    monkeypatch.setenv(sbn_sync.TIMEOUT_ENV, timeout)
    net = Net()
    x, y = batch(8, seed=4)
    net.fault = fault
    # Keep the exception (and so the failed step's replicas) alive during the next step.
    with pytest.raises((UserError, ValueError)) as failed:
        SimulatedDataParallel(net, 4)(x, tags(8, 4))
    monkeypatch.setenv(sbn_sync.TIMEOUT_ENV, "3")
    net.fault = None
    failed_groups = [w.group for w in replica_waits]
    ref = reference_of(net)  # the state the failed step left (running stats it did update)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for seed in (5, 6):
        x, y = batch(8, seed=seed)
        replica_waits.clear()
        out, grads = step(net, opt, x, y, 4)
        assert_waited_only_on_this_step(replica_waits, failed_groups, 4)
        ref_out, ref_grads = step(ref, ref_opt, x, y)
        torch.testing.assert_close(out, ref_out, **TOL)
        for g, rg in zip(grads, ref_grads):
            torch.testing.assert_close(g, rg, **TOL)
        assert_same_state(net, ref)
    assert failed.value is not None


class _OneSyncLayer(nn.Module):
    """A model whose only sync layer a step may skip: its replicas fail before it, or it
    sits in a head used only in training."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4, dtype=DT)
        self.aux = SyncBatchNorm(4, activation="leaky_relu", dtype=DT)
        self.fail = False

    def forward(self, x):
        h = self.fc(x)
        if self.fail:
            raise UserError("before the only sync layer")
        return h + self.aux(h * 1) if self.training else h


def _fail_before_the_layer(model, parallel, x):
    model.fail = True
    with pytest.raises(UserError):
        parallel(x)
    model.fail = False


def _two_eval_steps(model, parallel, x):
    model.eval()
    parallel(x)
    parallel(x)
    model.train()


@pytest.mark.parametrize("skip", [_fail_before_the_layer, _two_eval_steps],
                         ids=["replicas failed before it", "eval steps"])
def test_steps_that_never_reach_the_only_sync_layer_do_not_grow_its_group(skip):
    """Its replicas of those steps were made and freed without running: the next step's
    replicas form a group of their own (not one with the dead ones, waiting for them)."""
    model = _OneSyncLayer()
    parallel = SimulatedDataParallel(model, 2)
    x = torch.randn(6, 3, dtype=DT)
    parallel(x)
    skip(model, parallel, x)
    ref_layer = nn.BatchNorm1d(4, dtype=DT)
    ref_layer.load_state_dict(model.aux.state_dict())
    x = torch.randn(6, 3, dtype=DT)
    out = parallel(x)
    with torch.no_grad():
        h = model.fc(x)
        expected = h + F.leaky_relu(ref_layer(h), 0.01)
    torch.testing.assert_close(out, expected, **TOL)
    assert_same_state(model.aux, ref_layer)


def test_failed_step_frees_its_graph_without_a_gc_pass():
    """A replica raises between two sync layers: once the caller drops the exception, the
    step's graph is freed by reference counting (no payload stays in a meeting, no cycle
    through the exception's traceback)."""

    class Failing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = SyncBatchNorm(3, dtype=DT)
            self.b = SyncBatchNorm(3, dtype=DT)

        def forward(self, x):
            h = self.a(_GraphWatch.apply(x))
            if x[0, 0, 0] == 1234.0:
                raise UserError("between the layers")
            return self.b(h)

    parallel = SimulatedDataParallel(Failing(), 3)
    x = torch.randn(6, 3, 2, dtype=DT, requires_grad=True)
    with torch.no_grad():
        x[2, 0, 0] = 1234.0  # in the chunk of replica 1
    _GraphWatch.alive.clear()
    gc.disable()
    try:
        with pytest.raises(UserError):
            parallel(x)
        assert _GraphWatch.alive == set()
    finally:
        gc.enable()


# ---- 4. several layers, one layer several times, and out-of-order calls ---------------------


@pytest.mark.parametrize("replicas,n", [(2, 8), (3, 7), (4, 9), (4, 5)])
def test_several_layers_and_repeated_calls_match_reference(replicas, n):
    net = Net()
    ref = reference_of(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for seed in range(3):
        x, y = batch(n, seed=10 + seed)
        out, grads = step(net, opt, x, y, replicas)
        ref_out, ref_grads = step(ref, ref_opt, x, y)
        torch.testing.assert_close(out, ref_out, **TOL)
        for g, rg in zip(grads, ref_grads):
            torch.testing.assert_close(g, rg, **TOL)
        assert_same_state(net, ref)
    assert int(net.bn2.num_batches_tracked) == 6  # called twice a step


class TwoLayers(nn.Module):
    def __init__(self, swap_on=None, extra_call_on=None):
        super().__init__()
        self.a = SyncBatchNorm(4, dtype=DT)
        self.b = SyncBatchNorm(4, dtype=DT)
        self.swap_on, self.extra_call_on = swap_on, extra_call_on

    def forward(self, x, tag):
        rank = int(tag[0])
        if rank == self.swap_on:
            return self.a(self.b(x))
        x = self.b(self.a(x))
        if rank == self.extra_call_on:
            x = self.b(x)
        return x


@pytest.mark.parametrize(
    "model,replicas",
    [(TwoLayers(swap_on=1), 2), (TwoLayers(swap_on=0), 3), (TwoLayers(swap_on=2), 4),
     (TwoLayers(extra_call_on=1), 3), (TwoLayers(extra_call_on=0), 2)],
    ids=["swap-1-of-2", "swap-master-of-3", "swap-2-of-4", "extra-call-1", "extra-call-master"],
)
def test_replicas_calling_layers_differently_raise_sync_error_fast(monkeypatch, replica_waits,
                                                                   model, replicas):
    monkeypatch.setenv(sbn_sync.TIMEOUT_ENV, "60")
    before = snapshot(model)
    x = torch.randn(4 * replicas, 4, dtype=DT)
    with pytest.raises(SyncError, match="different|fewer times") as raised:
        SimulatedDataParallel(model, replicas)(x, tags(len(x), replicas))
    # Seen at a poll, not waited out.
    assert ended_by_an_error(replica_waits) and not gave_up_at_the_deadline(replica_waits)
    assert "SyncBatchNorm(4)" in str(raised.value)
    if model.swap_on is not None:
        assert "order" in str(raised.value)
        assert_unchanged(model, before)


class SlowReplica(nn.Module):
    """a -> b, with replica 1 late at a: its peers poll for a while."""

    def __init__(self):
        super().__init__()
        self.a = SyncBatchNorm(4, dtype=DT)
        self.b = SyncBatchNorm(4, dtype=DT)

    def forward(self, x, tag):
        if int(tag[0]) == 1:
            time.sleep(0.15)
        return self.b(self.a(x))


def test_slow_replica_is_not_mistaken_for_out_of_order_calls(monkeypatch):
    """A replica whose answer arrives while it checks its peers must take that answer, even
    if the master has meanwhile moved on to the next layer."""
    check_order = sbn_sync.ReplicaGroup._check_order

    def slow_check_order(self, rank, *args):
        if rank == 2:  # widen the window between a poll that found nothing and the check
            time.sleep(0.3)
        return check_order(self, rank, *args)

    monkeypatch.setattr(sbn_sync.ReplicaGroup, "_check_order", slow_check_order)
    model = SlowReplica()
    ref_a, ref_b = nn.BatchNorm1d(4, dtype=DT), nn.BatchNorm1d(4, dtype=DT)
    x = torch.randn(12, 4, dtype=DT)
    for _ in range(2):
        out = SimulatedDataParallel(model, 3)(x, tags(12, 3))
        torch.testing.assert_close(out, ref_b(ref_a(x)), **TOL)
    torch.testing.assert_close(model.b.running_var, ref_b.running_var, **TOL)


# ---- 5. copies: deepcopy, pickle, torch.save, AveragedModel ---------------------------------


def _copies(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return {
        "deepcopy": copy.deepcopy(model),
        "pickle": pickle.loads(pickle.dumps(model)),
        "torch.save": torch.load(buffer, weights_only=False),
    }


@one_backend
def test_copies_work_before_during_and_after_parallel_forward():
    net = Net()
    copies = dict(_copies(net))  # before any forward
    x, y = batch(8, seed=20)
    SimulatedDataParallel(net, 4)(x)  # after a parallel forward
    copies.update({f"after-{k}": v for k, v in _copies(net).items()})
    replicas = replicate(net, 3)  # while replicas (and their open group) exist
    copies.update({f"during-{k}": v for k, v in _copies(net).items()})
    # the replicas still work after the original was copied
    parts = [(c.clone(),) for c in torch.chunk(batch(9, seed=21)[0], 3)]
    results = run_replicas_from(replicas, parts)
    assert all(isinstance(r, torch.Tensor) for r in results), results

    # Every copy is independent (no group travels with it) and trains like the original.
    for name, twin in copies.items():
        for layer in (twin.bn1, twin.bn2):
            assert layer._open_group is None and layer._replica_slot is None, name
        original = copy.deepcopy(twin)  # a copy of the copy, as a second reference
        ref = reference_of(twin)
        opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (twin, original, ref)]
        for seed in range(3):
            x, y = batch(10, seed=30 + seed)
            out, _ = step(twin, opts[0], x, y, 4)
            out2, _ = step(original, opts[1], x, y, 3)
            ref_out, _ = step(ref, opts[2], x, y)
            torch.testing.assert_close(out, ref_out, **TOL, msg=name)
            torch.testing.assert_close(out2, ref_out, **TOL, msg=name)
        assert_same_state(twin, ref)
        assert_same_state(original, ref)


def run_replicas_from(replicas, inputs):
    """Run replica j on ``inputs[j]`` in its own thread; see ``run_replicas``."""
    results: list = [None] * len(inputs)

    def run(j):
        try:
            results[j] = replicas[j](*inputs[j])
        except BaseException as error:
            results[j] = error

    threads = [threading.Thread(target=run, args=(j,), daemon=True) for j in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # every wait of a replica is bounded by the timeout: each ends or raises
    return results


def test_averaged_model_of_a_synced_model_matches_reference():
    net = Net()
    ref = reference_of(net)
    averaged, ref_averaged = AveragedModel(net), AveragedModel(ref)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for seed in range(2):
        x, y = batch(9, seed=40 + seed)
        step(net, opt, x, y, 4)
        step(ref, ref_opt, x, y)
        averaged.update_parameters(net)
        ref_averaged.update_parameters(ref)
    assert_same_state(averaged, ref_averaged)
    # The averaged model (a deepcopy) runs under SimulatedDataParallel, with update_bn.
    loader = [batch(8, seed=50 + i)[0] for i in range(3)]
    update_bn(loader, SimulatedDataParallel(averaged, 4))
    update_bn(loader, ref_averaged)
    assert_same_state(averaged, ref_averaged)
    x, _ = batch(8, seed=60)
    averaged.eval()
    ref_averaged.eval()
    torch.testing.assert_close(SimulatedDataParallel(averaged, 4)(x), ref_averaged(x), **TOL)


# ---- 6. two models trained at the same time in two threads ----------------------------------


def test_two_models_in_two_threads_do_not_interfere():
    steps = 5

    def train(net, replicas, seed0, sink):
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        try:
            for s in range(steps):
                x, y = batch(6 + s % 5, seed=seed0 + s)
                sink.append(step(net, opt, x, y, replicas)[0])
        except BaseException as error:  # reported by the main thread
            sink.append(error)

    nets = [Net(seed=1), Net(seed=2)]
    refs = [reference_of(n) for n in nets]
    sinks: list[list] = [[], []]
    threads = [
        threading.Thread(target=train, args=(nets[i], (3, 4)[i], 100 * i, sinks[i]), daemon=True)
        for i in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()  # every wait of a replica is bounded by the timeout: a step ends or raises
    for i in range(2):
        opt = torch.optim.SGD(refs[i].parameters(), lr=0.05)
        assert len(sinks[i]) == steps and all(isinstance(o, torch.Tensor) for o in sinks[i]), (
            sinks[i][-1]
        )
        for s in range(steps):
            x, y = batch(6 + s % 5, seed=100 * i + s)
            torch.testing.assert_close(sinks[i][s], step(refs[i], opt, x, y)[0], **TOL)
        assert_same_state(nets[i], refs[i])


# ---- 7. soak --------------------------------------------------------------------------------


@one_backend
def test_soak_300_steps_random_batch_sizes():
    rng = random.Random(1234)
    net = Net(seed=7)
    ref = reference_of(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.02, momentum=0.9)
    sizes = [rng.randint(2, 13) for _ in range(300)]
    # 2 and 3 give fewer chunks than replicas; 2, 3 and 5 a chunk of one sample, which is fine
    # as long as the whole batch has more than one (nn.BatchNorm1d raises only for that).
    assert {2, 3, 5} <= set(sizes)
    for s, n in enumerate(sizes):
        x, y = batch(n, seed=1000 + s)
        out, _ = step(net, opt, x, y, 4)
        ref_out, _ = step(ref, ref_opt, x, y)
        if s % 50 == 0:
            torch.testing.assert_close(out, ref_out, rtol=1e-8, atol=1e-9)
    assert_same_state(net, ref, rtol=1e-7, atol=1e-9)
    assert int(net.bn2.num_batches_tracked) == 600


# ---- 8. recomputation with torch.utils.checkpoint -------------------------------------------


class Block(nn.Module):
    def __init__(self, sync: bool):
        super().__init__()
        make = (
            (lambda **kw: SyncBatchNorm(6, dtype=DT, **kw))
            if sync
            else (lambda **kw: nn.BatchNorm1d(6, dtype=DT))
        )
        self.fc1 = nn.Linear(6, 6, dtype=DT)
        self.bn1 = make(activation="leaky_relu", slope=0.2, inplace=True)
        self.fc2 = nn.Linear(6, 6, dtype=DT)
        self.bn2 = make(activation="elu", slope=1.0, inplace=False)
        self.sync = sync

    def forward(self, h):
        h = self.bn1(self.fc1(h))
        if not self.sync:
            h = F.leaky_relu(h, 0.2)
        h = self.bn2(self.fc2(h))
        return h if self.sync else F.elu(h)


class CheckpointNet(nn.Module):
    def __init__(self, sync=True, mode=None):
        super().__init__()
        torch.manual_seed(3)
        self.stem = nn.Linear(5, 6, dtype=DT)
        self.block1, self.block2 = Block(sync), Block(sync)
        self.head = nn.Linear(6, 2, dtype=DT)
        self.mode = mode  # None, "non-reentrant" or "reentrant"
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "bn" in name:
                    p.uniform_(0.5, 1.5) if name.endswith("weight") else p.uniform_(-0.5, 0.5)

    def forward(self, x):
        h = self.stem(x)
        for block in (self.block1, self.block2):
            if self.mode is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.mode == "reentrant")
        return self.head(h)


def test_checkpoint_non_reentrant_matches_reference(replica_waits):
    ckpt = CheckpointNet(mode="non-reentrant")
    ref = CheckpointNet(sync=False)
    ref.load_state_dict(ckpt.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ckpt, ref)]
    for s in range(2):
        # Enough values a channel to train, and recompute, in place (rebuilds_from_count).
        x, _ = batch(112, seed=70 + s)
        y = torch.randn(112, 2, dtype=DT, generator=torch.Generator().manual_seed(s))
        replica_waits.clear()
        out_c, grads_c = step(ckpt, opts[0], x, y, 4)
        # One wait a replica and sync layer, in the forward: the recomputation waits on no peer.
        assert len(replica_waits) == 4 * 4 and ended_by_an_error(replica_waits) == []
        out_r, grads_r = step(ref, opts[1], x, y)
        torch.testing.assert_close(out_c, out_r, **TOL)
        for g_c, gr in zip(grads_c, grads_r):
            torch.testing.assert_close(g_c, gr, **TOL)
        assert_same_state(ckpt, ref)  # running stats updated once a step, not at recompute
    assert int(ckpt.block1.bn1.num_batches_tracked) == 2


def test_checkpoint_of_conv_and_sync_layer_matches_plain_run():
    """The recompute finds its call by statistics computed by the original call's backend
    (with Triton's, ATen's differ in the last bits and no call was found)."""

    class ConvBN(nn.Module):
        def __init__(self, mode):
            super().__init__()
            torch.manual_seed(5)
            self.conv = nn.Conv2d(3, 8, 3, padding=1, dtype=DT)
            self.bn = SyncBatchNorm(8, activation="leaky_relu", dtype=DT)
            self.mode = mode

        def forward(self, x):
            block = lambda h: self.bn(self.conv(h))  # noqa: E731
            return checkpoint(block, x, use_reentrant=False) if self.mode else block(x)

    x = torch.randn(4, 3, 5, 5, dtype=DT, generator=torch.Generator().manual_seed(6))
    grads = []
    for mode in (True, False):
        model = ConvBN(mode)
        SimulatedDataParallel(model, 2)(x).square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for g_ckpt, g_plain in zip(*grads):
        torch.testing.assert_close(g_ckpt, g_plain, **TOL)


def test_simulated_data_parallel_gathers_replica_losses_as_a_vector():
    """A model returning its loss (0-dim) per replica: a vector of the replicas' losses, with
    nn.DataParallel's warning (torch.cat refused 0-dim tensors)."""

    class Loss(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = SyncBatchNorm(3, dtype=DT)

        def forward(self, x):
            return self.bn(x).square().mean()

    x = torch.randn(6, 3, 2, dtype=DT)
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        losses = SimulatedDataParallel(Loss(), 3)(x)
    twin = nn.BatchNorm1d(3, dtype=DT)
    expected = torch.stack([y.square().mean() for y in twin(x).chunk(3)])
    torch.testing.assert_close(losses, expected, **TOL)


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")  # the threads: eager
def test_simulated_data_parallel_refuses_compiled_modules_and_runs_compiled():
    """Replicating a module compiled on its own (torch.compile's wrapper, around the model or
    a block of it, or ``module.compile()``, before or after wrapping) would run the original
    module in every replica, unsynchronised: refused, naming the module and what works, the
    model untouched; that (``torch.compile(SimulatedDataParallel(model))``) computes the
    whole batch's statistics."""
    x = torch.randn(6, 3, 2, dtype=DT)
    model = nn.Sequential(SyncBatchNorm(3, dtype=DT))
    compiled = torch.compile(model, backend="eager")
    with pytest.raises(TypeError, match=r"the module compiled on its own.*"
                                        r"torch.compile\(SimulatedDataParallel\(model"):
        SimulatedDataParallel(compiled, 2)
    assert compiled._orig_mod is model
    with pytest.raises(TypeError, match="module '0' compiled on its own"):
        SimulatedDataParallel(nn.Sequential(torch.compile(model, backend="eager")), 2)
    wrapped = SimulatedDataParallel(model, 2)
    model[0].compile(backend="eager")
    with pytest.raises(TypeError, match="module '0' compiled on its own"):
        wrapped(x)
    model = nn.Sequential(SyncBatchNorm(3, dtype=DT))
    out = torch.compile(SimulatedDataParallel(model, 2), backend="eager")(x)
    torch.testing.assert_close(out, nn.BatchNorm1d(3, dtype=DT)(x), **TOL)


class _Twice(nn.Module):
    """conv + a layer, ``calls`` times in one forward, each call under its own checkpoint
    (``mode``) or not: a siamese network's two views (``calls=2``, two inputs), an iterative
    refinement's loop (one input, fed back)."""

    def __init__(self, norm: nn.Module, mode: bool, calls: int = 2):
        super().__init__()
        torch.manual_seed(8)
        self.conv, self.norm = nn.Conv2d(2, 2, 1, dtype=DT), norm
        self.mode, self.calls = mode, calls

    def branch(self, h):
        return self.norm(self.conv(h))

    def forward(self, a, b=None):
        run = (lambda h: checkpoint(self.branch, h, use_reentrant=False)) if self.mode else (
            self.branch)
        if b is not None:
            return run(a), run(b)
        for _ in range(self.calls):
            a = run(a)
        return a


def _plain_twin(calls: int = 2) -> _Twice:
    return _Twice(nn.Sequential(nn.BatchNorm2d(2, dtype=DT), nn.LeakyReLU(0.5)), False, calls)


def _grads(model, runner, *inputs):
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = runner(*leaves)
    out = torch.cat(out) if isinstance(out, tuple) else out
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=DT).view_as(out))
    return [out, *(t.grad for t in leaves), *(p.grad for p in model.parameters())]


def test_checkpointed_calls_with_equal_chunks_are_exact_or_refused():
    """A layer called on two views under checkpoint: exact where the views differ on every
    replica; where one replica's chunks are equal but the whole batches differ, its
    recomputation cannot tell the calls apart: refused naming the layer (before, it took the
    first call's statistics: wrong gradients, 0.8 off at scale 1.3)."""
    a = torch.randn(4, 2, 8, 8, dtype=DT, generator=torch.Generator().manual_seed(9))
    b = a * 3 + 1
    for equal_chunk in (False, True):
        if equal_chunk:
            b[:2] = a[:2]  # replica 0's chunk of the second view is its chunk of the first
        # In place (enough values a channel to train so, rebuilds_from_count).
        model = _Twice(SyncBatchNorm(2, activation="leaky_relu", slope=0.5, dtype=DT), True)
        twin = _plain_twin()
        twin.norm[0].load_state_dict(model.norm.state_dict())
        runner = SimulatedDataParallel(model, 2)
        if equal_chunk:
            with pytest.raises(RuntimeError, match=r"SyncBatchNorm\(2\).*cannot tell which"):
                _grads(model, runner, a, b)
            continue
        expected = _grads(twin, twin, a, b)
        for got, want in zip(_grads(model, runner, a, b), expected):
            torch.testing.assert_close(got, want, **TOL)


def test_a_layer_checkpointed_in_a_long_loop_recomputes_every_call():
    """One layer called 70 times in a forward, each call under checkpoint (an iterative
    refinement): every recomputation finds its call, kept while its graph lives (before,
    only the last 64 calls were kept, and backward failed blaming non-determinism)."""
    model = _Twice(SyncBatchNorm(2, activation="leaky_relu", slope=0.5, dtype=DT), True, 70)
    twin = _plain_twin(70)
    x = torch.randn(4, 2, 3, 3, dtype=DT, generator=torch.Generator().manual_seed(10))
    expected = _grads(twin, twin, x)
    for got, want in zip(_grads(model, SimulatedDataParallel(model, 2), x), expected):
        torch.testing.assert_close(got, want, **TOL)


class _Gated(nn.Module):
    """A checkpointed region where the layer's output feeds no differentiable op (a gate), or
    the same layer also runs on the same batch without grad (a target pass)."""

    def __init__(self, norm: nn.Module, target_pass: bool):
        super().__init__()
        torch.manual_seed(11)
        self.conv, self.conv2 = nn.Conv2d(2, 2, 1, dtype=DT), nn.Conv2d(2, 2, 1, dtype=DT)
        self.norm, self.target_pass = norm, target_pass

    def gated(self, h):
        return self.conv2(h) * (self.norm(self.conv(h)) > 0).to(h.dtype)

    def forward(self, x):
        if not self.target_pass:
            return checkpoint(self.gated, x, use_reentrant=False)
        y = checkpoint(lambda h: self.norm(self.conv(h)), x, use_reentrant=False)
        with torch.no_grad():
            target = self.norm(self.conv(x))
        return (y - target).square() + y


@pytest.mark.parametrize("target_pass", [False, True])
def test_checkpointed_calls_found_whatever_their_graph(target_pass):
    """A call whose output's node is gone by backward (its output fed only a comparison), and
    a call beside one made without grad on the same batch: each recomputation finds its call
    (neither is a reentrant checkpoint's) and the gradients are the plain model's."""
    x = torch.randn(4, 2, 8, 8, dtype=DT, generator=torch.Generator().manual_seed(12))
    model = _Gated(SyncBatchNorm(2, activation="leaky_relu", slope=0.5, dtype=DT), target_pass)
    plain = _Gated(nn.Sequential(nn.BatchNorm2d(2, dtype=DT), nn.LeakyReLU(0.5)), target_pass)
    SimulatedDataParallel(model, 2)(x).sum().backward()
    plain(x).sum().backward()
    for (name, got), expected in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, expected.grad, **TOL, msg=name)


@pytest.mark.parametrize("replicas", [None, 4])
def test_checkpoint_around_an_inplace_layer_on_its_own_input_raises(replicas):
    """In place over the checkpoint's own input destroys what the recompute needs: that must
    be an error, never wrong gradients."""
    fc = nn.Linear(5, 6, dtype=DT)
    bn = SyncBatchNorm(6, activation="leaky_relu", slope=0.2, dtype=DT)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn = fc, bn

        def forward(self, x):
            return checkpoint(self.bn, self.fc(x), use_reentrant=False)

    model = Model()
    runner = SimulatedDataParallel(model, replicas) if replicas else model
    # Enough values a channel to train in place (inplace_policy.rebuilds_from_count).
    out = runner(batch(112, seed=90)[0])
    with pytest.raises(RuntimeError):
        out.sum().backward()


def test_checkpoint_reentrant_under_sync_raises_clearly(monkeypatch, replica_waits):
    monkeypatch.setenv(sbn_sync.TIMEOUT_ENV, "1")
    net = CheckpointNet(mode="reentrant")
    x, _ = batch(8, seed=80)
    out = SimulatedDataParallel(net, 4)(x)
    replica_waits.clear()
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        out.sum().backward()
    assert replica_waits == []  # refused before any replica waited on another


# ---- 9. bad inputs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_input,error,match",
    [
        (lambda: torch.randn(8, 3, dtype=DT), ValueError, "channels"),
        (lambda: torch.randn(8, 4, 5, dtype=DT)[:, :2], ValueError, "channels"),
        (lambda: torch.randn(8, dtype=DT), ValueError, "1-D"),
        (lambda: torch.randint(0, 5, (8, 4)), TypeError, "floating"),
        (lambda: torch.ones(8, 4, dtype=torch.bool), TypeError, "floating"),
    ],
    ids=["channels", "channels-3d", "1d", "int", "bool"],
)
@pytest.mark.parametrize("replicas", [None, 4])
def test_bad_input_raises_and_leaves_state_untouched(replica_waits, make_input, error, match,
                                                     replicas):
    layer = SyncBatchNorm(4, activation="leaky_relu", dtype=DT)
    before = snapshot(layer)
    runner = SimulatedDataParallel(layer, replicas) if replicas else layer
    with pytest.raises(error, match=match):
        runner(make_input())
    assert replica_waits == []  # every replica refused its chunk before waiting on another
    assert_unchanged(layer, before)
    # and the layer still works afterwards
    x = torch.randn(8, 4, dtype=DT)
    ref = nn.BatchNorm1d(4, dtype=DT)
    torch.testing.assert_close(runner(x.clone()), F.leaky_relu(ref(x), 0.01), **TOL)
    assert_same_state(layer, ref)


@pytest.mark.parametrize("replicas", [None, 4])
def test_nan_and_inf_propagate_like_batch_norm(replicas):
    x = torch.randn(8, 4, 3, dtype=DT)
    x[5, 1, 2] = float("nan")
    x[2, 3, 0] = float("inf")
    layer = SyncBatchNorm(4, dtype=DT)
    ref = nn.BatchNorm1d(4, dtype=DT)
    runner = SimulatedDataParallel(layer, replicas) if replicas else layer
    out = runner(x.clone())
    expected = ref(x)
    torch.testing.assert_close(out, expected, **TOL, equal_nan=True)
    assert torch.isfinite(out[:, [0, 2]]).all()
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(layer.state_dict()[key], value, **TOL, equal_nan=True)


@one_backend
@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_features": 0},
        {"num_features": -3},
        {"num_features": 2.5},
        {"num_features": "4"},
        {"num_features": 4, "activation": "tanh"},
        {"num_features": 4, "activation": "relu", "inplace": True},
        {"num_features": 4, "activation": "leaky_relu", "slope": 0.0, "inplace": True},
        {"num_features": 4, "activation": "elu", "slope": -1.0},
    ],
)
def test_bad_constructor_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        SyncBatchNorm(**kwargs)


def _inplace_layer_and_reference(reference_class: type[nn.Module]):
    """An in-place leaky_relu layer, and ``reference_class`` with the same parameters."""
    layer = SyncBatchNorm(4, activation="leaky_relu", slope=0.1, dtype=DT)
    ref = reference_class(4, dtype=DT)
    with torch.no_grad():
        for m in (layer, ref):
            m.weight.copy_(torch.tensor([1.5, -0.7, 0.3, 2.0]))
            m.bias.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
    return layer, ref


@pytest.mark.parametrize("replicas", [None, 4])
def test_inplace_on_leaf_requiring_grad_warns_once_and_is_correct(replicas):
    layer, ref = _inplace_layer_and_reference(nn.BatchNorm1d)
    runner = SimulatedDataParallel(layer, replicas) if replicas else layer
    dy = torch.randn(8, 4, 3, dtype=DT)
    for _ in range(2):
        x = torch.randn(8, 4, 3, dtype=DT, requires_grad=True)
        kept = x.detach().clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = runner(x)
        warned = [w for w in caught if "out of place" in str(w.message)]
        if replicas is None:
            assert len(warned) == (1 if _ == 0 else 0)
            assert out is not x
        assert torch.equal(x.detach(), kept)  # the leaf was not overwritten
        xr = kept.clone().requires_grad_(True)
        expected = F.leaky_relu(ref(xr), 0.1)
        torch.testing.assert_close(out, expected, **TOL)
        (gx, gw, gb) = torch.autograd.grad((out * dy).sum(), (x, layer.weight, layer.bias))
        (rx, rw, rb) = torch.autograd.grad((expected * dy).sum(), (xr, ref.weight, ref.bias))
        for a, b in ((gx, rx), (gw, rw), (gb, rb)):
            torch.testing.assert_close(a, b, **TOL)
    assert_same_state(layer, ref)


def _inference_tensor(x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return x.clone()


@pytest.mark.parametrize("make_input", [
    lambda base: base.requires_grad_()[1:],
    lambda base: base.requires_grad_().transpose(2, 3),
    lambda base: base[:1].expand(9, -1, -1, -1),
    _inference_tensor,
], ids=["slice of a leaf", "transpose of a leaf", "expanded", "inference tensor"])
def test_inplace_on_an_input_that_cannot_be_overwritten_is_out_of_place(make_input):
    """Refused before anything is written: the input and its base stay as they were, and the
    result and gradients are those of nn.BatchNorm2d + leaky_relu."""
    layer, ref = _inplace_layer_and_reference(nn.BatchNorm2d)
    base = torch.randn(9, 4, 3, 3, dtype=DT)
    x = make_input(base)
    kept = base.detach().clone()
    # Autograd cannot save an inference tensor, for nn.BatchNorm2d neither: use it without.
    with torch.set_grad_enabled(not x.is_inference()):
        with pytest.warns(UserWarning, match="computing out of place"):
            out = layer(x)
    assert torch.equal(base.detach(), kept)
    expected = F.leaky_relu(ref(x.detach().clone()), 0.1)
    torch.testing.assert_close(out, expected, **TOL)
    assert_same_state(layer, ref)
    if base.requires_grad:
        dy = torch.randn_like(expected)
        xr = x.detach().clone().requires_grad_()
        (gx,) = torch.autograd.grad((out * dy).sum(), x)
        (rx,) = torch.autograd.grad((F.leaky_relu(ref(xr), 0.1) * dy).sum(), xr)
        torch.testing.assert_close(gx, rx, **TOL)


class _GraphWatch(torch.autograd.Function):
    """Identity whose autograd node holds a marker: the marker dies with the graph."""

    alive: set[int] = set()

    @staticmethod
    def forward(ctx, x):
        marker = threading.Event()  # any object that can be weakly referenced
        _GraphWatch.alive.add(id(marker))
        weakref.finalize(marker, _GraphWatch.alive.discard, id(marker))
        ctx.marker = marker
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Watched(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(_GraphWatch.apply(x))


_BACKWARDS = {
    "no backward": lambda out, layer: None,
    "backward": lambda out, layer: out.sum().backward(),
    # Backwards that stop short of the merge: only the normalisation's node runs.
    "weight grad only": lambda out, layer: torch.autograd.grad(out.sum(), [layer.weight]),
    "backward(inputs=[weight])": lambda out, layer: out.sum().backward(inputs=[layer.weight]),
}


@pytest.mark.parametrize("backward", list(_BACKWARDS))
@pytest.mark.parametrize("inplace", [False, True])
def test_dropped_output_frees_the_whole_graph(backward, inplace):
    """No reference cycle keeps a synchronised call's graph (and the activations it saved)
    alive once its output is dropped, with or without a backward: Python's collector cannot
    break cycles that pass through autograd's C++ nodes, so it must be freed by refcount."""
    layer = SyncBatchNorm(3, activation="elu", inplace=inplace)
    model = SimulatedDataParallel(_Watched(layer), 3)
    x = torch.randn(6, 3, 4, dtype=DT, requires_grad=True)
    _GraphWatch.alive.clear()
    for _ in range(3):
        out = model(x)
        _BACKWARDS[backward](out, layer)
        del out
    assert _GraphWatch.alive == set()


def test_dropped_cross_process_merge_frees_its_graph():
    """The same for ``merge_stats`` (the cross-process merge), whose backward needs invstd."""
    _GraphWatch.alive.clear()
    means = _GraphWatch.apply(torch.randn(2, 3, dtype=DT, requires_grad=True))
    merged = merge_stats(means, torch.rand(2, 3, dtype=DT), [4, 5], 1e-5)
    del means, merged
    assert _GraphWatch.alive == set()


# ---- 10. late and early replicas --------------------------------------------------------------


def _late_at(where: str, rank: int, delay: threading.Event | float):
    """A fault delaying replica ``rank`` at ``where``: by ``delay`` seconds, or until the
    event ``delay`` is set (at most 10 s)."""

    def fault(spot, h, r):
        if spot == where and r == rank:
            if isinstance(delay, threading.Event):
                assert delay.wait(10.0), "no replica stopped waiting for the late one"
            else:
                time.sleep(delay)
        return None

    return fault


def _signal_when_a_replica_stops_waiting(monkeypatch) -> threading.Event:
    """An event set once a replica's ``gather`` or ``exchange`` has raised: after it took its
    payload back (a master that arrives after that finds the peer gone)."""
    stopped = threading.Event()
    for name in ("gather", "exchange"):
        method = getattr(sbn_sync.ReplicaGroup, name)

        def signalling(self, *args, method=method):
            try:
                return method(self, *args)
            except BaseException:
                stopped.set()
                raise

        monkeypatch.setattr(sbn_sync.ReplicaGroup, name, signalling)
    return stopped


@pytest.mark.parametrize("where", ["before", "between"])
def test_master_reaching_a_layer_after_its_peers_gave_up_raises_sync_error(
        monkeypatch, replica_waits, where):
    """The master reaches bn1 (before) or bn2 (between) only after its peers' wait there
    timed out: a SyncError naming the layer and what happened (not an error from merging
    without their statistics), no running statistic of that layer updated, and the next step
    exact."""
    monkeypatch.setenv(sbn_sync.TIMEOUT_ENV, "0.5")
    net = Net()
    stopped = _signal_when_a_replica_stops_waiting(monkeypatch)
    net.fault = _late_at(where, 0, stopped)
    layer = net.bn1 if where == "before" else net.bn2
    untouched = {k: v.clone() for k, v in layer.state_dict().items()}
    x, _ = batch(6, seed=8)
    with pytest.raises(SyncError) as raised:
        SimulatedDataParallel(net, 3)(x, tags(6, 3))
    message = str(raised.value)
    assert message.startswith(f"{layer._label()}, rank 0: reached call 0 of this layer after "
                              f"ranks "), message
    assert "had stopped waiting for it" in message and "did not arrive within 0.5 s" in message
    assert_unchanged(layer, untouched)
    monkeypatch.setenv(sbn_sync.TIMEOUT_ENV, "10")
    net.fault = None
    failed_groups = [w.group for w in replica_waits]
    ref = reference_of(net)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, ref)]
    replica_waits.clear()
    x, y = batch(6, seed=9)
    assert_step_exact(net, ref, SimulatedDataParallel(net, 3), opts, x, y, tags(6, 3))
    assert_waited_only_on_this_step(replica_waits, failed_groups, 3)


@one_backend  # above the ops; the master's case above runs on every backend
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(replicas=st.integers(2, 4), late_master=st.booleans(),
       where=st.sampled_from(["before", "between", "after"]), past_the_timeout=st.booleans(),
       seed=st.integers(0, 1000))
@example(replicas=2, late_master=False, where="before", past_the_timeout=True, seed=0)
@example(replicas=3, late_master=False, where="between", past_the_timeout=True, seed=0)
def test_a_late_replica_gives_sync_error_or_an_exact_step_and_the_next_is_exact(
        monkeypatch, replica_waits, replicas, late_master, where, past_the_timeout, seed):
    """One replica (the master or a peer) is late before bn1, between bn1 and bn2, or after
    the last sync layer: by 50 ms within a long timeout, or until a peer has stopped waiting
    for it (timeout 0.5 s; after the last layer, 0.6 s: nobody waits for it there). A step in
    which a replica is late past the timeout at a sync layer raises SyncError, leaving that
    layer's state as it was; any other step is exact. The next step is exact."""
    n = 2 * replicas + seed % 3
    net = Net(seed=seed)
    layer = net.bn1 if where == "before" else net.bn2  # the one a replica is late for
    untouched = snapshot(layer)
    late = 0 if late_master else 1 + seed % (replicas - 1)
    with monkeypatch.context() as patch:
        patch.setenv(sbn_sync.TIMEOUT_ENV, "0.5" if past_the_timeout else "10")
        stopped = _signal_when_a_replica_stops_waiting(patch)
        delay = (stopped if where != "after" else 0.6) if past_the_timeout else 0.05
        net.fault = _late_at(where, late, delay)
        replica_waits.clear()
        ref = reference_of(net)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, ref)]
        x, y = batch(n, seed=seed)
        runner = SimulatedDataParallel(net, replicas)
        if past_the_timeout and where != "after":
            with pytest.raises(SyncError, match=r"SyncBatchNorm\(6\)"):
                runner(x, tags(n, replicas))
            assert stopped.is_set()
            assert_unchanged(layer, untouched)
        else:
            assert_step_exact(net, ref, runner, opts, x, y, tags(n, replicas))
            assert ended_by_an_error(replica_waits) == []
    net.fault = None
    failed_groups = [w.group for w in replica_waits]
    ref = reference_of(net)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, ref)]
    replica_waits.clear()
    x, y = batch(n, seed=seed + 1)
    assert_step_exact(net, ref, SimulatedDataParallel(net, replicas), opts, x, y)
    chunks = len(torch.chunk(x, replicas))
    assert_waited_only_on_this_step(replica_waits, failed_groups, chunks)


# ---- 11. nested wrappers ----------------------------------------------------------------------


def nested(model: nn.Module, counts: list[int]) -> nn.Module:
    """``model`` in a SimulatedDataParallel of ``counts[-1]`` replicas, that in one of
    ``counts[-2]``, ...: ``counts[0]`` is the outermost."""
    for replicas in reversed(counts):
        model = SimulatedDataParallel(model, replicas)
    return model


def check_nested(waits: list, counts: list[int], n: int, seed: int) -> None:
    """Two steps of ``Net`` in ``nested(net, counts)`` on batches of ``n``: each exact against
    the whole batch (output, gradients, running statistics), no wait ending in an error."""
    net = Net(seed=seed)
    ref = reference_of(net)
    runner = nested(net, counts)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (net, ref)]
    for s in range(2):
        waits.clear()
        x, y = batch(n, seed=seed + s)
        assert_step_exact(net, ref, runner, opts, x, y)
        assert ended_by_an_error(waits) == []
    assert int(net.bn2.num_batches_tracked) == 4  # called twice a step


@pytest.mark.parametrize("counts,n", [([2, 2], 8), ([3, 2], 5), ([2, 2], 3)],
                         ids=["2x2", "3x2-uneven", "2x2-outer-chunk-of-one"])
def test_nested_wrappers_normalise_over_the_whole_batch(replica_waits, counts, n):
    """A SimulatedDataParallel (as an nn.DataParallel) inside another: every replica
    normalises with the statistics of the whole outer batch. With a batch of 3 the second
    outer chunk holds one sample, which its wrapper runs without splitting: that replica
    takes part in the outer call itself, beside the first chunk's inner master."""
    check_nested(replica_waits, counts, n, seed=0)


@one_backend  # the nesting lives above the ops: the cases above run it on every backend
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(counts=st.lists(st.integers(1, 3), min_size=2, max_size=3), n=st.integers(2, 10),
       seed=st.integers(0, 1000))
def test_nested_wrappers_of_any_sizes_normalise_over_the_whole_batch(replica_waits, counts, n,
                                                                     seed):
    """Two or three wrappers deep, of 1-3 replicas each, batches of 2-10 (outer chunks that
    split into fewer chunks, or not at all)."""
    check_nested(replica_waits, counts, n, seed)


def test_nested_wrapper_failure_fails_the_outer_call_fast(monkeypatch, replica_waits):
    """One replica of an inner call raises inside bn1: the replicas of the other outer chunk
    (waiting in the outer call's group) hear of it at once, not at the timeout."""
    monkeypatch.setenv(sbn_sync.TIMEOUT_ENV, "60")
    net = Net()
    net.fault = _bad_channels(3)
    x, _ = batch(8, seed=7)
    # tags of the whole batch: the inner calls split each outer chunk's tags alike
    with pytest.raises(ValueError, match="channels"):
        nested(net, [2, 2])(x, torch.arange(8.0) // 2)
    assert ended_by_an_error(replica_waits) and not gave_up_at_the_deadline(replica_waits)


@one_backend  # the merge's saved tensors: above the ops
def test_nested_wrappers_around_checkpointed_blocks_match_the_whole_batch():
    """The outer call's master merges the nested calls' statistics inside its checkpointed
    block, whose recomputation replays the layer without that merge: the merge's tensors are
    not the checkpoint's to save (else a CheckpointError: a different number of tensors saved
    in the recomputation)."""
    ckpt = CheckpointNet(mode="non-reentrant")
    ref = CheckpointNet(sync=False)
    ref.load_state_dict(ckpt.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ckpt, ref)]
    x, y = batch(25, seed=91)  # enough values a channel to train in place
    out, grads = train_step(nested(ckpt, [2, 2]), ckpt, opts[0], x, y[:, :2])
    ref_out, ref_grads = train_step(ref, ref, opts[1], x, y[:, :2])
    torch.testing.assert_close(out, ref_out, **TOL)
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g, rg, **TOL)
    assert_same_state(ckpt, ref)
