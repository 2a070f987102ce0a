"""Calibration split over processes (``torchrun``, ``accelerate launch``): the same result as one process.

Under a process group of N ranks, each rank carries its own contiguous share of the calibration windows through the
layers (the attention and MoE forwards that move hidden states from layer to layer, the larger part of a layer's
calibration time), and the engine hands every component the same layer inputs a single process would see:

- ``gather_tokens(x)``: a layer's block inputs are all ranks' tokens, concatenated in rank order, which is the
  single process's order (the shares are contiguous), so any component that reads raw tokens decides alike;
- a statistic declares how it is reduced: ``ExpertStats`` holds sums (routed counts, gate sums, REAP numerators,
  output sums), so each rank gathers them on its slice of the tokens and ``all_reduce_sum`` adds them
  (float64 sums: the total differs from one process's only in the order of additions).

Only rank 0 writes files. Without a process group (the usual case) every function here is the identity.
"""
from __future__ import annotations

import os

import torch


def world() -> tuple[int, int]:
    """(rank, world size) of the process group, started from torchrun's environment on first use; (0, 1) alone."""
    import torch.distributed as dist

    if not dist.is_available():
        return 0, 1
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return 0, 1
        dist.init_process_group(backend="gloo")  # CPU tensors: the statistics are reduced on the CPU
    return dist.get_rank(), dist.get_world_size()


def is_writer() -> bool:
    """Whether this process writes files (rank 0, or the only process)."""
    return world()[0] == 0


def share(items: list) -> list:
    """This rank's contiguous share of ``items`` (the first ranks take one more when they do not divide evenly)."""
    rank, size = world()
    if size == 1:
        return items
    if len(items) < size:
        raise ValueError(f"{len(items)} calibration windows cannot be shared by {size} processes; give at least "
                         f"{size} (more tokens, or a shorter sequence length)")
    per, extra = divmod(len(items), size)
    start = rank * per + min(rank, extra)
    return items[start:start + per + (rank < extra)]


def share_windows(batches: list) -> list:
    """This rank's contiguous share of the calibration windows (the rows of the ``[B, S]`` batches), regrouped
    into batches of at most the first batch's size; batches that are not tensors are shared whole."""
    rank, size = world()
    if size == 1:
        return batches
    if not all(isinstance(b, torch.Tensor) for b in batches):
        return share(batches)
    most = max(1, len(batches[0]))
    out = []
    for row in share([b[j:j + 1] for b in batches for j in range(len(b))]):
        if out and out[-1][-1].shape == row.shape and len(out[-1]) < most:
            out[-1].append(row)
        else:
            out.append([row])
    return [torch.cat(group) for group in out]


def gather_tokens(x: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of ``x [T_r, H]`` concatenated in rank order (rows may differ in number between ranks)."""
    import torch.distributed as dist

    rank, size = world()
    if size == 1:
        return x
    if x.device.type != "cpu":  # gloo gathers CPU tensors: an accelerator's rows go through the host
        return gather_tokens(x.cpu()).to(x.device)
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(size)]
    dist.all_gather(counts, torch.tensor([x.shape[0]]))
    most = int(max(c.item() for c in counts))
    padded = torch.zeros(most, *x.shape[1:], dtype=x.dtype)
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([p[: int(c.item())] for p, c in zip(parts, counts)])


def my_rows(x: torch.Tensor) -> torch.Tensor:
    """This rank's contiguous slice of rows of ``x`` (the whole of it alone)."""
    rank, size = world()
    return x if size == 1 else x.tensor_split(size)[rank]


def my_rows_start(n: int) -> int:
    """Where this rank's slice (``my_rows``) starts among ``n`` rows (as ``tensor_split`` cuts them)."""
    rank, size = world()
    return rank * (n // size) + min(rank, n % size)


def all_reduce_sum(*tensors) -> None:
    """Sum each tensor over the ranks, in place (no-op alone or for None)."""
    import torch.distributed as dist

    if world()[1] == 1:
        return
    for t in tensors:
        if t is not None:
            host = t if t.device.type == "cpu" else t.cpu()  # gloo reduces CPU tensors
            dist.all_reduce(host, op=dist.ReduceOp.SUM)
            if host is not t:
                t.copy_(host)


def barrier() -> None:
    import torch.distributed as dist

    if world()[1] > 1:
        dist.barrier()
