"""In-place misuse: errors that name the layer and the fixes, and the opt-in checking mode."""

from __future__ import annotations

import re

import pytest
import torch
from backends import each_backend
from torch import nn

import encoding_syncbn
from encoding_syncbn import SyncBatchNorm, check_inplace
from encoding_syncbn.layer.modules import record_paths
from encoding_syncbn.testing import SimulatedDataParallel

pytestmark = each_backend


class Residual(nn.Module):
    """torchvision's BasicBlock shape: ``out += identity`` after an in-place BN."""

    def __init__(self, second_inplace: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1).double()
        self.bn = SyncBatchNorm(3, activation="identity").double()
        self.second_inplace = second_inplace
        self.abn = SyncBatchNorm(3, activation="leaky_relu").double()

    def forward(self, x):
        out = self.bn(self.conv(x))
        if self.second_inplace:
            return self.abn(out)  # a second in-place layer fed the output directly
        out += x
        return out


def _input():
    # Enough values a channel to train in place (inplace_policy.rebuilds_from_count).
    return torch.randn(13, 3, 3, 3, dtype=torch.float64)


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("second_inplace", [False, True])
def test_modified_output_names_layer_and_fixes(replicas, second_inplace):
    """Fused single-group path (1 replica) and synchronised path (2): backward names the
    layer by its path and says both fixes."""
    block = Residual(second_inplace)
    record_paths(block)
    model = SimulatedDataParallel(block, replicas)
    out = model(_input())
    with pytest.raises(RuntimeError) as info:
        out.sum().backward()
    message = str(info.value)
    assert "SyncBatchNorm(3) at model path 'bn'" in message
    assert "`out = out + identity`" in message and "inplace=False" in message
    assert "modified by an inplace operation" in message  # torch's own words kept too


_HAND_BACK_ITSELF = {
    "identity hooks": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t),
    # On a CPU tensor its pack, ``tensor.cpu()``, is the tensor itself.
    "save_on_cpu": torch.autograd.graph.save_on_cpu,
}


@pytest.mark.parametrize("hooks", sorted(_HAND_BACK_ITSELF))
@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("training", [True, False])
def test_modified_output_is_caught_under_hooks_that_skip_torchs_check(hooks, replicas,
                                                                     training):
    """torch checks no version of a tensor a saved-tensor hook packed: the layer's own check
    raises the same error (else backward rebuilds the input from the modified output)."""
    block = Residual()
    record_paths(block)
    block.train(training)
    model = SimulatedDataParallel(block, replicas)
    with _HAND_BACK_ITSELF[hooks]():
        out = model(_input())
    with pytest.raises(RuntimeError) as info:
        out.sum().backward()
    message = str(info.value)
    assert "SyncBatchNorm(3) at model path 'bn'" in message
    assert "`out = out + identity`" in message
    # (Hooks are the thread's own: replicas, in threads of their own, run without them.)
    assert replicas > 1 or "a saved-tensor hook" in message


def test_an_empty_output_copied_by_a_hook_is_not_taken_for_the_modified_one():
    """Empty storages share address 0: the hook's copy of an empty in-place output is not the
    output, whatever is written over that after the forward."""
    layer = Residual().eval()
    x = torch.randn(0, 3, 3, 3, dtype=torch.float64)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        out = layer(x)
    out.sum().backward()  # no error
    assert layer.bn.weight.grad.abs().sum() == 0


@pytest.mark.parametrize("training", [True, False])
def test_hooks_that_copy_the_output_keep_the_gradients_exact(training):
    """A hook's copy holds the output as the forward wrote it: nothing to refuse after
    ``out += x``, and the gradients are nn.BatchNorm's."""
    torch.manual_seed(0)
    block = Residual().train(training)
    reference = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)).double().train(training)
    reference.load_state_dict({**block.conv.state_dict(prefix="0."),
                               **block.bn.state_dict(prefix="1.")})
    x = _input()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        out = block(x)
    out.backward(torch.ones_like(out))
    (reference(x) + x).sum().backward()
    for ours, theirs in zip(block.parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-12, atol=1e-12)


