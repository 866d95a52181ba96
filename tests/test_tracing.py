"""Graph capture of converted models: torch.fx, torch.jit.trace, torch.jit.script, torch.export;
and torch.func's transforms.

Each compares the captured model with the layers themselves (and, in training, with the whole
batch under DataParallel), on every backend.
"""

from __future__ import annotations

import copy
import io
import subprocess
import sys
import warnings

import pytest
import torch
from backends import each_backend, one_backend
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import SLOPES, assert_close
from third_party import import_or_skip
from torch import nn

from encoding_syncbn import (
    SyncBatchNorm,
    convert_inplace_abn,
    convert_sync_batchnorm,
    revert_sync_batchnorm,
)
from encoding_syncbn.activations import ACTIVATIONS
from encoding_syncbn.inplace_abn import InPlaceABN
from encoding_syncbn.layer.norm_act import BatchNormAct, SyncBatchNormAct
from encoding_syncbn.testing import SimulatedDataParallel

pytestmark = each_backend


def network() -> nn.Module:
    """Fused in-place layers (leaky_relu), a plain BatchNorm, and a norm + Hardswish kept as
    a module (SyncBatchNormAct), in float64."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.LeakyReLU(0.1),
        nn.Conv2d(4, 5, 1), nn.BatchNorm2d(5),
        nn.Conv2d(5, 6, 1),
    )
    net = convert_inplace_abn(net)
    net.append(SyncBatchNormAct(6, act=nn.Hardswish()))
    with torch.no_grad():
        for module in net.modules():
            if isinstance(module, SyncBatchNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
                module.running_mean.uniform_(-1, 1)
                module.running_var.uniform_(0.5, 2)
    return net.double()


def test_fx_records_each_layer_as_one_call():
    """``torch.fx.symbolic_trace``: each layer is one ``call_module`` node (the activation of
    SyncBatchNormAct inside it, not traced again after it), and the traced module computes
    what the model does: in training synchronised over the whole batch, in evaluation."""
    model = network()
    traced = torch.fx.symbolic_trace(model)
    called = [node.target for node in traced.graph.nodes if node.op == "call_module"]
    assert called == ["0", "1", "2", "3", "4", "5", "6"]
    assert traced.get_submodule("6") is model[6] and traced.get_submodule("1") is model[1]
    twin = copy.deepcopy(model)
    x = torch.randn(8, 3, 6, 6, dtype=torch.float64)
    out = SimulatedDataParallel(traced, 2)(x.clone())
    expected = revert_sync_batchnorm(twin)(x.clone())
    assert_close(out, expected, what="traced training output")
    assert_close(model[1].running_mean, twin[1].running_mean, what="running_mean")
    traced.eval()
    model.eval()
    assert_close(traced(x.clone()), model(x.clone()), what="traced evaluation output")


def test_fx_traces_the_reverted_model():
    """The reverted model's norm + activation layers (BatchNormAct) are leaves too, as
    torch.nn's BatchNorms: the traced module computes what the reverted one does."""
    reverted = revert_sync_batchnorm(network())
    assert any(type(m).__name__ == "BatchNormAct" for m in reverted.modules())
    traced = torch.fx.symbolic_trace(reverted)
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    for mode in (True, False):
        twin = copy.deepcopy(reverted).train(mode)
        assert_close(traced.train(mode)(x.clone()), twin(x.clone()), what=f"training={mode}")


@pytest.mark.parametrize("make,name", [(lambda: SyncBatchNorm(4), r"SyncBatchNorm\(4\)"),
                                       (lambda: BatchNormAct(4), r"BatchNormAct\(4\)")])
def test_fx_root_layer_is_refused_by_name(make, name):
    with pytest.raises(TypeError, match=name + r".*root of a trace; trace that model"):
        torch.fx.symbolic_trace(make())


