"""``SyncBatchNorm``: the module users put in their networks."""

from __future__ import annotations

import functools
import numbers
import operator
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.utils import parametrize

from .. import activations, compat
from ..activations import ActConfig
from ..kernels import (
    RunningStats,
    batch_spread,
    channel_vector,
    get_backend,
    key_ops,
    ops_for,
    torch_ops,
    variance_spread,
)
from ..sync import distributed, replicas, stats
from ..sync.group import ReplicaGroup
from ..sync.replicas import ReplicaSlot
from . import compiled_inplace, compiled_mean, inplace_policy, recompute, tracing
from .call_memo import CallMemo
from .exchange import Exchange
from .functional import (
    batch_norm_act,
    computes_in,
    norm_act_composite,
    normalize_running,
    synced_batch_norm_act,
    track_batch,
    widened_batch_norm_act,
)
from .inplace_policy import ChannelsAside
from .recompute import RecomputeCache

# The options checked together, at construction and when assigned (``__setattr__``).
_ACTIVATION_OPTIONS = ("activation", "slope", "inplace")

# The options checked each alone, at construction and when assigned (``__setattr__``).
_STATISTICS_OPTIONS = ("eps", "momentum")

# The attributes the layer's ``ActConfig`` is made of: assigning one remakes it.
_CONFIG_SOURCES = (*_ACTIVATION_OPTIONS, "_label_text")

#: Under ``torch.compile`` a call is traced as its formula in differentiable ATen ops, which
#: Inductor fuses with the ops around it and differentiates itself (which tensors to keep for
#: backward is then its choice, as for ``nn.BatchNorm2d``); synchronised across processes,
#: with the merge in functional collectives (``distributed.merge_traced``). False: as the
#: backend's opaque custom ops, where a call synchronised across processes breaks the graph
#: at the exchange's host read of the counts. Either way a compiled call leaves its input as
#: it was (``inplace_policy.plan_call``); traced as its formula in one process on the CPU, an
#: in-place call keeps only its output for backward (``compiled_inplace``).
#: ``benchmarks/bench_compile.py`` measures both.
COMPILE_AS_FORMULA = True

# The layer's parameters and running statistics (buffers), as a call reads them (``_state``),
# and what reads them from ``_parameters`` and ``_buffers``.
_PARAMETERS = ("weight", "bias")
_RUNNING = ("running_mean", "running_var", "num_batches_tracked")
_PARAMETERS_OF = operator.itemgetter(*_PARAMETERS)
_RUNNING_OF = operator.itemgetter(*_RUNNING)

# Attributes that only make sense for the live object: dropped by pickle and deepcopy.
_TRANSIENT = ("_open_group", "_replica_slot", "_recompute_cache", "_replicas_channels_aside",
              "_channels_aside", "_warned_out_of_place", "_config", "_call_memo",
              *compiled_inplace.TRANSIENT)


