"""Smoke tests for the segmentation example (examples/train_segmentation.py and its helpers).

Everything runs at tiny sizes on CPU; the whole file takes well under a minute on two cores.
"""

from __future__ import annotations

import copy
import math
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from backends import each_backend

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

from segmentation.data import (  # noqa: E402
    IGNORE_INDEX,
    SHAPE_CLASSES,
    SyntheticShapes,
    VOCSegmentation,
)
from segmentation.metrics import confusion_matrix, scores  # noqa: E402
from segmentation.model import NORM_CHOICES, DeepLabV3, convert_norm  # noqa: E402

from encoding_syncbn import SyncBatchNorm  # noqa: E402
from encoding_syncbn.testing import SimulatedDataParallel  # noqa: E402

# Flags that make a training run take a second or two.
TINY_SIZES = ["--image-size", "32", "--width", "8", "--train-images", "8", "--val-images", "4",
              "--batch-size", "4", "--num-vis", "2", "--no-progress"]
TINY = [*TINY_SIZES, "--replicas", "2"]


def _tiny_model(norm: str, output_stride: int = 8, activation: str = "leaky_relu") -> DeepLabV3:
    model = DeepLabV3(len(SHAPE_CLASSES), activation, width=8, blocks=[1, 1, 1, 1],
                      output_stride=output_stride)
    return convert_norm(model, norm)


# ---------------------------------------------------------------------------------- model


@pytest.mark.parametrize("norm", NORM_CHOICES)
def test_model_forward_backward(norm: str) -> None:
    torch.manual_seed(0)
    model = _tiny_model(norm).train()
    x = torch.randn(4, 3, 32, 32)
    target = torch.randint(0, len(SHAPE_CLASSES), (4, 32, 32))
    logits = SimulatedDataParallel(model, 2)(x)
    assert logits.shape == (4, len(SHAPE_CLASSES), 32, 32)
    F.cross_entropy(logits, target).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    model.eval()
    with torch.no_grad():
        assert model(x).shape == logits.shape


def test_model_output_stride_16() -> None:
    model = _tiny_model("bn", output_stride=16).train()
    assert model.backbone(torch.randn(2, 3, 64, 64)).shape[-2:] == (4, 4)
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, len(SHAPE_CLASSES), 64, 64)


def test_norm_choice_builds_the_right_layers() -> None:
    def layers(norm: str) -> list[torch.nn.Module]:
        return [m for m in _tiny_model(norm).modules()
                if isinstance(m, (torch.nn.BatchNorm2d, SyncBatchNorm))]

    plain = layers("bn")
    assert plain and all(type(m) is torch.nn.BatchNorm2d for m in plain)
    sync = layers("syncbn")
    assert all(isinstance(m, SyncBatchNorm) and m.activation == "none" for m in sync)
    abn = layers("inplace_abn")
    assert all(isinstance(m, SyncBatchNorm) for m in abn)
    fused = [m for m in abn if m.activation == "leaky_relu"]
    # Every BN+leaky ReLU pair is fused (all but the BNs that feed a residual add).
    assert fused and all(m.inplace for m in fused)
    assert len(abn) == len(sync) == len(plain)
    assert sum(isinstance(m, torch.nn.LeakyReLU) for m in _tiny_model("inplace_abn").modules()) \
        < sum(isinstance(m, torch.nn.LeakyReLU) for m in _tiny_model("bn").modules())


def test_conversion_computes_what_the_plain_model_computes() -> None:
    """The converted network = the plain one in training (one replica, float64): the loss and
    every parameter's gradient."""
    _check_conversion("syncbn")


@each_backend
def test_fused_in_place_conversion_computes_what_the_plain_model_computes() -> None:
    """The same with the fused in-place layers, on every backend. That model holds plain
    layers too (those that feed a residual add): the one above runs on the default backend
    only, as Triton's interpreter takes 2 minutes a model on a loaded 2-core machine."""
    _check_conversion("inplace_abn")


def _check_conversion(norm: str) -> None:
    torch.manual_seed(0)
    plain = _tiny_model("bn").double().train()
    converted = convert_norm(copy.deepcopy(plain), norm)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    target = torch.randint(0, len(SHAPE_CLASSES), (2, 32, 32))
    grads = []
    for model in (plain, converted):
        loss = F.cross_entropy(model(x.clone()), target)
        grads.append([loss.detach(), *torch.autograd.grad(loss, list(model.parameters()))])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------------- data