def test_torchvision_feature_extractor():
    """torchvision's ``create_feature_extractor`` (FX) on a converted ResNet: the features of
    the original model, with the synchronised layers in it."""
    models = import_or_skip("torchvision.models")
    extraction = import_or_skip("torchvision.models.feature_extraction")
    torch.manual_seed(0)
    resnet = models.ResNet(models.resnet.BasicBlock, [1, 1, 1, 1], num_classes=4).double()
    nodes = {"layer1": "c2", "layer2": "c3"}
    expected = extraction.create_feature_extractor(copy.deepcopy(resnet), nodes)
    converted = convert_sync_batchnorm(resnet)
    extractor = extraction.create_feature_extractor(converted, nodes)
    assert any(isinstance(m, SyncBatchNorm) for m in extractor.modules())
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    for mode in (True, False):
        features, reference = extractor.train(mode)(x), expected.train(mode)(x)
        for name in nodes.values():
            assert_close(features[name], reference[name], what=f"{name}, training={mode}")


def test_timm_fx_feature_extraction():
    """timm's FX feature extraction (``FeatureGraphNet``) on a converted model whose norm +
    activation layers became synchronised layers (BatchNormAct2d with Hardswish: kept as
    SyncBatchNormAct; with ReLU: fused): the original's features."""
    timm = import_or_skip("timm")
    features_fx = import_or_skip("timm.models._features_fx")

    torch.manual_seed(0)
    model = timm.create_model("mobilenetv3_small_050", num_classes=4).double()
    expected = features_fx.FeatureGraphNet(copy.deepcopy(model), out_indices=(1, 2))
    converted = convert_sync_batchnorm(model)
    assert any(isinstance(m, SyncBatchNormAct) for m in converted.modules())
    features = features_fx.FeatureGraphNet(converted, out_indices=(1, 2))
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    for mode in (True, False):
        for got, want in zip(features.train(mode)(x), expected.train(mode)(x)):
            assert_close(got, want, what=f"features, training={mode}")