class SyncBatchNorm(_BatchNorm):
    r"""Batch normalisation over the whole batch of every replica, optionally fused with an
    activation and computed in place (In-Place Activated BatchNorm).

    .. math::

        y = \mathrm{act}\left(\frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}}
            \cdot \gamma + \beta\right)

    The mean and (biased) variance are taken per channel over the batch and every trailing
    dimension of *all* replicas of the current ``nn.DataParallel`` call and, when
    ``torch.distributed`` is initialised with more than one rank in ``process_group``, of all
    processes. The running variance is updated with the unbiased variance of that whole batch.

    Args:
        num_features: C of an input of shape ``(N, C, *)``.
        eps, momentum, affine, track_running_stats, device, dtype, bias: as ``nn.BatchNorm2d``
            (``momentum=None``: cumulative average).
        process_group: the ``torch.distributed`` group to synchronise over (None: WORLD).
        sync: False makes it a per-replica BatchNorm (still with the fused activation).
        activation: ``"none"``, ``"identity"``, ``"leaky_relu"``, ``"elu"``, ``"relu"``,
            ``"silu"``, ``"gelu"`` (erf) or ``"gelu_tanh"`` (see ``activations.py``).
        slope: the negative slope of leaky_relu, or the alpha of elu.
        inplace: write the output over the input and keep only the output for backward.
            ``None``: in place exactly when the activation is invertible (identity,
            leaky_relu, elu); ``"none"``, relu, silu and gelu cannot be in place (True is an
            error).
            In place, 1/slope must be finite in the compute dtype (float32 unless ``dtype``
            is float64). Channels with |beta| >= |gamma| keep their input aside, and on
            float16 and bfloat16 inputs (autocast) ELU runs out of place: a rebuild from
            the output would lose precision. A training call over fewer than
            ``inplace_policy.MIN_REBUILT_COUNT`` values a channel in the whole batch
            (float64: ``MIN_FLOAT64_REBUILT_COUNT``) runs out of place: so few values leave
            the rebuilt input's rounding unaveraged (see ``inplace_policy``); below
            ``MIN_OWN_PRECISION_COUNT`` it computes in float64, and a float64 one below
            ``MIN_FLOAT64_REBUILT_COUNT`` takes its input gradient in double-double
            (``kernels/double_double.py``).

    In place, the tensor passed in is overwritten and returned. A tensor autograd will not let
    us overwrite (a leaf that requires grad, an output of ``torch.chunk``/``split``) is
    processed out of place, with a warning the first time (per layer). Do not use the input
    again (``abn(x) + x`` silently adds the output to itself), nor modify the output in place
    while backward needs it (``out += identity``: backward then raises, naming this layer);
    ``encoding_syncbn.check_inplace()`` reports both at the offending operation, and
    ``convert_inplace_abn`` chooses the layers of a model that may run in place. Out of place,
    the layer supports double backward (gradient penalties); in place it raises.

    ``SyncBatchNorm.convert_sync_batchnorm(module, process_group=None)``, where
    ``nn.SyncBatchNorm`` users look for it, is ``encoding_syncbn.convert_sync_batchnorm``
    (attached by ``convert.py``, which imports this module, not the other way round).
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
        sync: bool = True,
        activation: str = "none",
        slope: float = 0.01,
        inplace: bool | None = None,
    ) -> None:
        if (not isinstance(num_features, numbers.Integral) or isinstance(num_features, bool)
                or num_features < 1):
            raise ValueError(f"num_features must be a positive int, got {num_features!r}")
        num_features = int(num_features)  # a numpy integer too, as nn.BatchNorm2d takes it
        label = f"{type(self).__name__}({num_features})"
        eps = _statistics_option(label, "eps", eps)
        momentum = _statistics_option(label, "momentum", momentum)
        _check_process_group(process_group)
        slope = checked_slope(label, slope)
        inplace = inplace_policy.resolve_inplace(label, activation, slope, inplace, dtype)
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        if not bias:  # not by torch's `bias` argument, which torch 2.11 lacks
            self.register_parameter("bias", None)
        self.process_group = process_group
        self.sync = bool(sync)
        self.activation = activation
        self.slope = slope
        self.inplace = bool(inplace)
        # The rank of the last input, for revert_sync_batchnorm's choice of BatchNorm1d/2d/3d.
        # A list, so that replicas (which copy __dict__ shallowly) report to the original; of
        # fixed length, so that torch.compile does not recompile once it has been set.
        self._last_input_dim: list[int | None] = [None]
        # The layer's path in its model ("layer1.0.bn2"), for error messages; see record_paths.
        self._set_path(None)
        self._reset_transient()

    # ---- replication: how the replicas of one DataParallel call find each other ----------

    def _reset_transient(self) -> None:
        self._open_group: weakref.ref[ReplicaGroup] | None = None
        self._replica_slot: ReplicaSlot | None = None
        self._recompute_cache = RecomputeCache()
        # In place: the channels kept aside (gamma too small to rebuild their input). The
        # original layer reads them once per replicate() for all its replicas
        # (``_replicas_channels_aside``; None: not read); each replica, and a layer called
        # without replicate(), has its own.
        self._replicas_channels_aside: ChannelsAside | None = None
        self._channels_aside = ChannelsAside()
        # Whether this layer has warned that it ran out of place: once per layer, shared with
        # its replicas (which copy __dict__ shallowly), so that each layer's fallback is told.
        self._warned_out_of_place: list[bool] = [False]
        self._config = self._make_config()
        compiled_inplace.watch(self)
        # The last unsynchronised call's checks and decisions, for the calls of its key
        # (``call_memo``); None: none kept. Dropped at every assignment (``__setattr__``).
        self._call_memo: CallMemo | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        """Assigning ``activation``, ``slope``, ``inplace``, ``eps`` or ``momentum`` after
        construction is checked as the constructor checks them (an in-place slope of 0 would
        divide by zero in backward, an in-place relu could not be inverted, eps = 0 divides by
        zero on a constant channel): a ValueError naming the layer, nothing changed."""
        if name in _STATISTICS_OPTIONS and "inplace" in self.__dict__:
            value = _statistics_option(self._label(), name, value)
        if name in _ACTIVATION_OPTIONS and "inplace" in self.__dict__:
            options = {key: self.__dict__[key] for key in _ACTIVATION_OPTIONS}
            if name == "slope":
                value = checked_slope(self._label(), value)
            options[name] = value
            if name == "inplace" and not isinstance(value, bool):
                raise ValueError(f"{self._label()}: inplace must be a bool, got {value!r}")
            inplace_policy.resolve_inplace(self._label(), options["activation"], options["slope"],
                                           options["inplace"], self._compute_dtype())
        super().__setattr__(name, value)
        if name != "_call_memo":  # the decisions kept may follow from any attribute
            self.__dict__["_call_memo"] = None
        if name in _CONFIG_SOURCES and "_config" in self.__dict__:
            self._config = self._make_config()
        if name in ("weight", "bias", "inplace") and "_config" in self.__dict__:
            compiled_inplace.watch(self)

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        self.__dict__["_call_memo"] = None  # a parametrization's or a pruning's removal

    def _make_config(self) -> ActConfig:
        """The layer's ``ActConfig``: made when one of its sources is assigned, not in each
        call (a NamedTuple and four reads a call otherwise)."""
        return ActConfig(self.activation, self.slope, self.inplace, self._label_text)

    def _compute_dtype(self) -> torch.dtype | None:
        """The dtype of the layer's parameters or statistics (None: it has neither)."""
        state = self.weight if self.weight is not None else self.running_mean
        return state.dtype if state is not None else None

    def _replicate_for_data_parallel(self) -> SyncBatchNorm:
        """Called by ``torch.nn.parallel.replicate`` once per replica, in rank order."""
        group = replicas.group_taking_members(self._open_group)
        if group is None:
            group = replicas.new_group(self._label(), self._replica_slot)
            self._open_group = weakref.ref(group)
            # The replicas' parameters are copies of these, made just now: reading them back
            # here, once, spares every replica a device-to-host copy in each of its calls.
            # Not for a weight a hook recomputes in each forward: its value is the last one;
            # nor for one on the meta device, which has no values to read.
            with replicas.reading_parameters(group):
                self._replicas_channels_aside = None
                if self.inplace and not self._computed_by_hooks():
                    weight, bias = self.weight, self.bias  # read once: parametrizations compute
                    if not _on_meta(weight, bias):
                        self._replicas_channels_aside = ChannelsAside.read_now(
                            weight, bias, self._running_of(self.running_var))
        replica = super()._replicate_for_data_parallel()
        replica._replica_slot = ReplicaSlot(group, group.add_member(replica), self._replica_slot)
        replica._open_group = None
        replica._recompute_cache = RecomputeCache()
        found = self._replicas_channels_aside
        replica._channels_aside = found.copy() if found is not None else ChannelsAside()
        return replica

    def _computed_by_hooks(self) -> bool:
        """Whether ``weight`` or ``bias`` is a plain attribute that a forward pre-hook sets
        (``torch.nn.utils.prune``: ``weight_orig * weight_mask``), rather than a Parameter or
        a parametrization's property."""
        return any(
            name not in self._parameters and not parametrize.is_parametrized(self, name)
            and getattr(self, name) is not None
            for name in ("weight", "bias")
        )

    def _label(self) -> str:
        """How errors name the layer: its path in the model once a converter recorded it
        (``record_paths``), else its size and address. Formatted once, not per call."""
        return self._label_text

    def _set_path(self, path: str | None) -> None:
        self._path = path
        where = f"at model path {path!r}" if path else f"at {id(self):#x}"
        cls = type(self)
        if parametrize.is_parametrized(self):  # named as its class before parametrization
            cls = cls.__bases__[0]
        self._label_text = f"{cls.__name__}({self.num_features}) {where}"

    def _apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> SyncBatchNorm:
        super()._apply(fn, *args, **kwargs)
        self.__dict__["_call_memo"] = None  # another device or dtype, outside __setattr__
        compiled_inplace.watch(self)  # the parameters may have moved off the CPU, or onto it
        return self

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        compiled_inplace.forget(self)  # the parameters' values changed: counted again

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        return {key: value for key, value in state.items() if key not in _TRANSIENT}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "_label_text" not in state:  # pickled by a version that did not name layers
            self._set_path(None)
        self._reset_transient()

    # ---- forward -------------------------------------------------------------------------

    def _syncs_processes(self) -> bool:
        """Whether batch statistics are merged over ``process_group`` too (a subclass that
        normalises per process, as mapillary's ``ABN``, says no)."""
        return distributed.is_active(self.process_group)

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self._label()}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2:
            raise ValueError(
                f"{self._label()}: expected input of shape (N, C, *) with "
                f"C={self.num_features}, got a {x.dim()}-D input of shape {tuple(x.shape)}"
            )
        if x.shape[1] != self.num_features:
            raise ValueError(
                f"{self._label()}: expected {self.num_features} channels (dim 1), got input "
                f"of shape {tuple(x.shape)} with {x.shape[1]} channels"
            )
        if x.dtype not in torch_ops.INPUT_DTYPES:
            raise TypeError(
                f"{self._label()}: expected a floating-point input (float16, bfloat16, float32 "
                f"or float64), got {x.dtype}"
            )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """One call, in one of three ways: recorded as one node of the graph ``torch.fx``
        traces; computed in ATen ops where a capture or a transform records it
        (``_forward_in_aten_ops``); else run (``_forward``), or, where the last call's checks
        and decisions hold for this one, run as that call decided (``_repeat_call``)."""
        if not torch.compiler.is_compiling():  # Dynamo never reads the memo (no guard on it)
            memo = self._call_memo
            if memo is not None and memo.fits(input):
                return self._repeat_call(input, memo)
        if not isinstance(input, torch.Tensor) and tracing.is_fx_proxy(input):
            return tracing.fx_leaf_call(self, self._label(), input)
        if tracing.in_aten_ops():
            return self._forward_in_aten_ops(input)
        slot = self._replica_slot
        if slot is not None:
            slot.group.close()
        elif self._open_group is not None and (group := self._open_group()) is not None:
            group.close()
        try:
            return self._forward(input, slot)
        except BaseException as error:
            if slot is not None:
                slot.group.fail(slot.rank, error)
            raise

    def __prepare_scriptable__(self) -> SyncBatchNorm:
        tracing.refuse_script(self._label())
        return self

    def _forward_in_aten_ops(self, x: torch.Tensor) -> torch.Tensor:
        """The layer in differentiable ATen ops (``tracing.in_aten_ops``): evaluation for a
        program that must run without this package (a training capture is refused), and any
        call under a ``torch.func`` transform."""
        capture = tracing.capture_of_training(self.training)
        if capture is not None:
            tracing.refuse_training_capture(self._label(), capture)
        state = self._state(False)
        if torch.jit.is_tracing():
            with warnings.catch_warnings():
                # A warning at each size the checks compare: constants of the trace, rightly.
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                self._check_input(x)
                self._check_state(x, state)
        else:  # torch.export (whose strict tracer cannot trace the warnings' filters)
            self._check_input(x)
            self._check_state(x, state)
        weight, bias = self._affine_params(*state[:2], x)
        if self.training and self._synced(self._replica_slot):
            tracing.refuse_synced_transform(self._label())
        return self._formula(x, weight, bias, self._track_batch_staged)

    def _formula(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                 track: Callable[[torch.Tensor, torch.Tensor, int | torch.Tensor], None] | None,
                 merged: bool = False, compiled: bool = False) -> torch.Tensor:
        """The layer's output in differentiable ATen ops (``functional.norm_act_composite``),
        out of place: with the batch's statistics where training or without running ones
        (``track(mean, M2, count)`` folds them into the running statistics while training;
        ``merged``: the statistics of the whole process group, ``distributed.merge_traced``),
        else with the running ones (``track`` None). ``compiled``: a call ``torch.compile``
        traces (not a capture or transform), which in place on the CPU keeps for backward only
        its output and a static number of channels' input (``compiled_inplace``)."""
        acc = torch_ops.stats_dtype(x.dtype)
        dims = [0, *range(2, x.dim())]
        if merged:
            count = x.numel() // self.num_features
            # In float64, as the merge: a float32 mean would round the merge's M2. A float64
            # call brings its mean's error too (``compiled_mean.rank_stats``; an empty batch
            # takes part with zeros, count 0). The call normalises with the merged mean's
            # error and its rounding to the statistics' dtype taken out, through the bias
            # (``compiled_mean.shifted_bias``; invstd differentiable): per-channel values,
            # no read of x (a float32 one-process call keeps its rounded mean for that read).
            error = None
            if acc == torch.float64:
                mean, m2, error = compiled_mean.rank_stats(x)
            elif count:
                var, mean = torch.var_mean(x.to(torch.float64), dims, correction=0)
                m2 = var * count
            else:  # zeros on x's graph: this rank's backward joins the gather's collective
                m2 = mean = x.to(torch.float64).sum(dims)
            mean, m2, invstd, count, error = distributed.merge_traced(
                mean, m2, count, self.eps, self.process_group, error)
            track(mean.detach(), m2.detach(), count)
            rounded, invstd = mean.to(acc), invstd.to(acc)
            error = stats.rounded_error(mean.detach(), error, rounded.detach())
            return norm_act_composite(ActConfig(self.activation, self.slope, False))(
                x, rounded, invstd, weight,
                compiled_mean.shifted_bias(weight, bias, error * invstd))
        if self.training or self.running_mean is None:  # the batch's own statistics
            count = self._training_count(x) if self.training else 0
            if torch.compiler.is_compiling():
                # nn.BatchNorm's own op, which Inductor decomposes as (x - mean) * invstd and
                # differentiates as it does for nn.BatchNorm2d, in no more time than the
                # compiled plain net (the statistics' own formula below costs more there).
                # Eagerly (torch.func, export) ATen's CPU kernel would compute
                # x * scale + shift, which a large mean cancels. In place: see
                # ``compiled_inplace``; float64 takes its mean's error out: ``compiled_mean``.
                kept = (compiled_inplace.keep_aside(self, x, x.numel() // self.num_features)
                        if compiled else None)
                if compiled and acc == torch.float64:
                    batch = compiled_mean.batch_stats(x, self.eps)
                    if self.training:
                        track(batch.mean, batch.m2, count)
                    if kept is not None:
                        spread = batch_spread(batch.m2, x.numel() // self.num_features,
                                              batch.invstd)
                        return compiled_inplace.norm_act(
                            x, weight, bias, batch.mean, batch.invstd, batch.offset, True, kept,
                            self.activation, self.slope, spread)
                    return compiled_mean.InputNormAct.apply(
                        x, weight, bias, batch.mean, batch.invstd, batch.offset,
                        self.activation, self.slope)
                if self.training or kept is not None:
                    with torch.no_grad():
                        var, mean = torch.var_mean(x.to(acc), dims, correction=0)
                if self.training:
                    track(mean, var * count, count)
                if kept is not None:
                    return compiled_inplace.norm_act(x, weight, bias, mean,
                                                     torch.rsqrt(var + self.eps), None, True,
                                                     kept, self.activation, self.slope,
                                                     variance_spread(var, self.eps))
                z = torch.nn.functional.batch_norm(x.to(acc), None, None, weight, bias, True,
                                                   0.0, self.eps)
                act = activations.ACTIVATIONS[self.activation]
                return act.forward(z, self.slope).to(x.dtype)
            var, mean = torch.var_mean(x.to(acc), dims, correction=0)
            if self.training:
                track(mean.detach(), var.detach() * count, count)
        else:
            mean, var = self.running_mean.to(acc), self.running_var.to(acc)
            kept = compiled_inplace.keep_aside(self, x, None) if compiled else None
            if kept is not None:
                return compiled_inplace.norm_act(x, weight, bias, mean,
                                                 torch.rsqrt(var + self.eps), None, False, kept,
                                                 self.activation, self.slope,
                                                 variance_spread(var, self.eps))
        config = ActConfig(self.activation, self.slope, False, self._label())
        return norm_act_composite(config)(x, mean, torch.rsqrt(var + self.eps), weight, bias)

    def _track_batch_staged(self, mean: torch.Tensor, m2: torch.Tensor, count: int) -> None:
        """``_track_batch`` under a transform: computed on copies of the running statistics
        first, written back only once that succeeded. ``vmap`` gives per-sample statistics,
        which cannot be folded into the buffers: refused with them untouched (the update
        itself would fail after scaling them). (Under ``grad`` torch refuses the write back,
        the first write, as it refuses ``nn.BatchNorm``'s update.)"""
        running = self._running(*self._state(False)[2:])
        if running is None:
            return
        staged = RunningStats(running.mean.clone(), running.var.clone(),
                              None if running.batches is None else running.batches.clone(),
                              running.momentum)
        try:
            track_batch(staged, mean, m2, count)
        except RuntimeError as error:
            raise RuntimeError(
                f"{self._label()}: cannot fold this call's batch statistics into its running "
                "statistics under this torch.func transform (under vmap they are per sample); "
                "the running statistics are unchanged. Use track_running_stats=False "
                "(torch.func.replace_all_batch_norm_modules_), or evaluate (model.eval()). "
                f"PyTorch said: {error}"
            ) from error
        for buffer, value in zip(running[:3], staged[:3]):  # mean, var, batches
            if buffer is not None:
                buffer.copy_(value)

    def _affine_params(self, weight: torch.Tensor | None, bias: torch.Tensor | None,
                       x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's ``weight`` and ``bias`` as it computes with them on ``x`` and hands them
        to the backend: contiguous, in x's statistics dtype, ones and zeros where there are
        none."""
        dtype = torch_ops.stats_dtype(x.dtype)
        if (weight is not None and bias is not None and weight.dtype == dtype == bias.dtype
                and weight.is_contiguous() and bias.is_contiguous()):
            return weight, bias  # the usual parameters, as they are (``channel_vector``'s test)
        weight = (
            channel_vector(weight, dtype)
            if weight is not None
            else torch.ones(self.num_features, dtype=dtype, device=x.device)
        )
        bias = (
            channel_vector(bias, dtype)
            if bias is not None
            else torch.zeros(self.num_features, dtype=dtype, device=x.device)
        )
        return weight, bias

    def _forward(self, x: torch.Tensor, slot: ReplicaSlot | None) -> torch.Tensor:
        """Check the call, choose its mode once and run it: evaluation with the running
        statistics; batch statistics synchronised (in a checkpoint's recomputation, those of
        the original call); batch statistics of this replica alone (one replica, or
        ``sync=False``); while compiling, the formula in ATen ops (``_formula``). Each mode is
        one call, into ``functional`` where it runs the mode's autograd Function
        (docs/internals.md), after the one decision of how it runs in place
        (``inplace_policy.plan_call``)."""
        dim = x.dim() if isinstance(x, torch.Tensor) else 0
        if dim < 2 or x.shape[1] != self.num_features or x.dtype not in torch_ops.INPUT_DTYPES:
            self._check_input(x)  # raises, saying what is wrong
        compiling = torch.compiler.is_compiling()
        if not compiling:  # a side effect a traced checkpoint refuses
            self._last_input_dim[0] = dim
        state = self._state(False)
        self._check_state(x, state)
        weight, bias, running_mean, running_var, batches = state
        weight, bias = self._affine_params(weight, bias, x)
        if not compiling and x.is_inference():  # (Dynamo cannot ask)
            self._check_recordable(weight, bias)
        evaluating = not self.training and running_mean is not None
        # Asked only for batch statistics: evaluation with running statistics never asks
        # autograd (its private API untouched).
        recomputing = not evaluating and recompute.inside_backward()
        synced = not evaluating and self._synced(slot)
        running = (self._running(running_mean, running_var, batches)
                   if self.training and not recomputing else None)
        count = None
        if not evaluating and not synced:  # this replica's batch alone
            count = self._training_count(x)
            if running is not None and slot is not None and slot.group.size > 1:
                self._checked_by_every_replica(slot, x, count)
        if (COMPILE_AS_FORMULA and compiling and count != 0
                and not (synced and slot is not None)):  # merged across processes, if synced
            track = None if evaluating else functools.partial(track_batch, running)
            return self._formula(x, weight, bias, track, merged=synced, compiled=True)
        if not compiling:  # Dynamo's tensors are never such wrappers
            x = compat.unwrap_if_dead(x)
        plan = inplace_policy.plan_call(self._config, x, self._warned_out_of_place,
                                        self._channels_aside, weight, bias, count=count,
                                        recomputing=recomputing,
                                        running=self._running_of(running_var))
        if count == 0:
            track_batch(running, None, None, 0)
            # Empty, and attached to the parameters (zero gradients) as nn.BatchNorm's result.
            return torch.nn.functional.batch_norm(x, None, None, weight, bias, True, 0.0, self.eps)
        if evaluating:
            # The backend derives invstd in the same pass, and keeps copies of the statistics
            # for the backward: a training forward, load_state_dict or a buffer broadcast may
            # change the buffers before it.
            out = normalize_running(x, running_mean, running_var, self.eps, weight, bias,
                                    plan.config, plan.kept)
        elif synced:
            # The master folds the merged statistics into the running ones; each replica
            # remembers the call for a checkpoint's recomputation, which meets no replica.
            exchange = (functools.partial(self._recompute_cache.replay, layer=self._label())
                        if recomputing else
                        Exchange(slot, self.eps, self.process_group, self._syncs_processes(),
                                 running, self._label()))
            out = synced_batch_norm_act(x, weight, bias, plan.config, exchange, plan.kept)
            if not recomputing:
                self._recompute_cache.remember(exchange.own, exchange.mean, exchange.invstd,
                                               exchange.total, exchange.offset, out.grad_fn)
        else:
            out = batch_norm_act(x, weight, bias, self.eps, plan.config, running,
                                 self._channels_aside, recomputing, count, plan.check)
        if not (synced or recomputing or compiling or slot is not None or self._group_open()
                or (count is not None
                    and computes_in(x.dtype, count, x.device) != torch_ops.stats_dtype(x.dtype))):
            self.__dict__["_call_memo"] = CallMemo(
                x.shape, x.dtype, x.device, evaluating, count,
                inplace_policy.in_place_by_key(self._config, x.dtype, count),
                self._plain_state(), get_backend(),
                None if evaluating or compat.dispatch_modes() else key_ops(ops_for(x)))
        # ``out is x``: written in place (not a fallback out of place).
        if out is x and inplace_policy.checking():
            return inplace_policy.after_write(x, out, self._label())
        return out

    def _repeat_call(self, x: torch.Tensor, memo: CallMemo) -> torch.Tensor:
        """A call of the key of the last unsynchronised call, which ``memo`` holds the checks
        and decisions of (``call_memo``): what may differ between calls of one key is done
        again (the parameters and running statistics read, whether this tensor may be
        overwritten, the channels kept aside), then the call runs as ``_forward`` runs it.
        Where the running statistics came or went (``functional_call`` swaps them) or the
        processes now synchronise: ``_forward``, from the start."""
        try:
            if memo.plain_state:  # as ``_state`` reads them, without a call of its own
                weight, bias = _PARAMETERS_OF(self._parameters)
                running_mean, running_var, batches = _RUNNING_OF(self._buffers)
            else:
                weight, bias, running_mean, running_var, batches = self._state(False)
        except KeyError:  # a tensor taken out of its dict behind the layer's back
            return self._forward(x, None)
        evaluating = not self.training and running_mean is not None
        if evaluating is not memo.evaluating or (not evaluating and self.sync
                                                 and self._syncs_processes()):
            return self._forward(x, None)
        x = compat.unwrap_if_dead(x)
        self._check_state(x, (weight, bias, running_mean, running_var, batches))
        weight, bias = self._affine_params(weight, bias, x)
        if x.is_inference():
            self._check_recordable(weight, bias)
        config, kept, check = self._config, None, None
        if config.inplace:
            config, kept, check = inplace_policy.plan_overwrite(
                config, x, self._warned_out_of_place, self._channels_aside, weight, bias,
                memo.in_place, not evaluating, False, self._running_of(running_var))
        if evaluating:
            return normalize_running(x, running_mean, running_var, self.eps, weight, bias,
                                     config, kept)
        # The key computes in x's own statistics dtype (or keeps no memo): x as it is.
        ops = memo.key_ops
        if ops is None or get_backend() != memo.backend or compat.dispatch_modes():
            ops = ops_for(x)
        return widened_batch_norm_act(x, x, ops, weight, bias, self.eps, config,
                                      self._running(running_mean, running_var, batches),
                                      self._channels_aside, False, memo.count, check)

    def _state(self, plain: bool) -> tuple[torch.Tensor | None, ...]:
        """The layer's weight, bias, running mean, running variance and batch count, each read
        once (a parametrization computes its tensor at each read). ``plain``
        (``CallMemo.plain_state``): straight from ``_parameters`` and ``_buffers``, without
        nn.Module's ``__getattr__``, which raises and catches an AttributeError at each read;
        a KeyError where one is no longer there."""
        if plain:
            return (*_PARAMETERS_OF(self._parameters), *_RUNNING_OF(self._buffers))
        return (self.weight, self.bias, self.running_mean, self.running_var,
                getattr(self, "num_batches_tracked", None))  # a count is optional

    def _plain_state(self) -> bool:
        """Whether each of the tensors ``_state`` reads is its entry in ``_parameters`` (weight,
        bias) or ``_buffers`` (the running statistics) as nn.Module's ``__getattr__`` finds
        it: no class attribute (a parametrization's property) and no instance attribute (a
        pruning's weight) stands for it. Only an assignment or a deletion, which drop the
        memo, changes that (a parametrization assigns the layer's class)."""
        cls, attributes, params = type(self), self.__dict__, self._parameters
        return (all(name not in attributes and not hasattr(cls, name)
                    for name in (*_PARAMETERS, *_RUNNING))
                and all(name in params for name in _PARAMETERS)
                and all(name in self._buffers and name not in params for name in _RUNNING))

    def _group_open(self) -> bool:
        """Whether ``replicate()`` made a group of this layer's replicas that is still alive."""
        return self._open_group is not None and self._open_group() is not None

    def _synced(self, slot: ReplicaSlot | None) -> bool:
        """Whether this call takes its batch statistics over several replicas or processes."""
        return self.sync and ((slot is not None and slot.synced) or self._syncs_processes())

    def _check_state(self, x: torch.Tensor, state: tuple[torch.Tensor | None, ...]) -> None:
        """The layer's tensors (``state``, as ``_state`` reads them) on x's device, the
        per-channel ones (all but the batch count) of shape ``(C,)``; else refused before
        anything is read or written: the Triton kernels' repeat launches take each tensor's
        address as it is, with no check of their own of where it points or how far it
        reaches (``TrainingStep``)."""
        device, channels = x.device, (self.num_features,)
        weight, bias, running_mean, running_var, batches = state
        for tensor in (weight, bias, running_mean, running_var):
            if tensor is not None and (tensor.device != device or tensor.shape != channels):
                raise self._state_error(x, state)
        if batches is not None and batches.device != device:
            raise self._state_error(x, state)

    def _check_recordable(self, weight: torch.Tensor | None, bias: torch.Tensor | None
                          ) -> None:
        """An inference tensor as input (made under ``torch.inference_mode``), in a call
        autograd records (grad mode, a parameter that requires grad): autograd cannot save it
        for backward and refuses it once the running statistics are updated; refused first."""
        if torch.is_grad_enabled() and any(p is not None and p.requires_grad
                                           for p in (weight, bias)):
            raise RuntimeError(
                f"{self._label()}: expected an input autograd can save for backward, got an "
                "inference tensor (made under torch.inference_mode) while the layer's "
                "parameters require grad; call the layer under torch.inference_mode() or "
                "torch.no_grad(), or pass a clone made outside it (x.clone())")

    def _state_error(self, x: torch.Tensor, state: tuple[torch.Tensor | None, ...]
                     ) -> Exception:
        named = {name: tensor for name, tensor in zip((*_PARAMETERS, *_RUNNING), state)
                 if tensor is not None}
        for name, tensor in named.items():
            if name != "num_batches_tracked" and tensor.shape != (self.num_features,):
                return ValueError(
                    f"{self._label()}: expected {name} of shape ({self.num_features},), one "
                    f"value per channel, got shape {tuple(tensor.shape)}")
        devices = {name: tensor.device for name, tensor in named.items()}
        if len(set(devices.values())) == 1:
            (device,) = set(devices.values())
            return RuntimeError(
                f"{self._label()}: expected input on device {device} like the layer's "
                f"parameters and running statistics, got input on device {x.device}; move the "
                "input or the layer (layer.to(device))")
        elsewhere = ", ".join(f"{name} on {device}" for name, device in devices.items()
                              if device != x.device)
        return RuntimeError(
            f"{self._label()}: expected the layer's parameters and running statistics on the "
            f"input's device {x.device}, got {elsewhere}; move the layer "
            f"(layer.to({str(x.device)!r}))")

    @staticmethod
    def _checked_by_every_replica(slot: ReplicaSlot, x: torch.Tensor, count: int) -> None:
        """Unsynchronised (``sync=False``) training under DataParallel: replica 0 updates the
        running statistics (the original layer's buffers), yet each replica checks only its
        own input. Each call, the other replicas report that their input passed the checks
        (without waiting), and replica 0 waits for those reports before its update wherever
        a peer's input could fail them: where its own has one value per sample and channel
        (a peer's chunk, of the same sample shape, may then hold one value per channel)."""
        group = slot.group
        call = group.begin_call(slot.rank)
        if slot.rank:
            group.checks_passed(slot.rank)
        elif count == x.shape[0]:
            group.wait_for_checks(call)

    def _training_count(self, x: torch.Tensor) -> int:
        """Values per channel of a training input, refusing one (no variance to take)."""
        count = x.numel() // self.num_features
        if count == 1:
            raise ValueError(
                f"{self._label()}: expected more than 1 value per channel when training, got "
                f"input of shape {tuple(x.shape)}"
            )
        return count

    def _running(self, mean: torch.Tensor | None, var: torch.Tensor | None,
                 batches: torch.Tensor | None) -> RunningStats | None:
        """The running statistics a training call updates (None: not tracked), from the
        layer's buffers as the caller read them (``_state``)."""
        if not self.track_running_stats or mean is None:
            return None
        momentum = self.momentum
        if momentum is None and batches is None:  # a cumulative average with no count:
            momentum = 0.0  # nn.BatchNorm's factor, the statistics kept as they are
        return RunningStats(mean, var, batches, momentum)

    def _running_of(self, var: torch.Tensor | None) -> inplace_policy.Running | None:
        """The running variance ``var`` and eps, for the spread ``inplace_policy`` reads of
        them (None: no running statistics)."""
        return None if var is None else (var, self.eps)

    @property
    def last_input_dim(self) -> int | None:
        """The number of dimensions of the last input seen (None before any forward outside
        ``torch.compile``, which records nothing: a compiled ``torch.utils.checkpoint`` region
        refuses Python side effects, and a guard on the value would recompile)."""
        return self._last_input_dim[0] if self._last_input_dim else None

    def extra_repr(self) -> str:
        text = super().extra_repr() + f", activation={self.activation!r}"
        if activations.ACTIVATIONS[self.activation].has_param:
            text += f", slope={self.slope}"
        text += f", inplace={self.inplace}"
        if not self.sync:
            text += ", sync=False"
        return text


def _on_meta(weight: torch.Tensor | None, bias: torch.Tensor | None) -> bool:
    """Whether the layer's parameters live on the meta device (shapes, no values)."""
    return any(p.is_meta for p in (weight, bias) if p is not None)


def record_paths(root: torch.nn.Module) -> None:
    """Let every ``SyncBatchNorm`` under ``root`` name itself in errors by its path there
    (``"layer1.0.bn2"``; a module shared under several names takes the first). The
    converters call it on the model they return."""
    for path, module in root.named_modules():
        if isinstance(module, SyncBatchNorm) and path:
            module._set_path(path)


def _real_number(value: Any) -> bool:
    """Whether ``value`` is a real number of any type (Python's, numpy's scalars: what
    nn.BatchNorm2d computes with), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _statistics_option(layer: str, name: str, value: Any) -> float | None:
    """``eps`` or ``momentum`` as the layer keeps it: a Python float (None: a cumulative
    average's momentum). Refuses, naming ``layer``, an ``eps`` that is not a positive number
    (eps = 0 divides by zero on a constant channel: NaN outputs and gradients), or a
    ``momentum`` that is neither None nor a number in [0, 1] (the running statistics' update
    factor)."""
    number = _real_number(value)
    if name == "eps" and not (number and value > 0):
        raise ValueError(f"{layer}: eps must be a positive number, got {value!r}")
    if name == "momentum" and value is not None and not (number and 0 <= value <= 1):
        raise ValueError(
            f"{layer}: momentum must be None (cumulative average) or a number in [0, 1] (the "
            f"running statistics' update factor), got {value!r}"
        )
    return None if value is None else float(value)


def checked_slope(layer: str, value: Any) -> float:
    """``slope`` (or mapillary's ``activation_param``) as a Python float; anything but a real
    number refused, naming ``layer``."""
    if not _real_number(value):
        raise ValueError(
            f"{layer}: slope must be a real number (leaky_relu's negative slope, elu's "
            f"alpha), got {value!r}"
        )
    return float(value)


def _check_process_group(process_group: Any) -> None:
    """Refuse a device (or a bool) passed as ``process_group``: nn.BatchNorm2d's 6th positional
    argument is ``device``, and a device there would otherwise be taken for a group (and
    ignored until ``torch.distributed`` is initialised). Anything else is left to
    ``torch.distributed`` (wrapped or test groups need not subclass ProcessGroup)."""
    if isinstance(process_group, (torch.device, bool)) or (
        isinstance(process_group, int) and process_group != _NON_GROUP_MEMBER
    ) or (isinstance(process_group, str) and _names_a_device(process_group)):
        raise TypeError(
            f"SyncBatchNorm: process_group must be a torch.distributed process group or None, "
            f"got {type(process_group).__name__} {process_group!r}; the 6th positional "
            "argument is process_group (nn.BatchNorm2d's is device): pass device= by keyword"
        )


def _names_a_device(text: str) -> bool:
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        return False
    return True


# What dist.new_group hands a rank outside the group (an int in torch 2.x).
_NON_GROUP_MEMBER = (
    torch.distributed.GroupMember.NON_GROUP_MEMBER if torch.distributed.is_available() else None
)
