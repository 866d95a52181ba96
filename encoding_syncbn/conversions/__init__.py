"""Swapping a model's norm layers: the registry of conversions and the fx planner of
``convert_inplace_abn``. The public modules for mapillary's API (``encoding_syncbn.inplace_abn``)
and Lightning (``encoding_syncbn.lightning``) build on them."""