@settings(max_examples=12, deadline=None)
@given(
    activation=st.sampled_from(sorted(ACTIVATIONS)),
    inplace=st.booleans(),
    running=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    abn=st.booleans(),
    spatial=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    channels_last=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_jit_trace_in_evaluation(activation, inplace, running, dtype, abn, spatial,
                                 channels_last, seed):
    """``torch.jit.trace`` of an evaluating layer records ATen ops computing what the layer
    does (every activation, in place or not, with running or batch statistics, mapillary's
    ``|w| + eps``, inputs of rank 2 to 5, channels_last); the trace saves and loads."""
    inplace = inplace and ACTIVATIONS[activation].inverse is not None and activation != "none"
    if abn:
        if activation not in ("leaky_relu", "elu", "identity"):
            activation = "leaky_relu"
        layer = InPlaceABN(5, activation=activation, activation_param=0.2,
                           track_running_stats=running)
    else:
        layer = SyncBatchNorm(5, activation=activation, slope=SLOPES.get(activation, 0.01),
                              inplace=inplace, track_running_stats=running)
    layer = nn.Sequential(nn.Identity(), layer).to(dtype).eval()
    torch.manual_seed(seed)
    with torch.no_grad():
        for tensor in layer[1].parameters():
            tensor.uniform_(-1.5, 1.5)
        if running:
            layer[1].running_mean.uniform_(-1, 1)
            layer[1].running_var.uniform_(0.5, 2)
    x = torch.randn(4, 5, *spatial, dtype=dtype)
    if channels_last and x.dim() in (4, 5):
        x = x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    traced = torch.jit.trace(layer, x.clone())
    buffer = io.BytesIO()
    torch.jit.save(traced, buffer)
    buffer.seek(0)
    loaded = torch.jit.load(buffer)
    expected = layer(x.clone())
    assert_close(traced(x.clone()), expected, dtype, what="traced")
    assert_close(loaded(x.clone()), expected, dtype, what="saved and loaded")


def test_jit_trace_of_a_converted_network():
    """Fused in-place layers, a plain one and a norm + Hardswish module traced in evaluation,
    without a TracerWarning: the traced network computes what the model does (the Hardswish
    applied once)."""
    model = network().eval()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(model, x.clone())
    assert not [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
    assert_close(traced(x.clone()), model(x.clone()), what="traced network")


_CAPTURES = {
    "jit.trace": lambda model, x: torch.jit.trace(model, x),
    "export": lambda model, x: torch.export.export(model, (x,), strict=False),
    "export-strict": lambda model, x: torch.export.export(model, (x,), strict=True),
}


@pytest.mark.parametrize("capture", sorted(_CAPTURES))
def test_training_capture_is_refused_by_name_and_changes_nothing(capture):
    """``torch.jit.trace`` and ``torch.export`` (either tracer) of a training model: refused
    at its first layer, by name, saying what to do, every buffer untouched; the evaluating
    model then captures as usual. (Dynamo, export's strict tracer, reports the error inside
    its own, the message kept.)"""
    model = network()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    name = "torch.jit.trace" if capture == "jit.trace" else "torch.export"
    with pytest.raises(Exception, match=rf"SyncBatchNorm\(4\) at model path '1': {name} "
                       r"records the layer in evaluation only \(model.eval\(\) first\)"
                       r".*revert_sync_batchnorm"):
        _CAPTURES[capture](model, x.clone())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    model.eval()
    captured = _CAPTURES[capture](model, x.clone())
    program = captured if capture == "jit.trace" else captured.module()
    assert_close(program(x.clone()), model(x.clone()), what=f"{capture} in evaluation")


@pytest.mark.parametrize("make", [
    lambda: SyncBatchNormAct(4, act=nn.Hardswish()),
    lambda: InPlaceABN(4, activation="elu", activation_param=0.5),
    lambda: SyncBatchNorm(4, momentum=None, track_running_stats=False, sync=False),
], ids=["SyncBatchNormAct", "InPlaceABN", "untracked-unsynced"])
def test_training_export_is_refused_for_every_layer(make):
    """Each kind of layer refuses, with or without running statistics or sync: the program
    would normalise each replica alone whatever the layer's settings, as a per-replica
    BatchNorm that ``revert_sync_batchnorm`` says outright."""
    model = convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 1), make()).double())
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match=r"\(4\)[^:]*: torch.export records the layer in "
                       "evaluation only"):
        torch.export.export(model, (torch.randn(2, 3, 4, 4, dtype=torch.float64),))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_training_export_of_the_reverted_model():
    """What the refusal points to: the reverted model exports in training as plain ATen ops
    (``aten.batch_norm``, as torch's own BatchNorms export), and the program
    computes the layers' training step on one replica, their running statistics included.
    (With ``momentum=None`` torch's own BatchNorms do not export in training: the factor
    1 / num_batches_tracked is data-dependent.)"""
    model = network()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    program = torch.export.export(revert_sync_batchnorm(copy.deepcopy(model)), (x.clone(),))
    ops = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert "aten.batch_norm.default" in ops and not [op for op in ops if "encoding" in op], ops
    trained = program.module()
    for step in range(2):
        y = torch.randn(4, 3, 6, 6, dtype=torch.float64) if step else x
        assert_close(trained(y.clone()), model(y.clone()), what=f"step {step}")
    for key, value in model.state_dict().items():
        assert_close(trained.state_dict()[key], value, what=key)


@pytest.mark.parametrize("momentum", [0.1, None])
def test_jit_script_is_refused_by_name_and_reverted_models_script(momentum):
    """Scripting names the layer and the fix; the reverted model (its norm + activation
    layers included) scripts, and computes what the layers do, the running statistics'
    update included."""
    model = network()
    for module in model.modules():
        if isinstance(module, SyncBatchNorm):
            module.momentum = momentum
    with pytest.raises(TypeError,
                       match=r"SyncBatchNorm\(4\) at model path '1'.*revert_sync_batchnorm"):
        torch.jit.script(model)
    reverted = revert_sync_batchnorm(copy.deepcopy(model))
    scripted = torch.jit.script(copy.deepcopy(reverted))
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    for _ in range(2):
        assert_close(scripted(x.clone()), model(x.clone()), what="scripted, training")
    for (name, value), expected in zip(scripted.state_dict().items(),
                                       model.state_dict().values()):
        assert_close(value, expected, what=name)
    scripted.eval()
    assert_close(scripted(x.clone()), model.eval()(x.clone()), what="scripted, evaluation")


