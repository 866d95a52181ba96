"""Synchronized BatchNorm for ``nn.DataParallel`` and ``torch.distributed``, with In-Place ABN."""

# The drop-in for mapillary's inplace_abn registers the conversions of their classes.
from . import inplace_abn  # noqa: F401
from .convert import convert_sync_batchnorm, register_conversion, revert_sync_batchnorm
from .kernels import get_backend, set_backend
from .modules import SyncBatchNorm
from .sync import SyncError
from .version import __version__

__all__ = [
    "SyncBatchNorm",
    "SyncError",
    "__version__",
    "convert_sync_batchnorm",
    "get_backend",
    "register_conversion",
    "revert_sync_batchnorm",
    "set_backend",
]
