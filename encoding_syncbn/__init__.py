"""Synchronized BatchNorm for ``nn.DataParallel`` and ``torch.distributed``, with In-Place ABN."""

import logging

# The drop-in for mapillary's inplace_abn registers the conversions of their classes.
from . import inplace_abn  # noqa: F401
from .conversions.convert import convert_sync_batchnorm, register_conversion, revert_sync_batchnorm
from .conversions.fuse import convert_inplace_abn
from .conversions.reporting import ConversionReport, MemoryEstimate, NormLayerReport
from .kernels import get_backend, set_backend
from .layer.inplace_policy import check_inplace
from .layer.modules import SyncBatchNorm
from .sync.group import SyncError
from .version import __version__

# A library logs; the application decides what is shown (nothing, unless it configures
# logging: the converters' summaries are at INFO).
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "ConversionReport",
    "MemoryEstimate",
    "NormLayerReport",
    "SyncBatchNorm",
    "SyncError",
    "__version__",
    "check_inplace",
    "convert_inplace_abn",
    "convert_sync_batchnorm",
    "get_backend",
    "register_conversion",
    "revert_sync_batchnorm",
    "set_backend",
]