_LOAD_WITHOUT_PACKAGE = """
import sys
import torch
for name in ("encoding_syncbn", "triton"):
    sys.modules[name] = None  # as if not installed: an import raises ModuleNotFoundError
kind, program = sys.argv[1], sys.argv[2]
x, expected = torch.load(sys.argv[3]), torch.load(sys.argv[4])
out = (torch.export.load(program).module() if kind == "export" else torch.jit.load(program))(x)
torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
print("same")
"""


@one_backend  # the layer computes in ATen ops under export and trace whatever the backend
@pytest.mark.parametrize("kind", ["export", "jit.trace"])
def test_captured_program_runs_without_this_package(tmp_path, kind):
    """Saved (``torch.export.save``, ``torch.jit.save``), the evaluating model loads and
    computes the same in a process where neither this package nor Triton can be imported."""
    model = network().eval()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    program = tmp_path / "model.pt"
    if kind == "export":
        torch.export.save(torch.export.export(model, (x.clone(),)), program)
    else:
        torch.jit.save(torch.jit.trace(model, x.clone()), program)
    torch.save(x, tmp_path / "x.pt")
    torch.save(model(x.clone()), tmp_path / "expected.pt")
    result = subprocess.run(
        [sys.executable, "-c", _LOAD_WITHOUT_PACKAGE, kind.split(".")[0], str(program),
         str(tmp_path / "x.pt"), str(tmp_path / "expected.pt")],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "same", result.stderr


@one_backend  # the layer computes in ATen ops under export and trace whatever the backend
@pytest.mark.parametrize("dynamo", [True, False], ids=["torch.export", "jit.trace"])
def test_onnx_export_runs_in_onnxruntime(tmp_path, dynamo):
    """``torch.onnx.export`` of an evaluating network, by either exporter (torch.export's or
    TorchScript's): onnxruntime computes what the layers do."""
    import_or_skip("onnxscript")
    onnxruntime = import_or_skip("onnxruntime")
    model = network().float().eval()
    x = torch.randn(4, 3, 6, 6)
    path = tmp_path / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter's
        torch.onnx.export(model, (x.clone(),), str(path), dynamo=dynamo)
    session = onnxruntime.InferenceSession(str(path))
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    assert_close(torch.from_numpy(out), model(x.clone()).detach(), torch.float32,
                 what="onnxruntime output")


def test_torch_export_with_dynamic_sizes():
    """Exported with a dynamic batch and height (as plain BatchNorms export), the program
    computes what the layers do at other sizes."""
    model = network().eval()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    sizes = {0: torch.export.Dim("batch", min=1, max=64), 2: torch.export.Dim("h", min=4)}
    exported = torch.export.export(model, (x.clone(),), dynamic_shapes=(sizes,))
    for shape in ((1, 3, 6, 6), (7, 3, 9, 6)):
        y = torch.randn(shape, dtype=torch.float64)
        assert_close(exported.module()(y.clone()), model(y.clone()), what=f"at {shape}")


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_in_evaluation_is_plain_aten(strict):
    """An exported evaluating model holds ATen ops only (it runs without this package or
    Triton: ONNX, AOTInductor), computing what the layers do; by either of export's tracers."""
    model = network().eval()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    exported = torch.export.export(model, (x.clone(),), strict=strict)
    ops = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert not [op for op in ops if "encoding_syncbn" in op], ops
    assert_close(exported.module()(x.clone()), model(x.clone()), what="exported")


def _func_models(activation: str, inplace: bool, abn: bool, training: bool, tracked: bool):
    """A conv + our layer, and the same model reverted to plain torch modules."""
    torch.manual_seed(0)
    if abn:
        layer = InPlaceABN(4, activation=activation, activation_param=0.2,
                           track_running_stats=tracked)
    else:
        layer = SyncBatchNorm(4, activation=activation, slope=SLOPES.get(activation, 0.01),
                              inplace=inplace, track_running_stats=tracked)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), layer).double().train(training)
    with torch.no_grad():
        layer.weight.uniform_(-1.5, 1.5)
        layer.bias.uniform_(-0.5, 0.5)
        if tracked:
            layer.running_mean.uniform_(-1, 1)
            layer.running_var.uniform_(0.5, 2)
    return model, revert_sync_batchnorm(copy.deepcopy(model))


