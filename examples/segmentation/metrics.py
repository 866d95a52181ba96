"""Confusion-matrix segmentation metrics: pixel accuracy and mean intersection over union."""

from __future__ import annotations

import torch

from .data import IGNORE_INDEX


def confusion_matrix(
    pred: torch.Tensor, target: torch.Tensor, num_classes: int, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """``(num_classes, num_classes)`` int64 counts, rows = true class, columns = prediction.

    Pixels labelled ``ignore_index`` are left out. Accumulating matrices (and summing them over
    processes) gives exact dataset-level metrics, unlike averaging per-batch scores.
    """
    valid = target != ignore_index
    index = target[valid].to(torch.int64) * num_classes + pred[valid].to(torch.int64)
    counts = torch.bincount(index, minlength=num_classes * num_classes)
    return counts.reshape(num_classes, num_classes).cpu()


def scores(confusion: torch.Tensor) -> dict[str, float]:
    """Pixel accuracy and mIoU from a confusion matrix.

    The mean IoU runs over the classes that occur in the truth or the predictions; a class
    absent from both has no defined IoU and would otherwise count as 0 or 1 arbitrarily.
    """
    confusion = confusion.to(torch.float64)
    tp = confusion.diag()
    union = confusion.sum(0) + confusion.sum(1) - tp
    present = union > 0
    total = confusion.sum()
    pixel_acc = (tp.sum() / total).item() if total > 0 else 0.0
    miou = (tp[present] / union[present]).mean().item() if present.any() else 0.0
    return {"pixel_acc": pixel_acc, "miou": miou}
