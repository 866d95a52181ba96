"""Training curves and a prediction grid, drawn with matplotlib's file-only Agg backend."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from .data import IGNORE_INDEX, denormalize


def label_colors(num_classes: int) -> np.ndarray:
    """``(256, 3)`` float RGB table: a distinct colour per class, white for ignored pixels.

    Spreads the bits of the class index over the three channels (the scheme of the VOC
    palette), so neighbouring class ids get very different colours.
    """
    table = np.zeros((256, 3), dtype=np.float64)
    for label in range(num_classes):
        value, rgb = label, [0, 0, 0]
        for bit in range(8):
            for channel in range(3):
                rgb[channel] |= ((value >> channel) & 1) << (7 - bit)
            value >>= 3
        table[label] = rgb
    table[IGNORE_INDEX] = 255
    return table / 255.0


def _pyplot() -> ModuleType:
    import matplotlib

    # Agg draws to files only: works on servers with no display and in worker threads.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_curves(history: Sequence[dict[str, float]], path: Path) -> None:
    """Training loss and validation mIoU / pixel accuracy per epoch, side by side."""
    plt = _pyplot()
    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_score) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [h["loss"] for h in history], marker="o")
    ax_loss.set(xlabel="epoch", ylabel="training loss", title="Loss")
    ax_score.plot(epochs, [h["miou"] for h in history], marker="o", label="mIoU")
    ax_score.plot(epochs, [h["pixel_acc"] for h in history], marker="s", label="pixel accuracy")
    ax_score.set(xlabel="epoch", ylabel="validation score", title="Validation", ylim=(0, 1))
    ax_score.legend()
    for ax in (ax_loss, ax_score):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_comparison(
    panels: dict[str, dict[str, Sequence[dict[str, float]]]], path: Path
) -> None:
    """Validation mIoU per epoch: one panel per title, one curve per label in it.

    ``panels`` maps a panel's title to ``{curve label: history}``, histories as the training
    script records them (dicts with ``epoch`` and ``miou``).
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (title, curves) in zip(axes[0], panels.items()):
        for label, history in curves.items():
            ax.plot([h["epoch"] for h in history], [h["miou"] for h in history], marker="o",
                    markersize=3, label=label)
        ax.set(title=title, xlabel="epoch", ylabel="validation mIoU", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_predictions(
    images: torch.Tensor, targets: torch.Tensor, preds: torch.Tensor, num_classes: int,
    path: Path,
) -> None:
    """One row per sample: the image, its ground truth and the prediction."""
    plt = _pyplot()
    colors = label_colors(num_classes)
    rows = images.shape[0]
    fig, axes = plt.subplots(rows, 3, figsize=(7.5, 2.5 * rows), squeeze=False)
    for row in range(rows):
        panels = (
            denormalize(images[row]),
            colors[targets[row].cpu().numpy()],
            colors[preds[row].cpu().numpy()],
        )
        for ax, panel, title in zip(axes[row], panels, ("image", "ground truth", "prediction")):
            ax.imshow(panel, interpolation="nearest")
            ax.set_axis_off()
            if row == 0:
                ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