@settings(max_examples=12, deadline=None)
@given(
    activation=st.sampled_from(sorted(ACTIVATIONS)),
    inplace=st.booleans(),
    abn=st.booleans(),
    training=st.booleans(),
    transform=st.sampled_from(["grad", "jvp", "jacrev", "vmap"]),
    seed=st.integers(0, 2**16),
)
def test_func_transforms_compute_what_plain_batchnorm_does(activation, inplace, abn, training,
                                                           transform, seed):
    """``torch.func.grad`` (of the parameters and the input), ``jvp``, ``jacrev`` and ``vmap``
    (over models stacked by ``stack_module_state``) of a model holding the layer: the same as
    of that model reverted to plain torch modules, every activation, in place or not,
    mapillary's ``|w| + eps``. Training uses the batch's statistics (running statistics
    dropped, as ``torch.func.replace_all_batch_norm_modules_`` drops them), evaluation the
    running ones."""
    inplace = inplace and ACTIVATIONS[activation].inverse is not None and activation != "none"
    if abn and activation not in ("leaky_relu", "elu", "identity"):
        activation = "leaky_relu"
    model, plain = _func_models(activation, inplace, abn, training, tracked=not training)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, 5, 5, generator=gen, dtype=torch.float64)
    tangent = torch.randn_like(x)

    def apply(net):
        params = {k: v.detach() for k, v in net.named_parameters()}
        buffers = {k: v.detach().clone() for k, v in net.named_buffers()}

        def loss(p, inp):
            return torch.func.functional_call(net, (p, buffers), (inp,)).square().sum()

        if transform == "grad":
            return torch.func.grad(loss, argnums=(0, 1))(params, x.clone())
        if transform == "jvp":
            return torch.func.jvp(lambda inp: torch.func.functional_call(
                net, (params, buffers), (inp,)), (x.clone(),), (tangent,))
        if transform == "jacrev":
            return torch.func.jacrev(lambda inp: torch.func.functional_call(
                net, (params, buffers), (inp,)).sum((0, 2, 3)))(x.clone())
        copies = [copy.deepcopy(net) for _ in range(3)]
        for i, other in enumerate(copies):
            with torch.no_grad():
                for value in other.parameters():
                    value.mul_(1 + 0.1 * i)
        stacked, stacked_buffers = torch.func.stack_module_state(copies)
        return torch.func.vmap(lambda p, b: torch.func.functional_call(net, (p, b), (x,)))(
            stacked, stacked_buffers)

    got, want = apply(model), apply(plain)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert_close(a, b, what=transform)


def test_func_transform_of_tracked_training_fails_as_plain_batchnorm():
    """A training call under ``torch.func.grad`` with running statistics updates buffers the
    transform did not get as inputs: refused as torch refuses nn.BatchNorm's update, and
    ``replace_all_batch_norm_modules_`` (torch's remedy) takes the layer as a BatchNorm."""
    model, plain = _func_models("leaky_relu", True, False, training=True, tracked=True)
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    for net in (model, plain):
        with pytest.raises(RuntimeError, match="mutate a captured Tensor"):
            torch.func.grad(lambda inp, net=net: net(inp).sum())(x)
    torch.func.replace_all_batch_norm_modules_(model)
    torch.func.replace_all_batch_norm_modules_(plain)
    assert_close(torch.func.grad(lambda inp: model(inp).square().sum())(x),
                 torch.func.grad(lambda inp: plain(inp).square().sum())(x), what="replaced")