def test_synthetic_is_deterministic() -> None:
    a, b = SyntheticShapes(6, 48, seed=3), SyntheticShapes(6, 48, seed=3)
    for i in (0, 5, 2):  # any order: each sample depends on the index only
        xa, ya = a[i]
        xb, yb = b[i]
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a[0][0], SyntheticShapes(6, 48, seed=4)[0][0])
    assert not torch.equal(a[0][0], SyntheticShapes(6, 48, seed=3, split="val")[0][0])
    x, y = a[1]
    assert x.shape == (3, 48, 48) and x.dtype == torch.float32
    assert y.shape == (48, 48) and y.dtype == torch.int64


def test_synthetic_masks_match_shapes() -> None:
    ds = SyntheticShapes(40, 64, seed=0, max_shapes=3, shape_size=(0.1, 0.2))
    checked_areas = 0
    for i in range(len(ds)):
        image, mask, shapes = ds.render(i)
        assert set(np.unique(mask)) <= {0} | {s["label"] for s in shapes}
        top = shapes[-1]  # painted last, so never occluded
        (cx, cy), r = top["center"], top["radius"]
        # Every class contains the disc of half the radius around its centre; that disc is
        # labelled with the shape and painted in one colour (plus pixel noise).
        ys, xs = np.mgrid[0:64, 0:64] + 0.5
        core = (xs - cx) ** 2 + (ys - cy) ** 2 <= (0.5 * r) ** 2
        assert (mask[core] == top["label"]).all()
        assert image[core].std(axis=0).max() < 25
        inside = mask == top["label"]
        if len(shapes) == 1 and 1.5 * r <= min(cx, cy, 64 - cx, 64 - cy):
            name = SHAPE_CLASSES[top["label"]]
            expected = {"circle": math.pi, "square": 4.0,
                        "triangle": 3 * math.sqrt(3) * 0.75**2}[name] * r**2
            assert abs(inside.sum() - expected) / expected < 0.1, name
            checked_areas += 1
    assert checked_areas >= 3


def test_synthetic_shape_count_and_size() -> None:
    ds = SyntheticShapes(20, 64, seed=0, max_shapes=4, shape_size=(0.05, 0.1))
    shapes = [s for i in range(len(ds)) for s in ds.render(i)[2]]
    assert all(0.05 * 64 <= s["radius"] <= 0.1 * 64 for s in shapes)
    assert max(len(ds.render(i)[2]) for i in range(len(ds))) == 4
    for bad in ((0.2, 0.1), (0.0, 0.1), (0.1, 0.4)):
        with pytest.raises(ValueError, match="shape_size"):
            SyntheticShapes(2, 64, shape_size=bad)


