"""This process's place in a tensor-parallel group, and the collectives the model and the
scheduler run over it.

One process per rank (tensor parallelism over the GPUs of one host, as SGLang's --tp-size). The
model's layers split their heads and columns across ranks (layers/linear.py) and join them with
these collectives; with one rank every call here is a no-op, so single-GPU code pays nothing.

Three process groups over the same ranks:
- `device`: the model's all-reduces and all-gathers (NCCL on a GPU, gloo on a CPU);
- `graph`: the same, for the work of CUDA graphs (their warm-up runs and their captures: the graph
  runner enters `graph_collectives`). A mixed step replays its graph parts on a side stream beside
  the eager prompt chunk (model_executor/model_runner.py), so the two sides' collectives run at
  once; on one NCCL communicator from two streams they could deadlock, on two they cannot;
- `cpu` (gloo): small Python objects between the schedulers (memory plans, integrity digests,
  server info), never in a forward pass.
A collective that never completes (a rank died, or the ranks diverged) is caught by the step
watchdog (managers/watchdog.py), and by the groups' own timeout, both --watchdog-timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# torch 2.13 renamed all_gather_into_tensor (the device machines run 2.11)
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    device_group: object = None
    graph_group: object = None
    cpu_group: object = None
    _in_graph: bool = False

    @property
    def is_leader(self) -> bool:
        """Rank 0 receives the requests, shares them and sends the outputs on."""
        return self.rank == 0

    def _group(self):
        return self.graph_group if self._in_graph and self.graph_group is not None else self.device_group

    @contextlib.contextmanager
    def graph_collectives(self):
        """The model's collectives inside go through the graph group (a CUDA graph's work)."""
        saved, self._in_graph = self._in_graph, True
        try:
            yield
        finally:
            self._in_graph = saved

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (a row-parallel layer's partial outputs)."""
        if self.size > 1:
            dist.all_reduce(x, group=self._group())
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' slices of the last dimension, joined in rank order (vocab-parallel logits)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        ALL_GATHER(out, x, group=self._group())
        return out.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def broadcast_from_leader(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor on every rank, in place (the sampled tokens: every rank must feed the
        same ones to its next step, whatever its own sampling drew)."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.device_group)
        return x

    def gather_objects(self, obj) -> list:
        """Every rank's picklable `obj`, in rank order, on every rank (cpu group)."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def min_over_ranks(self, *values: int) -> tuple[int, ...]:
        """Each value's minimum over the ranks (a memory plan every rank can hold)."""
        return tuple(min(column) for column in zip(*self.gather_objects(values)))


_TP = TensorParallel()


def get_tp() -> TensorParallel:
    """This process's tensor-parallel group (one rank of size 1 unless init_tensor_parallel ran)."""
    return _TP


@contextlib.contextmanager
def single_rank():
    """Build as one rank would, whatever this process's group (a model's full shapes)."""
    global _TP
    saved, _TP = _TP, TensorParallel()
    try:
        yield
    finally:
        _TP = saved


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device,
                         timeout_s: float) -> TensorParallel:
    """Join the group of `size` ranks at init_method (tcp://host:port) as `rank`; every rank calls
    it at start. Each group runs one collective here, so their communicators exist before any
    CUDA graph capture (a communicator cannot be created inside one)."""
    global _TP
    if size == 1:
        _TP = TensorParallel()
        return _TP
    backend = "nccl" if device.type == "cuda" else "gloo"
    # every NCCL connection made at init: none may be left to make inside a graph capture
    os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout, **kwargs)
    ranks = list(range(size))
    cpu_group = dist.new_group(ranks, backend="gloo", timeout=timeout)
    graph_group = dist.new_group(ranks, backend=backend, timeout=timeout) if device.type == "cuda" else None
    _TP = TensorParallel(rank, size, dist.group.WORLD, graph_group, cpu_group)
    probe = torch.ones(1, device=device)
    for group in filter(None, (_TP.device_group, graph_group)):
        dist.all_reduce(probe, group=group)
    dist.barrier(group=cpu_group)
    logger.info("tensor parallel rank %d of %d (%s) joined", rank, size, backend)
    return _TP


def destroy_tensor_parallel() -> None:
    global _TP
    if _TP.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _TP = TensorParallel()