class _VmapInside(nn.Module):
    """A model that maps its layer over the last dimension inside its forward (vmap's levels
    are per thread, unlike forward-mode AD's, which two replica threads would share)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return torch.func.vmap(self.layer, in_dims=3, out_dims=3)(x)


def test_func_transform_refuses_a_synchronised_training_call():
    """Under DataParallel a transform inside the replicas would normalise each with its own
    statistics: refused by name, state untouched; ``sync=False`` runs."""
    layer = SyncBatchNorm(4).double()
    model = SimulatedDataParallel(_VmapInside(layer), 2)
    x = torch.randn(6, 4, 3, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"SyncBatchNorm\(4\).*cannot synchronise"):
        model(x)
    assert layer.num_batches_tracked.item() == 0
    layer.sync = False
    layer.track_running_stats = False
    torch.func.replace_all_batch_norm_modules_(layer)
    out = model(x)
    halves = [torch.func.vmap(lambda s: torch.nn.functional.batch_norm(
        s, None, None, layer.weight.detach(), layer.bias.detach(), True), 3, 3)(h)
        for h in x.chunk(2)]
    assert_close(out, torch.cat(halves), what="unsynchronised replicas")


@pytest.mark.parametrize("inplace", [True, False])
def test_a_tensor_left_by_a_finished_transform_is_taken_as_plain(inplace):
    """An input that escaped a finished ``torch.func`` transform (still wrapped: a "dead"
    wrapper) is taken as the plain tensor it holds, as ``Function.apply`` takes it: the output
    is a plain tensor, the same as for that tensor, and gradients reach the parameters."""
    leaked = []

    def loss(x):
        leaked.append(x * 2)
        return x.sum()

    torch.func.grad(loss)(torch.randn(4, 3, 5, 5, dtype=torch.float64))
    dead = leaked[0]
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    layer = SyncBatchNorm(3, activation="leaky_relu", inplace=inplace).double()
    plain = revert_sync_batchnorm(copy.deepcopy(layer))
    want = plain(dead.clone())
    got = layer(dead)
    assert not torch._C._functorch.is_functorch_wrapped_tensor(got)
    assert_close(got, want, what="output")
    got.square().sum().backward()
    want.square().sum().backward()
    assert_close(layer.weight.grad, plain.weight.grad, what="weight grad")


@settings(max_examples=8, deadline=None)
@given(
    activation=st.sampled_from(sorted(ACTIVATIONS)),
    inplace=st.booleans(),
    training=st.booleans(),
    of_parameters=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_forward_mode_ad_computes_what_plain_batchnorm_does(activation, inplace, training,
                                                            of_parameters, seed):
    """``torch.autograd.forward_ad``: the tangent of the output for a tangent of the input or
    of the parameters (dual tensors in a ``dual_level``; the layer's autograd Functions have
    no forward-mode rule) equals the reverted model's, in training and evaluation; the running
    statistics are updated as the reverted model's."""
    import torch.autograd.forward_ad as fwad

    inplace = inplace and ACTIVATIONS[activation].inverse is not None and activation != "none"
    model, plain = _func_models(activation, inplace, False, training, tracked=True)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, 5, 5, generator=gen, dtype=torch.float64)
    tangents = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64)
                for k, v in model.named_parameters()}
    x_tangent = torch.randn(x.shape, generator=gen, dtype=torch.float64)

    def tangent_of(net):
        with fwad.dual_level():
            if of_parameters:
                params = {k: fwad.make_dual(v.detach(), tangents[k])
                          for k, v in net.named_parameters()}
                out = torch.func.functional_call(net, params, (x.clone(),))
            else:
                out = net(fwad.make_dual(x.clone(), x_tangent))
            primal, tangent = fwad.unpack_dual(out)
        return primal, tangent

    for got, want in zip(tangent_of(model), tangent_of(plain)):
        assert_close(got, want, what="forward mode")
    for name, value in plain.named_buffers():
        assert_close(model.get_buffer(name), value, what=name)
