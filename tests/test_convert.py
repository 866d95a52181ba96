"""convert_sync_batchnorm / revert_sync_batchnorm."""

from __future__ import annotations

import pytest
import torch
from reference import assert_close
from torch import nn

from encoding_syncbn import SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
from encoding_syncbn.testing import SimulatedDataParallel


def model():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Sequential(nn.Conv2d(4, 5, 1), nn.BatchNorm2d(5, momentum=None, affine=False)),
        nn.Flatten(2), nn.BatchNorm1d(5, eps=1e-3, track_running_stats=False),
        nn.Unflatten(2, (4, 4)), nn.Conv2d(5, 2, 1), nn.SyncBatchNorm(2, bias=False),
    ).double()
    return net


def test_convert_reuses_parameters_buffers_and_flags():
    net = model().eval()
    originals = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    params = [(m.weight, m.bias) for m in originals]
    buffers = [(m.running_mean, m.running_var) for m in originals]
    converted = convert_sync_batchnorm(net, process_group="pg")
    layers = [m for m in converted.modules() if isinstance(m, SyncBatchNorm)]
    assert len(layers) == 4
    for layer, original, (w, b), (rm, rv) in zip(layers, originals, params, buffers):
        assert layer.weight is w and layer.bias is b
        assert layer.running_mean is rm and layer.running_var is rv
        assert (layer.eps, layer.momentum, layer.affine, layer.track_running_stats) == (
            original.eps, original.momentum, original.affine, original.track_running_stats)
        assert not layer.training and layer.process_group == "pg"
        assert all(t.dtype == torch.float64 and t.device.type == "cpu"
                   for t in layer.state_dict().values() if t.is_floating_point())


def test_converted_model_trains_like_the_original():
    reference, net = model(), convert_sync_batchnorm(model())
    x = torch.randn(6, 3, 6, 6, dtype=torch.float64)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, net)]
    for _ in range(3):
        runs = (reference, SimulatedDataParallel(net, 3))
        for opt, run in zip(optimizers, runs):
            opt.zero_grad()
            run(x).square().mean().backward()
            opt.step()
    for (name, a), b in zip(reference.state_dict().items(), net.state_dict().values()):
        assert_close(b, a, what=name)


def test_convert_inside_data_parallel_wrapper():
    wrapped = nn.DataParallel(model())
    converted = convert_sync_batchnorm(wrapped)
    assert converted is wrapped
    assert sum(isinstance(m, SyncBatchNorm) for m in wrapped.module.modules()) == 4


def test_revert_gives_plain_batchnorm_and_activation_module():
    net = nn.Sequential(
        SyncBatchNorm(3, activation="leaky_relu", slope=0.2), nn.Flatten(2),
        SyncBatchNorm(3, activation="elu", slope=0.5), nn.Unflatten(2, (2, 2)),
        SyncBatchNorm(3, activation="identity"),
    ).double()
    x = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    expected = net(x.clone())
    net.eval()
    expected_eval = net(x.clone())
    running_means = [m.running_mean for m in net.modules() if isinstance(m, SyncBatchNorm)]
    net.train()
    plain = revert_sync_batchnorm(net)
    kinds = [type(m) for m in plain.modules()]
    assert SyncBatchNorm not in kinds
    assert isinstance(plain[0], nn.Sequential) and isinstance(plain[0][0], nn.BatchNorm2d)
    assert isinstance(plain[0][1], nn.LeakyReLU) and plain[0][1].negative_slope == 0.2
    assert isinstance(plain[2][0], nn.BatchNorm1d) and plain[2][1].alpha == 0.5
    assert isinstance(plain[4], nn.BatchNorm2d)
    assert [m.running_mean for m in plain.modules() if isinstance(m, nn.BatchNorm2d)
            or isinstance(m, nn.BatchNorm1d)] == running_means  # shared, not copied
    assert plain.training
    plain.eval()
    assert_close(plain(x.clone()), expected_eval)
    assert expected.shape == x.shape


@pytest.mark.parametrize("cls,shape", [(nn.BatchNorm1d, (4, 3)), (nn.BatchNorm1d, (4, 3, 5)),
                                       (nn.BatchNorm2d, (4, 3, 2, 2)),
                                       (nn.BatchNorm3d, (4, 3, 2, 2, 2))])
def test_revert_before_any_forward_gives_the_class_converted_from(cls, shape):
    plain = revert_sync_batchnorm(convert_sync_batchnorm(nn.Sequential(cls(3))))
    assert type(plain[0]) is cls
    plain(torch.randn(shape))  # the reverted layer accepts the original's inputs


@pytest.mark.parametrize("activation", ["leaky_relu", "elu"])
@pytest.mark.parametrize("slope", [-0.3, 0.0, 0.2])
def test_reverted_activation_trains_for_any_slope(activation, slope):
    """Out of place, the layer takes any slope; the reverted activation must differentiate
    like it (torch cannot run in-place leaky_relu / elu backward for slope <= 0)."""
    layer = SyncBatchNorm(3, activation=activation, slope=slope, inplace=False).double()
    x = torch.randn(6, 3, 4, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    (expected,) = torch.autograd.grad(out.square().sum(), x)
    plain = revert_sync_batchnorm(layer)
    layer_x = x.detach().clone().requires_grad_()
    (grad,) = torch.autograd.grad(plain(layer_x * 1).square().sum(), layer_x)
    assert_close(grad, expected)
