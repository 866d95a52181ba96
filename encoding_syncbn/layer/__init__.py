"""The layer: ``SyncBatchNorm`` and its norm+activation wrappers, the autograd Functions they
run, one synchronised call's exchange, and the bookkeeping of running in place (when it may,
which channels keep their input, misuse checks, checkpoint recomputation)."""
