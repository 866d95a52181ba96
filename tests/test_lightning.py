"""encoding_syncbn.lightning: ``SyncBatchNormPlugin`` in a real Lightning Trainer (2 ranks over
gloo on the CPU), and the package without Lightning installed.

Lightning takes some seconds to import, so one launcher (a fresh interpreter, so that nothing
of pytest's process is forked) imports it once and forks the two ranks. As in
test_distributed, the parent holds the rendezvous store; each rank initialises
torch.distributed itself, which Lightning's ``"ddp"`` strategy then uses as it is
(``LOCAL_RANK`` in the environment tells it that the processes exist already). Each rank fits
a small float64 convnet for a few steps with each plugin configuration, on exactly its half of
every batch, and saves what it saw; the tests compare that with one process fed the whole
batch through plain ``nn.BatchNorm2d``. The ranks run the default backend: the plugin only
converts, and the layers' backends are tested across processes in test_distributed.

Nothing can hang: the collectives have a timeout, and the launcher a deadline after which its
process group is killed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import traceback
from pathlib import Path

import gloo_group
import pytest
import torch
import torch.distributed as dist
from torch import nn

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
WORLD = 2
STEPS, HALF = 3, 4  # each batch: 2 * HALF images, rank r takes images [r * HALF, (r+1) * HALF)
C = 4
LAUNCH_DEADLINE_S = 300.0  # Lightning's import and every fit included: a hang guard only
# Each run: the Lightning package whose Trainer fits, and the plugin's arguments
# ("factory": a function creating a group of both ranks, called by the plugin's apply).
# "precision": the model is made in float32 and Lightning's "64-true" precision converts it
# after the plugin applies, replacing the converted layers' buffers.
RUNS = {
    "syncbn": ("lightning.pytorch", {}),
    "inplace_abn": ("lightning.pytorch", {"inplace_abn": True}),
    "group_factory": ("lightning.pytorch", {"process_group": "factory"}),
    "precision": ("lightning.pytorch", {"inplace_abn": True}),
    "pytorch_lightning": ("pytorch_lightning", {}),
}

# ------------------------------------------------------------ the model, data and reference


def _convnet(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(
        nn.Conv2d(3, C, 3, padding=1, bias=False), nn.BatchNorm2d(C), nn.LeakyReLU(0.1),
        nn.Conv2d(C, C, 1), nn.BatchNorm2d(C), nn.ReLU(),
        nn.Conv2d(C, 2, 1),
    ).to(dtype)


def _batches() -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (STEPS, 2 * HALF, ...): the whole batch of every step."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(STEPS, 2 * HALF, 3, 6, 6, generator=gen, dtype=torch.float64) * 2 + 0.5
    y = torch.randn(STEPS, 2 * HALF, 2, 6, 6, generator=gen, dtype=torch.float64)
    return x, y


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # The mean over a rank's half: DDP's average of the two is the whole batch's mean.
    return (out - target).square().mean()


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _reference() -> dict[str, torch.Tensor]:
    """The state after STEPS steps of one process on the whole batch, plain nn.BatchNorm2d."""
    model = _convnet()
    optimizer = _optimizer(model.parameters())
    x, y = _batches()
    for step in range(STEPS):
        loss = _loss(model(x[step]), y[step])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {f"net.{name}": value for name, value in model.state_dict().items()}


# ------------------------------------------------------------------------- in the ranks


def _import_lightning() -> None:
    # Through third_party: the torchvision that Lightning's torchmetrics imports may be a
    # CUDA build whose ops cannot load beside the CPU torch.
    from third_party import import_or_skip

    import_or_skip("lightning.pytorch")
    import_or_skip("pytorch_lightning")


def _describe(module: nn.Module, group) -> tuple:
    from encoding_syncbn import SyncBatchNorm

    if isinstance(module, SyncBatchNorm):
        return ("SyncBatchNorm", module.activation, module.inplace, module.process_group is group)
    return (type(module).__name__,)


def _fit(rank: int, run: str, outdir: Path) -> dict:
    from torch.utils.data import DataLoader, TensorDataset

    from encoding_syncbn.lightning import SyncBatchNormPlugin

    package, kwargs = RUNS[run]
    pl = sys.modules[package]
    groups = [None]  # the group the plugin's layers must hold

    def new_group():
        groups.append(dist.new_group(list(range(WORLD))))
        return groups[-1]

    if kwargs.get("process_group") == "factory":
        kwargs = dict(kwargs, process_group=new_group)

    dtype = torch.float32 if run == "precision" else torch.float64

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _convnet(dtype)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return _loss(self(batch[0]), batch[1])

        def configure_optimizers(self):
            return _optimizer(self.parameters())

    converted = {}

    class Record(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            converted.update((path, _describe(m, groups[-1]))
                             for path, m in pl_module.named_modules())

    model = Net()
    own = dict(model.named_modules())
    x, y = _batches()
    mine = slice(rank * HALF, (rank + 1) * HALF)
    # A DataLoader of this rank's halves, in step order (no DistributedSampler).
    loader = DataLoader(TensorDataset(x[:, mine].flatten(0, 1), y[:, mine].flatten(0, 1)),
                        batch_size=HALF)
    checkpoints = outdir / run
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy="ddp",
        plugins=[SyncBatchNormPlugin(**kwargs)], max_steps=STEPS, use_distributed_sampler=False,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=checkpoints), Record()],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=outdir, precision="64-true" if run == "precision" else "32-true",
    )
    trainer.fit(model, loader)
    record = {
        "converted": converted,
        "reverted": {path: type(m).__name__ for path, m in model.named_modules()},
        "own_modules": all(model.get_submodule(path) is m for path, m in own.items()),
        "state": {name: value.clone() for name, value in model.state_dict().items()},
    }
    if rank == 0:
        (path,) = checkpoints.glob("*.ckpt")
        record["checkpoint"] = torch.load(path, weights_only=False)["state_dict"]
        loaded = Net.load_from_checkpoint(path, strict=True)
        record["checkpoint_loaded"] = {name: value.clone()
                                       for name, value in loaded.state_dict().items()}
    return record


def _misuse(rank: int, outdir: Path) -> dict:
    """What the plugin and Lightning say to a group that no longer exists, to
    ``sync_batchnorm=True`` beside the plugin, and to an inplace_abn that is not a bool."""
    from torch.utils.data import DataLoader, TensorDataset

    from encoding_syncbn.lightning import SyncBatchNormPlugin

    pl = sys.modules["lightning.pytorch"]

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _convnet()

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return _optimizer(self.parameters())

    messages = {}
    gone = dist.new_group(list(range(WORLD)))
    dist.destroy_process_group(gone)
    loader = DataLoader(TensorDataset(torch.randn(HALF, 3, 6, 6, dtype=torch.float64)),
                        batch_size=HALF)
    settings = dict(accelerator="cpu", devices=WORLD, strategy="ddp", max_steps=1,
                    logger=False, enable_progress_bar=False, enable_model_summary=False,
                    enable_checkpointing=False, default_root_dir=outdir)
    trainer = pl.Trainer(plugins=[SyncBatchNormPlugin(process_group=gone)], **settings)
    try:
        trainer.fit(Net(), loader)
    except ValueError as error:
        messages["destroyed_group"] = str(error)
    try:
        pl.Trainer(sync_batchnorm=True, plugins=[SyncBatchNormPlugin()], **settings)
    except Exception as error:  # Lightning's MisconfigurationException
        messages["with_sync_batchnorm"] = str(error)
    try:
        SyncBatchNormPlugin(inplace_abn="yes")
    except TypeError as error:
        messages["inplace_abn"] = str(error)
    return messages


def _rank(rank: int, port: int, outdir: str) -> None:
    out = Path(outdir)
    try:
        os.environ["LOCAL_RANK"] = str(rank)
        gloo_group.join(rank, WORLD, port)
        results = {run: _fit(rank, run, out) for run in RUNS}
        results["misuse"] = _misuse(rank, out)
        torch.save(results, out / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        # The peer is left inside a collective: leave at once, it fails fast.
        os._exit(1)


def _launcher(port: int, outdir: str) -> None:
    """In the fresh interpreter: import Lightning once, then fork the ranks."""
    import multiprocessing

    _import_lightning()
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_rank, args=(rank, port, outdir)) for rank in range(WORLD)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    sys.exit(max(process.exitcode for process in ranks))


# --------------------------------------------------------------------------- the parent


def _launch() -> dict:
    """{"ranks": [per-rank results or None], "problems": str}."""
    outdir = tempfile.mkdtemp(prefix="syncbn_lightning_")
    # The parent holds the rendezvous store, so the port is free and stays ours.
    store = gloo_group.rendezvous(WORLD)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT, TESTS] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    code = f"import test_lightning; test_lightning._launcher({store.port}, {outdir!r})"
    log = Path(outdir) / "launcher.log"
    with open(log, "w") as output:
        launcher = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                                    stdout=output, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        try:
            launcher.wait(timeout=LAUNCH_DEADLINE_S)
            hung = ""
        except subprocess.TimeoutExpired:
            hung = f"killed at the {LAUNCH_DEADLINE_S:.0f} s deadline\n"
        try:
            # Whatever is left of the launcher's session (its ranks), before the launcher is
            # reaped: until then its id, the session's, cannot have been reused.
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        launcher.wait()
    ranks, problems = [], hung
    for rank in range(WORLD):
        path, error = Path(outdir) / f"rank{rank}.pt", Path(outdir) / f"rank{rank}.error"
        ranks.append(torch.load(path, weights_only=True) if path.exists() else None)
        if error.exists():
            problems += f"rank {rank}:\n{error.read_text()}\n"
    if None in ranks:
        problems += f"launcher exit code {launcher.returncode}:\n{log.read_text()[-6000:]}"
    shutil.rmtree(outdir, ignore_errors=True)
    del store
    return {"ranks": ranks, "problems": problems}


def _ranks() -> list[dict]:
    for package in ("lightning", "pytorch_lightning"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed (pip install {package})")
    launch = _launch()
    if None in launch["ranks"]:
        pytest.fail(launch["problems"])
    return launch["ranks"]


def _assert_same_state(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-10, atol=1e-10,
                                   msg=lambda m, name=name: f"{what}: {name}: {m}")


def _check_whole_batch(run: str, ranks: list[dict], expected: dict) -> None:
    """After fitting, each rank's model (running statistics, num_batches_tracked and
    parameters) is that of one process fed the whole batch through plain nn.BatchNorm2d."""
    for rank, results in enumerate(ranks):
        _assert_same_state(results[run]["state"], expected, f"{run}: rank {rank}")


def _check_checkpoint(run: str, ranks: list[dict], expected: dict) -> None:
    """The checkpoint Lightning wrote while the model was converted holds the synchronised
    statistics, and loads strictly into the unconverted LightningModule."""
    record = ranks[0][run]
    _assert_same_state(record["checkpoint"], expected, f"{run}: checkpoint")
    written = {name: value.to(record["checkpoint_loaded"][name].dtype)
               for name, value in record["checkpoint"].items()}
    _assert_same_state(record["checkpoint_loaded"], written, f"{run}: loaded checkpoint")


def _check_apply_and_revert(run: str, ranks: list[dict]) -> None:
    """While fitting, the BatchNorms are this package's layers over the plugin's group (with
    inplace_abn=True, the one followed by LeakyReLU fused in place); afterwards the model
    holds its own module objects again."""
    sync = ("SyncBatchNorm", "none", False, True)
    expected = {"net.1": sync, "net.2": ("LeakyReLU",), "net.4": sync}
    if RUNS[run][1].get("inplace_abn"):
        expected.update({"net.1": ("SyncBatchNorm", "leaky_relu", True, True),
                         "net.2": ("Identity",)})
    for rank, results in enumerate(ranks):
        record, what = results[run], f"{run}: rank {rank}"
        assert {path: record["converted"][path] for path in expected} == expected, what
        assert record["reverted"]["net.1"] == record["reverted"]["net.4"] == "BatchNorm2d", what
        assert record["reverted"]["net.2"] == "LeakyReLU", what
        assert record["own_modules"], f"{what}: not the model's own modules"


def _check_misuse(ranks: list[dict]) -> None:
    for rank, results in enumerate(ranks):
        messages = results["misuse"]
        # A group that no longer exists: the error says what to pass.
        message = messages.get("destroyed_group", "")
        assert "SyncBatchNormPlugin: process_group" in message, (rank, message)
        assert "process_group=lambda: torch.distributed.new_group(ranks)" in message, message
        # Lightning takes the plugin as a LayerSync, which it refuses beside
        # sync_batchnorm=True.
        message = messages.get("with_sync_batchnorm", "")
        assert "sync_batchnorm=True" in message and "SyncBatchNormPlugin" in message, message
        assert messages.get("inplace_abn") == (
            "SyncBatchNormPlugin: inplace_abn must be a bool, got str 'yes'")


# One test for the one launch: split in several, each pytest-xdist worker running one of them
# would launch (and import Lightning) again.
def test_trainer_with_plugin():
    """Every run of RUNS (the plugin's arguments, both Lightning packages) synchronises as the
    whole batch, writes checkpoints the unconverted model loads and reverts to the model's own
    modules; misuse gets errors that say what to do."""
    ranks, expected = _ranks(), _reference()
    for run in RUNS:
        _check_apply_and_revert(run, ranks)
        _check_whole_batch(run, ranks, expected)
        _check_checkpoint(run, ranks, expected)
    _check_misuse(ranks)


def test_package_imports_without_lightning():
    """With every Lightning package unimportable: the package and each of its other modules
    import, and encoding_syncbn.lightning raises an ImportError naming the extra."""
    code = textwrap.dedent("""
        import importlib, importlib.abc, pkgutil, sys

        class NotInstalled(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.partition(".")[0] in ("lightning", "pytorch_lightning",
                                              "lightning_fabric"):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, NotInstalled())
        import encoding_syncbn
        for info in pkgutil.walk_packages(encoding_syncbn.__path__, "encoding_syncbn."):
            if info.name != "encoding_syncbn.lightning":
                importlib.import_module(info.name)
        try:
            import encoding_syncbn.lightning
        except ImportError as error:
            print(type(error).__name__, error)
        else:
            print("imported")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ImportError "), out.stdout
    assert "not installed: pip install lightning " in out.stdout, out.stdout
