"""Quickstart: SyncBatchNorm under DataParallel sees the whole batch; plain BatchNorm does not.

Trains a small convnet for a few SGD steps three ways, from the same initial weights:
  1. plain nn.BatchNorm2d on the whole batch, in one piece (the reference);
  2. the same model under DataParallel with plain BatchNorm: each replica normalises with the
     statistics of its own quarter of the batch;
  3. the same model converted with convert_sync_batchnorm under DataParallel: every replica
     normalises with the statistics of the whole batch.
On GPUs that is nn.DataParallel; on a CPU the replicas run in threads through
encoding_syncbn.testing.SimulatedDataParallel, which has the same semantics.

    python examples/quickstart.py
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from encoding_syncbn import convert_sync_batchnorm
from encoding_syncbn.testing import SimulatedDataParallel

REPLICAS = 4
STEPS = 5


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10),
    ).double()


def data_parallel(model: nn.Module) -> nn.Module:
    if torch.cuda.device_count() >= REPLICAS:
        return nn.DataParallel(model.cuda(), device_ids=list(range(REPLICAS)))
    return SimulatedDataParallel(model, REPLICAS)


def train(model: nn.Module, runner: nn.Module, batches) -> nn.Module:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for images, labels in batches:
        optimizer.zero_grad()
        device = next(model.parameters()).device
        logits = runner(images.to(device))
        nn.functional.cross_entropy(logits, labels.to(device)).backward()
        optimizer.step()
    return model


def running_stats(model: nn.Module) -> torch.Tensor:
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    return torch.cat([torch.cat([m.running_mean, m.running_var]).cpu() for m in norms])


def main() -> None:
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.manual_seed(0)
    # Per-image brightness varies a lot, as in real data: per-replica statistics then differ.
    batches = [(torch.randn(8, 3, 16, 16, dtype=torch.float64) * 2
                + torch.randn(8, 1, 1, 1, dtype=torch.float64) * 3,
                torch.randint(0, 10, (8,))) for _ in range(STEPS)]
    initial = make_model()

    full_batch = copy.deepcopy(initial)
    train(full_batch, full_batch, batches)

    per_replica = copy.deepcopy(initial)
    train(per_replica, data_parallel(per_replica), batches)

    synced = convert_sync_batchnorm(copy.deepcopy(initial))
    train(synced, data_parallel(synced), batches)

    reference = running_stats(full_batch)
    for name, model in (("plain BatchNorm per replica", per_replica),
                        ("SyncBatchNorm", synced)):
        gap = (running_stats(model) - reference).abs().max().item()
        print(f"{name:>28}: largest running-stat difference from full-batch BatchNorm "
              f"after {STEPS} steps on {REPLICAS} replicas = {gap:.2e}")
    synced_gap = (running_stats(synced) - reference).abs().max().item()
    plain_gap = (running_stats(per_replica) - reference).abs().max().item()
    verdict = "equal" if synced_gap < 1e-9 < plain_gap else "NOT as expected"
    print(f"SyncBatchNorm statistics equal full-batch BatchNorm's, per-replica BatchNorm's do "
          f"not: {verdict}")
    if verdict != "equal":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