def _fake_voc(root: Path, train_ids: list[str], val_ids: list[str]) -> Path:
    from PIL import Image

    voc = root / "VOCdevkit" / "VOC2012"
    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (voc / sub).mkdir(parents=True)
    (voc / "ImageSets/Segmentation/train.txt").write_text("\n".join(train_ids) + "\n")
    (voc / "ImageSets/Segmentation/val.txt").write_text("\n".join(val_ids) + "\n")
    rng = np.random.default_rng(0)
    palette = [0, 0, 0] * 256
    palette[15 * 3:15 * 3 + 3] = [192, 128, 128]
    palette[255 * 3:255 * 3 + 3] = [224, 224, 192]
    for name in train_ids + val_ids:
        pixels = rng.integers(0, 255, size=(30, 40, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(voc / "JPEGImages" / f"{name}.jpg")
        labels = np.zeros((30, 40), dtype=np.uint8)
        labels[5:25, 10:30] = 15  # a "person"
        labels[5, 10:30] = IGNORE_INDEX  # boundary pixels, as VOC draws them
        png = Image.fromarray(labels, mode="P")
        png.putpalette(palette)
        png.save(voc / "SegmentationClass" / f"{name}.png")
    return voc


def test_voc_loader_reads_palette_masks(tmp_path: Path) -> None:
    pytest.importorskip("PIL", reason="Pillow reads the VOC images")
    voc = _fake_voc(tmp_path, ["2007_000001", "2007_000002"], ["2007_000003"])
    train = VOCSegmentation(voc, "train", crop_size=32)
    val = VOCSegmentation(voc, "val", crop_size=32)
    assert len(train) == 2 and len(val) == 1 and len(train.classes) == 21
    for x, y in (train[0], train[1], val[0]):
        assert x.shape == (3, 32, 32) and y.shape == (32, 32)
        assert set(y.unique().tolist()) <= {0, 15, IGNORE_INDEX}
    x, y = val[0]
    # 40x30 scaled to 32x24 and padded: the padding rows are ignored, the person is found.
    assert (y[24:] == IGNORE_INDEX).all()
    assert (y[:24] == 15).sum() > 0


def test_voc_bad_root_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not an existing folder"):
        VOCSegmentation(tmp_path / "nowhere", "train")
    (tmp_path / "VOC2012" / "JPEGImages").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="SegmentationClass") as info:
        VOCSegmentation(tmp_path / "VOC2012", "train")
    named = str(info.value).split(";")[0]
    assert "ImageSets/Segmentation/train.txt" in named and "JPEGImages" not in named


def test_voc_listed_file_missing(tmp_path: Path) -> None:
    pytest.importorskip("PIL", reason="Pillow writes the fake VOC images")
    voc = _fake_voc(tmp_path, ["a"], ["b"])
    (voc / "ImageSets/Segmentation/train.txt").write_text("a\nghost\n")
    with pytest.raises(FileNotFoundError, match="ghost.jpg"):
        VOCSegmentation(voc, "train")


# -------------------------------------------------------------------------------- metrics


def test_confusion_matrix_scores() -> None:
    target = torch.tensor([0, 0, 1, 1, IGNORE_INDEX])
    pred = torch.tensor([0, 1, 1, 1, 0])
    cm = confusion_matrix(pred, target, num_classes=3)
    assert cm.tolist() == [[1, 1, 0], [0, 2, 0], [0, 0, 0]]
    s = scores(cm)
    assert s["pixel_acc"] == pytest.approx(3 / 4)
    # Class 2 is absent everywhere and left out of the mean.
    assert s["miou"] == pytest.approx((1 / 2 + 2 / 3) / 2)


# ------------------------------------------------------------------------------- training


@pytest.fixture()
def train_main() -> Callable[..., dict]:
    pytest.importorskip("tqdm", reason="the training script shows tqdm progress bars")
    pytest.importorskip("matplotlib", reason="the training script draws with matplotlib")
    import train_segmentation

    return train_segmentation.main


def _last_line(out: str) -> str:
    return out.strip().splitlines()[-1]


def test_training_run_writes_outputs_and_resumes(
    tmp_path: Path, train_main, capsys, monkeypatch
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # --no-progress needs no tqdm
    out = tmp_path / "run"
    result = train_main([*TINY, "--epochs", "1", "--output", str(out), "--export"])
    stdout = capsys.readouterr().out
    assert re.fullmatch(r"final mIoU: [01]\.\d{4}", _last_line(stdout))
    assert float(_last_line(stdout).split()[-1]) == pytest.approx(result["miou"], abs=1e-4)
    # It says where it wrote its outputs, before the score.
    assert stdout.strip().splitlines()[-2] == (
        f"wrote {out / 'curves.png'}, {out / 'predictions.png'}, {out / 'model.pt2'}")
    for name in ("checkpoint.pt", "curves.png", "predictions.png", "model.pt2"):
        assert (out / name).stat().st_size > 0, name
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["epoch"] == 1 and len(state["history"]) == 1
    assert state["history"][0]["train_s"] > 0 and state["history"][0]["peak_mib"] >= 0
    # The exported program: the trained model's evaluation, at another batch size.
    trained = _tiny_model("inplace_abn")
    trained.load_state_dict(state["model"])
    x = torch.randn(3, 3, 32, 32)
    exported = torch.export.load(out / "model.pt2").module()
    torch.testing.assert_close(exported(x.clone()), trained.eval()(x.clone()))

    train_main([*TINY, "--epochs", "2", "--output", str(out),
                "--resume", str(out / "checkpoint.pt")])
    stdout = capsys.readouterr().out
    assert "epoch 2/2" in stdout and "epoch 1/2" not in stdout
    assert _last_line(stdout).startswith("final mIoU: ")
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["epoch"] == 2 and [h["epoch"] for h in state["history"]] == [1, 2]

    # Resumed at or past --epochs: said so.
    train_main([*TINY, "--epochs", "2", "--num-vis", "0", "--output", str(out),
                "--resume", str(out / "checkpoint.pt")])
    assert "has trained 2 epochs, --epochs 2: nothing left to train" in capsys.readouterr().out

    # A checkpoint of another architecture is refused with a message, not a state_dict error.
    with pytest.raises(SystemExit, match="same model"):
        train_main([*TINY, "--epochs", "3", "--norm", "bn", "--output", str(out),
                    "--resume", str(out / "checkpoint.pt")])


def test_training_repeats_bitwise(tmp_path: Path, train_main) -> None:
    """Same command, same weights: the comparison of norms relies on it."""
    states = []
    for run in ("a", "b"):
        train_main([*TINY, "--epochs", "1", "--num-vis", "0", "--output", str(tmp_path / run)])
        states.append(torch.load(tmp_path / run / "checkpoint.pt", weights_only=True)["model"])
    assert all(torch.equal(states[0][key], states[1][key]) for key in states[0])


def test_training_with_bad_data_root_exits_with_message(tmp_path: Path, train_main) -> None:
    with pytest.raises(SystemExit, match="JPEGImages"):
        train_main([*TINY, "--data-root", str(tmp_path), "--output", str(tmp_path / "o")])


def test_help_explains_every_flag(train_main, capsys) -> None:
    import train_segmentation

    for action in train_segmentation.build_parser()._actions:
        assert action.help and len(action.help) > 10, action.option_strings
    with pytest.raises(SystemExit) as info:
        train_main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--norm", "--activation", "--replicas", "--distributed", "--data-root",
                 "--resume", "--output"):
        assert flag in text
    # The formatter's "(default: X)" only where the help does not say the default itself.
    for entry in re.split(r"\n  (?=-)", text):
        assert "(default:" not in entry or entry.count("default") == 1, entry


def test_help_needs_no_tqdm() -> None:
    """tqdm is imported where the progress bar is drawn, not when the script starts."""
    code = ("import runpy, sys; sys.modules['tqdm'] = None; "
            f"sys.argv = ['train_segmentation.py', '--help']; "
            f"runpy.run_path({str(EXAMPLES / 'train_segmentation.py')!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--activation" in proc.stdout


@pytest.mark.parametrize("flags,message", [
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--blocks", "1,1"], "--blocks takes four positive counts, one a ResNet stage, got 1,1"),
    (["--blocks", "1,0,1,1"], "--blocks takes four positive counts"),
])
def test_bad_sizes_are_usage_errors(train_main, capsys, flags, message) -> None:
    with pytest.raises(SystemExit) as info:
        train_main([*TINY, *flags])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_inplace_abn_needs_an_invertible_activation(train_main, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        train_main([*TINY, "--norm", "inplace_abn", "--activation", "relu"])
    assert info.value.code == 2
    assert "--activation leaky_relu" in capsys.readouterr().err


def test_distributed_run_under_torchrun(tmp_path: Path, train_main) -> None:
    """Two gloo processes, each with two simulated replicas: the layers sync across replicas
    and processes at once."""
    script = EXAMPLES / "train_segmentation.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           str(script), "--distributed", "--replicas", "2", *TINY_SIZES, "--epochs", "1",
           "--output", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert "replicas=2 processes=2" in lines[0]
    assert re.fullmatch(r"final mIoU: [01]\.\d{4}", lines[-1])
    assert sum(line.startswith("final mIoU") for line in lines) == 1  # main process only
    assert (tmp_path / "checkpoint.pt").is_file()


# ----------------------------------------------------------------------------- comparison


def test_comparison_writes_table_and_plot(tmp_path: Path, train_main, capsys) -> None:
    """A run per (setting, norm) from one command (one here: each is a process), a table row
    and a curve each, the data and sizes passed through."""
    import compare_norms

    sizes = ["--image-size", "32", "--width", "8", "--train-images", "4", "--val-images", "2",
             "--num-vis", "1", "--epochs", "2", "--max-shapes", "2"]
    results = compare_norms.main(["--settings", "noisy", "--norms", "inplace_abn", *sizes,
                                  "--output", str(tmp_path)])
    assert [(r["setting"], r["norm"], len(r["history"])) for r in results] == [
        ("noisy", "inplace_abn", 2)]
    rows = [line for line in (tmp_path / "compare.md").read_text().splitlines()
            if line.startswith("| noisy")]
    assert len(rows) == 1 and "4 replicas x 1 image | In-Place ABN" in rows[0]
    assert (tmp_path / "compare.png").stat().st_size > 0
    log = (tmp_path / "noisy-inplace_abn" / "log.txt").read_text()
    assert "norm=inplace_abn activation=leaky_relu" in log and "replicas=4" in log

    # What the comparison sets per run cannot be passed through, spelled out or abbreviated
    # as the training script's parser takes it.
    for flag in ("--batch-size", "--batch", "--rep"):
        with pytest.raises(SystemExit):
            compare_norms.main([flag, "4", "--output", str(tmp_path)])
        assert "set by this script" in capsys.readouterr().err

    # A resumed run passed through continues the checkpoint it names, its own run's; a run
    # that trains no epoch writes none: said so, not the last run's scores.
    checkpoint = tmp_path / "noisy-inplace_abn" / "checkpoint.pt"
    for epochs, resume in (("3", ["--resume", str(checkpoint)]), ("0", [])):
        sizes[sizes.index("--epochs") + 1] = epochs
        run = ["--settings", "noisy", "--norms", "inplace_abn", *sizes, *resume,
               "--output", str(tmp_path)]
        if epochs == "0":
            with pytest.raises(SystemExit, match="trained no epoch"):
                compare_norms.main(run)
        else:
            (result,) = compare_norms.main(run)
            assert [h["epoch"] for h in result["history"]] == [1, 2, 3]
