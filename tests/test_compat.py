"""``compat``: the private torch APIs the package uses, and what happens where they moved."""

import subprocess
import sys
import warnings

import pytest
import torch

from encoding_syncbn import SyncBatchNorm, compat


@pytest.fixture
def fresh_lookups():
    """Forget the cached look-ups before and after a test that hides an API."""
    lookups = (compat._graph_task_id, compat._creation_meta, compat._execution_engine,
               compat._top_saved_tensor_hooks)
    for lookup in lookups:
        lookup.cache_clear()
    yield
    for lookup in lookups:
        lookup.cache_clear()


def test_import_touches_no_private_api():
    """With the private APIs gone, the package still imports and an eval forward runs."""
    code = """
import torch
for owner, name in [(torch._C, "_current_graph_task_id"), (torch._C._autograd,
        "_get_creation_meta"), (torch, "_debug_has_internal_overlap"),
        (torch._C._autograd, "_top_saved_tensors_default_hooks")]:
    delattr(owner, name)
import encoding_syncbn
layer = encoding_syncbn.SyncBatchNorm(3, activation="leaky_relu").eval()
print(tuple(layer(torch.randn(2, 3, 4, 4)).shape))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(2, 3, 4, 4)"


@pytest.mark.usefixtures("fresh_lookups")
def test_without_graph_task_id_training_says_which_api(monkeypatch):
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    with pytest.raises(RuntimeError, match=r"torch\._C\._current_graph_task_id.*torch \("):
        SyncBatchNorm(3)(torch.randn(4, 3, 2, 2))


@pytest.mark.usefixtures("fresh_lookups")
def test_without_view_provenance_views_go_out_of_place(monkeypatch):
    """Unknown view kinds are treated as restricted: out of place, never a refused write."""
    monkeypatch.delattr(torch._C._autograd, "_get_creation_meta")
    base = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    view = base[:, :, 1:]
    layer = SyncBatchNorm(3, activation="leaky_relu").double()
    before = base.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning (shown once)
        out = layer(view)
    assert torch.equal(base, before)
    expected = torch.nn.functional.leaky_relu(
        torch.nn.functional.batch_norm(before[:, :, 1:], None, None, training=True), 0.01)
    torch.testing.assert_close(out, expected)


def test_overlap_check_is_exact_with_and_without_torchs(monkeypatch):
    """``inplace_policy.shares_memory_within`` answers as listing the offsets does, for the
    layouts torch's quick check answers (expand) and those it calls too hard (unfold,
    as_strided, interleaved strides that do not overlap), with torch's check or without it."""
    from encoding_syncbn.layer.inplace_policy import shares_memory_within

    x = torch.randn(1, 3, 1, 4)
    flat = torch.randn(64)
    cases = [x, x.expand(5, 3, 2, 4), x.transpose(1, 3), torch.randn(3, 1).expand(3, 1),
             torch.randn(4, 3, 8).unfold(2, 3, 1), torch.randn(4, 3, 8).unfold(2, 2, 2),
             flat.as_strided((4, 3, 5), (6, 2, 1)), flat.as_strided((2, 3, 3), (18, 3, 2)),
             flat.as_strided((2, 3, 1), (3, 2, 1)), flat.as_strided((3, 2, 2), (0, 4, 1))]

    def listed(t):
        offsets = torch.zeros(1, dtype=torch.long)
        for size, stride in zip(t.shape, t.stride()):
            offsets = (offsets.unsqueeze(1) + torch.arange(size) * stride).view(-1)
        return offsets.unique().numel() < t.numel()

    expected = [listed(case) for case in cases]
    assert expected == [False, True, False, False, True, False, True, False, False, True]
    assert [shares_memory_within(case) for case in cases] == expected
    monkeypatch.delattr(torch, "_debug_has_internal_overlap")
    assert compat.internal_overlap(x) is None
    assert [shares_memory_within(case) for case in cases] == expected


def test_bias_less_layers_on_a_torch_whose_batchnorms_take_no_bias(monkeypatch):
    """torch 2.11's BatchNorms have no ``bias`` argument (every layer construction failed there,
    found on a GPU machine): made, converted, reverted and fused without it, bias-less layers
    keep no bias and compute BatchNorm without one."""
    from torch import nn
    from torch.nn.modules.batchnorm import _BatchNorm, _NormBase

    from encoding_syncbn import convert_inplace_abn, convert_sync_batchnorm, revert_sync_batchnorm
    from encoding_syncbn.layer.norm_act import BatchNormAct

    def init_without_bias(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                          track_running_stats=True, device=None, dtype=None):
        _NormBase.__init__(self, num_features, eps, momentum, affine, track_running_stats,
                           device, dtype)

    monkeypatch.setattr(_BatchNorm, "__init__", init_without_bias)
    with pytest.raises(TypeError, match="bias"):
        nn.BatchNorm2d(3, bias=False)  # the patch stands for that torch
    assert SyncBatchNorm(3, bias=False).bias is None
    assert BatchNormAct(3, bias=False, act=nn.ReLU()).bias is None
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3), nn.LeakyReLU(0.1))
    model[1].bias = None
    x = torch.randn(4, 2, 5, 5)
    expected = model(x)
    for converted in (convert_sync_batchnorm(model), convert_inplace_abn(model)):
        assert converted[1].bias is None
        torch.testing.assert_close(converted(x), expected)
        reverted = revert_sync_batchnorm(converted)
        assert reverted[1].bias is None
        torch.testing.assert_close(reverted(x), expected)


def test_a_compiled_call_is_no_export_where_dynamo_says_it_is(monkeypatch):
    """Before torch 2.13, Dynamo answers ``torch.compiler.is_exporting()`` with True inside any
    ``torch.compile``: the layer reads torch.compiler's flag instead, so that such an answer
    neither refuses a training call as an export nor sends it to the ATen path; an export, which
    sets the flag, still refuses it."""
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    layer = SyncBatchNorm(3, activation="leaky_relu").double()
    x = torch.randn(23, 3, 5, dtype=torch.float64)  # values enough to train in place
    written = x.clone()
    out = layer(written)  # in place: the layer's own kernels, not the ATen path's copy
    assert out.data_ptr() == written.data_ptr() and layer.num_batches_tracked == 1
    torch.testing.assert_close(out, torch.nn.functional.leaky_relu(
        torch.nn.functional.batch_norm(x, None, None, training=True), 0.01))
    monkeypatch.setattr(torch.compiler, "_is_exporting_flag", True)
    with pytest.raises(RuntimeError, match="torch.export records the layer in evaluation only"):
        layer(x.clone())
    assert layer.num_batches_tracked == 1
