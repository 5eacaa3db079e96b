"""The context-parallel group and the collectives the strategies are built from.

A context-parallel group is a tuple of process groups: ``(group,)`` for a ProcessGroup or a
1-D DeviceMesh, ``(outer, inner)`` for a 2-D DeviceMesh. The context-parallel rank of a
2-D mesh is ``outer_rank * inner_size + inner_rank``, so the shards are numbered mesh-row
by mesh-row.
"""
import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group

from .failures import wait_collective
from .words import contiguous

# torch 2.13 renamed these; 2.11 has only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def process_groups(group) -> tuple:
    """``(group,)`` for a ProcessGroup or a 1-D DeviceMesh, ``(outer, inner)`` for a 2-D DeviceMesh."""
    if isinstance(group, DeviceMesh):
        if group.ndim > 2:
            raise ValueError(f"group must be a ProcessGroup or a 1-D or 2-D DeviceMesh; got a {group.ndim}-D "
                             "DeviceMesh")
        return tuple(group.get_group(dim) for dim in range(group.ndim))
    if isinstance(group, dist.ProcessGroup):
        return (group,)
    raise ValueError(f"group must be a ProcessGroup or a DeviceMesh; got {type(group).__name__}")


def resolve(names: list[str]) -> tuple:
    """The process groups the custom ops receive by name."""
    return tuple(_resolve_process_group(name) for name in names)


def sized_group(name: str, size: int):
    """The process group ``name``, checked to have ``size`` ranks. Ops whose output shapes depend
    on the group size take it as an argument, as torch's functional collectives do: a compiled
    graph must not depend on state it cannot see."""
    (group,) = resolve([name])
    if size != group.size():
        raise ValueError(f"group_size must be the size of group {name!r}, {group.size()}; got {size}")
    return group


@functools.lru_cache(maxsize=None)
def _host_group(group):
    if dist.get_backend(group) == "gloo":
        return group
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)


def host_groups(groups) -> tuple:
    """gloo groups over the same ranks (the groups themselves where they are gloo): small
    agreements between ranks run on the CPU there, without waiting for the GPU."""
    return tuple(_host_group(group) for group in groups)


def cp_size(groups) -> int:
    size = 1
    for group in groups:
        size *= group.size()
    return size


def cp_rank(groups) -> int:
    rank = 0
    for group in groups:
        rank = rank * group.size() + group.rank()
    return rank


def all_gather_stacked(x: torch.Tensor, groups) -> torch.Tensor:
    """x from every rank, stacked in context-parallel rank order: (cp, *x.shape)."""
    x = contiguous(x.unsqueeze(0))
    for group in reversed(groups):  # inner first, so the outer rank ends up the slower index
        gathered = x.new_empty((group.size() * x.shape[0], *x.shape[1:]))
        wait_collective(_all_gather(gathered, x, group=group, async_op=True), group)
        x = gathered
    return x


def reduce_scatter_stacked(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of x over the ranks, each rank keeping its row: x is (size, ...), the result (...)."""
    out = x.new_empty(x.shape[1:])
    wait_collective(_reduce_scatter(out, contiguous(x.flatten(0, 1)), group=group, async_op=True), group)
    return out


def all_to_all_stacked(x: torch.Tensor, group) -> torch.Tensor:
    """Row j of x (size, ...) goes to rank j; row j of the result came from rank j."""
    (out,) = received(all_to_all_posted([x], group), group)
    return out


def all_to_all_posted(sends, group) -> list:
    """``all_to_all_stacked`` of each tensor the iterable ``sends`` makes, posted as soon as it is
    made, so that the next one is made while it travels (NCCL's collectives run on their own
    stream): (output, work) pairs, for ``received``."""
    posted = []
    for x in sends:
        send = contiguous(x)
        out = torch.empty_like(send)
        posted.append((out, dist.all_to_all_single(out, send, group=group, async_op=True)))
    return posted


def received(posted, group):
    """The outputs of ``all_to_all_posted`` in turn, each once its transfer has landed: what the
    caller does with one runs while the later ones travel."""
    for out, work in posted:
        wait_collective(work, group)
        yield out


@functools.lru_cache(maxsize=None)
def transfer_group(group, device_type: str):
    """The group the ring's transfers of ``device_type`` tensors run on: for CUDA tensors on a
    group with an NCCL backend ("nccl", or "cpu:gloo,cuda:nccl" as ``init_process_group()``
    makes by default), a twin of ``group`` whose streams have high priority. A transfer posted
    beside an attention kernel then starts as soon as one of that kernel's blocks finishes; on a
    stream of normal priority it waited for the whole kernel, whose blocks were queued first (the
    ring's forward on 4 H200s, MLA at 64K tokens: 510 TFLOP/s per GPU, 636 with the twin;
    BENCHMARKS.md). The twin is one more NCCL communicator over the same ranks, made on their
    first transfer by those ranks alone. Otherwise the group is its own twin."""
    if device_type != "cuda" or "nccl" not in str(dist.get_backend(group)):
        return group
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    if _splits_from_world():
        # new_group would split the default group's communicator, a collective of every rank,
        # which ranks outside this group (other pipeline stages) may not join for a while
        return dist.split_group(parent_pg=group, split_ranks=[list(range(group.size()))],
                                pg_options=options, group_desc="attn_cp transfers")
    return dist.new_group(dist.get_process_group_ranks(group), backend="nccl", pg_options=options,
                          use_local_synchronization=True, group_desc="attn_cp transfers")


def _splits_from_world() -> bool:
    """Whether torch makes new NCCL groups by splitting the default group's communicator: where
    the default group has a device bound (``init_process_group(device_id=...)``)."""
    return getattr(dist.group.WORLD, "bound_device_id", None) is not None


def pass_round(tensors, group, tag: int, shift: int = 1, into=None):
    """Posts sends of ``tensors`` to the rank ``shift`` places on round the ring and receives of
    like tensors (or into the contiguous tensors ``into``, where the sizes differ) from the rank
    as far back, on ``transfer_group``. Returns (received, works); the received tensors are
    valid after ``wait(works, group)``."""
    size = group.size()
    if shift % size == 0:
        return tuple(tensors), []
    rank = group.rank()
    next_peer = dist.get_global_rank(group, (rank + shift) % size)
    prev_peer = dist.get_global_rank(group, (rank - shift) % size)
    tensors = [contiguous(t) for t in tensors]
    received = tuple(into) if into is not None else tuple(torch.empty_like(t) for t in tensors)
    twin = transfer_group(group, received[0].device.type) if received else group
    # an empty tensor is not sent: its receiver, which knows the sizes too, posts no receive
    ops = [dist.P2POp(dist.isend, t, next_peer, twin, tag) for t in tensors if t.numel()]
    ops += [dist.P2POp(dist.irecv, r, prev_peer, twin, tag) for r in received if r.numel()]
    return received, dist.batch_isend_irecv(ops) if ops else []