def test_unnamed_layer_is_named_by_address():
    layer = SyncBatchNorm(3, activation="leaky_relu").double()
    out = layer(_input())
    out += 1
    with pytest.raises(RuntimeError, match=re.escape(f"SyncBatchNorm(3) at {id(layer):#x}")):
        out.sum().backward()


def test_parameter_modified_before_backward_is_not_blamed_on_the_output():
    layer = SyncBatchNorm(3, activation="leaky_relu").double()
    out = layer(_input().requires_grad_() * 1)
    with torch.no_grad():
        layer.weight.add_(1)
    with pytest.raises(RuntimeError, match="its input, weight or bias") as info:
        out.sum().backward()
    assert "`out += identity`" not in str(info.value)


def test_converters_record_paths_for_every_error():
    """Converted layers and layers built directly alike; SyncError's label is the same text."""
    model = nn.Sequential(nn.Conv2d(3, 3, 1), SyncBatchNorm(3), nn.BatchNorm2d(3))
    model = encoding_syncbn.convert_sync_batchnorm(model)
    assert [model[1]._label(), model[2]._label()] == [
        "SyncBatchNorm(3) at model path '1'", "SyncBatchNorm(3) at model path '2'"]
    block = encoding_syncbn.convert_inplace_abn(
        nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.LeakyReLU(), nn.Conv2d(3, 3, 1))
    )
    assert block[1].inplace and block[1]._label() == "SyncBatchNorm(3) at model path '1'"


# ---- opt-in checks (Python-level, the same for every backend) -----------------------------


@pytest.mark.parametrize("replicas", [1, 2])
def test_check_mode_catches_input_used_again(replicas):
    """``abn(x) + x`` is silently wrong without checks; with them, an error at the addition."""

    class Misused(nn.Module):
        def __init__(self):
            super().__init__()
            self.abn = SyncBatchNorm(3, activation="leaky_relu").double()

        def forward(self, x):
            h = x * 1
            return self.abn(h) + h

    model = SimulatedDataParallel(Misused(), replicas)
    model(_input())  # no error without checks (documented)
    with check_inplace(), pytest.raises(RuntimeError, match=r"abn\(x\) \+ x.*inplace=False"):
        model(_input())


def test_check_mode_catches_the_write_itself():
    block = Residual()
    record_paths(block)
    with check_inplace(), pytest.raises(RuntimeError, match="'bn'.*by add_.*inplace=False"):
        block(_input().requires_grad_())


def test_check_mode_catches_a_second_inplace_layer_before_it_writes():
    block = Residual(second_inplace=True)
    record_paths(block)
    x = _input().requires_grad_()
    with check_inplace(), pytest.raises(RuntimeError, match="'bn'.*by SyncBatchNorm.*'abn'"):
        block(x)


def test_check_mode_catches_a_write_through_a_view_at_the_next_use():
    layer = SyncBatchNorm(3, activation="leaky_relu").double()
    with check_inplace():
        out = layer(_input().requires_grad_() * 1)
        out.view(-1).add_(1)  # a plain view: not seen when written
        with pytest.raises(RuntimeError, match="through another alias"):
            out.sum()


def test_check_mode_keeps_correct_code_exact():
    """A correct model computes the same, with plain tensors out, under checks."""
    torch.manual_seed(0)
    block = Residual()
    block.forward = lambda x: block.abn(block.bn(block.conv(x)) + x)  # out-of-place add
    x = _input()
    results = []
    for checks in (False, True):
        leaf = x.clone().requires_grad_()
        with check_inplace() if checks else torch.enable_grad():
            out = block(leaf)
            out.pow(2).sum().backward()
        results.append((out.detach().clone(), leaf.grad))
        block.zero_grad()
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    # Outside a checked block nothing is wrapped; without grad, writes are allowed.
    assert type(block.abn(_input())) is torch.Tensor
    with check_inplace(), torch.no_grad():
        out = block.abn(_input())
        out += 1


def test_check_mode_from_the_environment(monkeypatch):
    from encoding_syncbn.layer import inplace_policy

    monkeypatch.setattr(inplace_policy, "_FROM_ENV", True)
    assert inplace_policy.checking()
    monkeypatch.setattr(inplace_policy, "_FROM_ENV", False)
    assert not inplace_policy.checking()
    assert encoding_syncbn.check_inplace is inplace_policy.check_inplace
