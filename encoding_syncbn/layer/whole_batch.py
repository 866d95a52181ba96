"""The input gradients of a synchronised float64 call over few values a channel, taken at once
for the whole batch in double-double (``double_double``): every replica of the call in this
process, a nested DataParallel call's included, and every process's under torch.distributed.

Why. Below ``MIN_FLOAT64_REBUILT_COUNT`` values a channel
(``inplace_policy.takes_double_double_gradient``) a replica's input gradient is a difference of
terms larger than itself (``double_double``), and the terms come from the whole batch: its
mean and invstd, ``sum(dz)`` and ``sum(dz * xhat)``. The merges' own backward passes them on
as float64 gradients of the merged statistics, rounded before the difference is taken; only
the whole batch's inputs and output gradients, joined, give them in double-double. So few
values make joining them cheap.

How. A call's replicas share one ``WholeBatch`` through their links (``functional._Link``),
made by the master of the outermost call (``exchange.Exchange``). Autograd runs every
replica's ``NormAct`` before any merge (each reads the merged statistics), so when the first
merge's backward asks (``grads``), every link holds its replica's input and dy: that merge
computes every replica's gradient of the process, under a lock (autograd runs each device's
nodes on a thread of its own), and each merge returns its own replicas'. Across processes the
cross-process merge's backward, which autograd runs before any merge of its process, gathers
every rank's inputs and dy instead (``sync.distributed``) and hands this process its part
(``take``).

Under create_graph the merge keeps autograd's gradient for its graph and takes its value from
here (``functional._exactly``). In a backward after one (with create_graph or not), a gradient
penalty's gradients reach the merged statistics through its graph as well as the replicas'
NormActs: ``functional._ReadInGraph`` records them in the links, and the gradient is the
NormActs' part from the inputs and dy, plus the penalty's through the statistics
(``_through_statistics``, float64). Nested calls' merges (``functional.MergeParts``) record
likewise what the penalty brings their parts' statistics (``functional.Part``), and each merge
adds its replicas' share of that (``Part.input_grad``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from ..kernels import double_double
from ..sync import stats
from ..sync.streams import wait_for
from . import inplace_policy

# A replica's ``functional._Link`` (functional imports this module).
_Link = Any


class WholeBatch:
    """The links of every replica of one synchronised call in this process."""

    __slots__ = ("links", "eps", "device", "across_processes", "_lock")

    def __init__(self, links: Sequence[_Link], eps: float, device: torch.device,
                 across_processes: bool) -> None:
        self.links = list(links)
        self.eps = eps
        self.device = device  # the master's: where the replicas' values are joined
        self.across_processes = across_processes
        self._lock = threading.Lock()
        for link in self.links:
            link.batch = self

    @classmethod
    def of(cls, links: Sequence[_Link], count: int, eps: float, device: torch.device,
           across_processes: bool) -> WholeBatch | None:
        """The batch of ``links``, over ``count`` values a channel in this process, or None
        where its input gradients never come here: not float64, or already
        ``MIN_FLOAT64_REBUILT_COUNT`` values (the global count, known after the merge, is at
        least this one)."""
        if not inplace_policy.takes_double_double_gradient(links[0].dtype, count,
                                                           inplace=False):
            return None
        return cls(links, eps, device, across_processes)

    def wanted(self, total: int) -> bool:
        """Whether a call over ``total`` values a channel in every process takes its input
        gradients here: the same answer in every process (the input dtype and the global
        count; below that count a float64 call is always out of place,
        ``inplace_policy.for_count``)."""
        return inplace_policy.takes_double_double_gradient(self.links[0].dtype, total,
                                                           inplace=False)

    def _filled(self, create_graph: bool) -> bool:
        """Whether every replica left its input and dy (under create_graph, the value of its
        NormAct's gradient too, ``_Link.direct_grad``)."""
        total = self.links[0].total
        return all(
            link.saved is not None and link.grad_output is not None and link.total == total
            and (link.direct_grad is not None or not create_graph)
            and inplace_policy.takes_double_double_gradient(link.saved.tensor.dtype, total,
                                                            link.config.inplace)
            for link in self.links)

    def rows(self, create_graph: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This process's inputs and output gradients, each (C, its values a channel) on
        ``device``; None where not every replica left them (``_filled``)."""
        if not self._filled(create_graph):
            return None
        for link in self.links:
            # The replica's NormAct.backward ran on its forward's stream (see
            # MergeReplicas.backward).
            wait_for(link.ready, (link.saved.tensor, link.grad_output))
        return tuple(  # type: ignore[return-value]
            torch.cat([double_double.channel_rows(t.to(self.device)) for t in parts], 1)
            for parts in ([link.saved.tensor for link in self.links],
                          [link.grad_output for link in self.links]))

    def take(self, x_rows: torch.Tensor, dy_rows: torch.Tensor, start: int) -> None:
        """Compute the input gradient of the batch whose inputs and dy are ``x_rows`` and
        ``dy_rows`` (C, values a channel: every process's), and give each replica of this
        process its part, from column ``start`` on in the replicas' order."""
        first = self.links[0]
        weight, bias = (p.to(self.device) for p in (first.saved.weight, first.saved.bias))
        grad = double_double.batch_backward(
            x_rows.unsqueeze(0), dy_rows.unsqueeze(0), weight, bias, self.eps,
            first.config.activation, first.config.activation_param)[0][0]
        read = self._read_grads()
        if read is not None:
            grad += self._through_statistics(x_rows, *read)
        for link in self.links:
            x = link.saved.tensor
            count = x.numel() // x.shape[1]
            part = torch.empty_like(x)
            part.transpose(0, 1).copy_(
                grad[:, start:start + count].reshape(part.transpose(0, 1).shape))
            link.exact_grad = part
            start += count

    def _read_grads(self) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """The gradients of the merged ``(mean, invstd)`` this backward brought through an
        earlier create_graph backward's graph (``functional._ReadInGraph``), summed over the
        replicas on ``device``; None: none."""
        read = [link.read_grads for link in self.links if link.read_grads is not None]
        if not read:
            return None
        return tuple(  # type: ignore[return-value]
            None if all(r[i] is None for r in read)
            else torch.stack([r[i].to(self.device) for r in read if r[i] is not None]).sum(0)
            for i in range(2))

    def _through_statistics(self, x_rows: torch.Tensor, grad_mean: torch.Tensor | None,
                            grad_invstd: torch.Tensor | None) -> torch.Tensor:
        """The input gradient, on (C, values) rows, of the gradients ``(grad_mean,
        grad_invstd)`` of the statistics every replica normalised with (n values a channel,
        M2 their centred sum of squares)::

            dx = g_mean / n + 2 g_M2 (x - mean),   g_M2 = -g_invstd invstd^3 / (2 n)
        """
        saved, total = self.links[0].saved, self.links[0].total
        mean, invstd = (t.to(self.device).view(-1, 1) for t in (saved.mean, saved.invstd))
        grad = torch.zeros_like(x_rows)
        if grad_mean is not None:
            grad += grad_mean.view(-1, 1) / total
        if grad_invstd is not None:
            grad_m2 = stats.total_grad_m2(None, grad_invstd.view(-1, 1), invstd, total)
            grad += 2 * grad_m2 * (x_rows - mean)
        return grad

    def grads(self, links: Sequence[_Link], create_graph: bool = False
              ) -> list[torch.Tensor] | None:
        """The input gradients of ``links`` (one merge's replicas), in double-double, computed
        for the whole process by the first merge to ask; None: not taken here (the merge
        computes them in float64)."""
        with self._lock, torch.no_grad():  # under create_graph: the value alone
            if (not self.across_processes
                    and any(link.exact_grad is None for link in links)):
                rows = self.rows(create_graph)
                if rows is not None:
                    self.take(*rows, 0)
            found = [link.exact_grad for link in links]
            if any(grad is None for grad in found):
                return None
            # The parts' reads are complete here, not in the first merge to ask: autograd
            # runs every ``_ReadParts`` node reading a part's statistics before the merge
            # they came from, not before another part's.
            for i, link in enumerate(links):
                for part in link.parts:
                    share = part.input_grad(link.saved.tensor)
                    if share is not None:
                        found[i] = found[i] + share
        return found  # type: ignore[return-value]
