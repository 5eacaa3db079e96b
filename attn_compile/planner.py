"""From the DTensor placements of q, k and v to a plan: which attention runs on the local shards.

Each mesh dim is read on its own:
- all three ``Replicate``: nothing to do on that dim;
- all three ``Shard(0)`` (batch) or ``Shard(1)`` (heads): every rank attends its own part;
- q ``Shard(1)`` with k, v ``Replicate`` (GQA tensor parallel, h_kv < mesh size): every rank takes
  the KV heads its query heads use; on one mesh dim, and no other dim may split the heads of all three;
- all three ``Shard(2)`` (sequence): context parallelism over that dim; two such dims: hybrid;
- q ``Shard(2)`` with k, v ``Replicate``: the local queries attend to all keys at their global offset;
  on one mesh dim, and none with context parallelism.
Shards must be even. Anything else raises a ValueError that names every placement and says how
to fix it. The cost model sees the batch and heads of one context-parallel rank. The plan
depends only on global shapes, placements and options, so every rank makes the same one.
"""
import dataclasses
import math
from types import SimpleNamespace
from typing import Optional

from torch.distributed.tensor import Replicate, Shard

from . import cost_model

BATCH, HEADS, SEQ = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Plan:
    cp_dims: tuple = ()  # mesh dims the sequence is sharded over (context parallelism)
    strategy: Optional[str] = None  # for cp_dims
    q_seq_dim: Optional[int] = None  # mesh dim of a q-only sequence split (k, v replicated)
    kv_head_dim: Optional[int] = None  # mesh dim of a q-only head split (GQA tensor parallel)
    table: dict = dataclasses.field(default_factory=dict)  # cost-model estimate or reason, per strategy
    forward_only: bool = False  # no gradient flows to q, k, v: the strategy is the fastest forward

    def describe(self) -> str:
        if self.cp_dims:
            chosen = f" ({cost_model.FORWARD_ALONE})" if self.forward_only else ""
            return f"context parallel over mesh dim(s) {list(self.cp_dims)}: {self.strategy}{chosen}"
        if self.q_seq_dim is not None:
            return f"local: q sequence shard against all keys (mesh dim {self.q_seq_dim})"
        if self.kv_head_dim is not None:
            return f"local: q head shard against its KV heads (mesh dim {self.kv_head_dim})"
        return "local: no communication"


def _name(placements) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ("," if len(placements) == 1 else "") + ")"


def _mesh_name(mesh) -> str:
    names = mesh.mesh_dim_names
    label = ", ".join(names) if names else "unnamed"
    return f"mesh '{label}' (size {'x'.join(str(s) for s in mesh.shape)})"


def _placements(q, k, v, mesh) -> str:
    return f"q={_name(q.placements)}, k={_name(k.placements)}, v={_name(v.placements)} on {_mesh_name(mesh)}"


def _kind(p) -> str:
    if isinstance(p, Replicate):
        return "replicate"
    # exactly Shard: older torch derives _StridedShard (shards in a non-default order) from it
    if type(p) is Shard and p.dim in (BATCH, HEADS, SEQ):
        return ("batch", "heads", "seq")[p.dim]
    return "other"


def plan(q, k, v, *, is_causal: bool, window=(-1, -1), strategy: str = "auto",
         hardware: cost_model.Hardware = cost_model.Hardware()) -> Plan:
    """q, k, v: DTensors (or fake DTensors from a trace) on one mesh."""
    mesh = q.device_mesh
    if k.device_mesh != mesh or v.device_mesh != mesh:
        raise ValueError(f"q, k, v must be on one device mesh; got q on {_mesh_name(mesh)}, k on "
                         f"{_mesh_name(k.device_mesh)}, v on {_mesh_name(v.device_mesh)}")
    cp_dims, head_dims, batch_dims, fields = [], [], [], {}
    for dim in range(mesh.ndim):
        kinds = tuple(_kind(t.placements[dim]) for t in (q, k, v))
        if "other" in kinds:
            raise ValueError(f"q, k, v placements must be Replicate or Shard on the batch (0), head (1) or sequence "
                             f"(2) dim; got {_placements(q, k, v, mesh)}")
        if kinds[1] != kinds[2]:
            raise ValueError(f"k and v must have the same placements; got {_placements(q, k, v, mesh)}. Redistribute "
                             f"v to {_name([k.placements[dim]])} on mesh dim {dim}, or k to "
                             f"{_name([v.placements[dim]])}.")
        if kinds == ("heads",) * 3:
            head_dims.append(dim)
        elif kinds == ("batch",) * 3:
            batch_dims.append(dim)
        elif kinds == ("replicate",) * 3:
            continue
        elif kinds == ("seq",) * 3:
            cp_dims.append(dim)
        elif kinds == ("seq", "replicate", "replicate"):
            _set_q_only_split(fields, "q_seq_dim", dim, q, k, v, mesh)
        elif kinds == ("heads", "replicate", "replicate"):
            _set_q_only_split(fields, "kv_head_dim", dim, q, k, v, mesh)
        else:
            raise ValueError(f"q, k, v must be sharded the same way on each mesh dim, except that q alone may split "
                             f"the sequence or the heads against replicated k and v; got {_placements(q, k, v, mesh)}. "
                             f"Redistribute q to {_name([k.placements[dim]])} on mesh dim {dim}, or k and v to "
                             f"{_name([q.placements[dim]])}.")
    if len(cp_dims) > 2 or (cp_dims and fields.get("q_seq_dim") is not None):
        raise ValueError(f"the sequence may be sharded over at most two mesh dims, for q, k and v alike; got "
                         f"q={_name(q.placements)}, k={_name(k.placements)}, v={_name(v.placements)} on "
                         f"{_mesh_name(mesh)}")
    if head_dims and fields.get("kv_head_dim") is not None:
        raise ValueError(f"q's heads may be split against replicated k, v (GQA tensor parallel) only where no other "
                         f"mesh dim splits the heads of q, k and v; got q={_name(q.placements)}, "
                         f"k={_name(k.placements)}, v={_name(v.placements)} on {_mesh_name(mesh)}. Redistribute k "
                         f"and v to Shard(dim=1) on mesh dim {fields['kv_head_dim']} too, or q to Replicate() there.")
    batch_ranks, head_ranks = _shards(mesh, batch_dims), _shards(mesh, head_dims)
    _check_divisible(q, k, mesh, cp_dims, fields, batch_ranks, head_ranks)
    if not cp_dims:
        return Plan(**fields)
    mesh_shape = tuple(mesh.shape[d] for d in cp_dims)
    problem = cost_model.Problem.of_shards(*_cp_group_shapes(q, k, v, mesh, batch_ranks, head_ranks, fields),
                                           s_local=q.shape[SEQ] // math.prod(mesh_shape), is_causal=is_causal,
                                           window=window, mesh_shape=mesh_shape,
                                           backward=any(x.requires_grad for x in (q, k, v)))
    best, table = cost_model.choose(problem, hardware, strategy)
    return Plan(cp_dims=tuple(cp_dims), strategy=best, table=table,
                forward_only=cost_model.chooses_forward_alone(problem, strategy), **fields)


def _set_q_only_split(fields: dict, field: str, dim: int, q, k, v, mesh) -> None:
    """A split of q alone (k, v replicated) is planned on one mesh dim: its local offset (sequence) or
    KV head slice (heads) is read from that dim's rank."""
    if field in fields:
        what, placement = ("sequence", "Shard(dim=2)") if field == "q_seq_dim" else ("heads", "Shard(dim=1)")
        raise ValueError(f"q's {what} may be split against replicated k, v over one mesh dim only; got it split over "
                         f"mesh dims {fields[field]} and {dim}: q={_name(q.placements)}, k={_name(k.placements)}, "
                         f"v={_name(v.placements)} on {_mesh_name(mesh)}. Redistribute q to Replicate() on one of "
                         f"them, or k and v to {placement} on both.")
    fields[field] = dim


def _shards(mesh, dims) -> int:
    """How many parts the mesh dims ``dims`` cut a tensor dim into."""
    return math.prod(mesh.shape[d] for d in dims)


def _check_divisible(q, k, mesh, cp_dims, fields, batch_ranks, head_ranks) -> None:
    """Even shards only: uneven ones differ in shape from rank to rank, and uneven head shards
    would pair query heads with the wrong KV heads."""
    seq_ranks = _shards(mesh, cp_dims)
    if fields.get("q_seq_dim") is not None:
        seq_ranks *= mesh.shape[fields["q_seq_dim"]]
    if q.shape[SEQ] % seq_ranks:
        raise ValueError(f"the sequence length {q.shape[SEQ]} must be a multiple of {seq_ranks}, the number of "
                         f"sequence shards on {_mesh_name(mesh)}")
    if fields.get("kv_head_dim") is not None:
        ranks, group = mesh.shape[fields["kv_head_dim"]], q.shape[HEADS] // k.shape[HEADS]
        local = q.shape[HEADS] // ranks
        if q.shape[HEADS] % ranks or (local % group and group % local):
            raise ValueError(f"q's {q.shape[HEADS]} heads split over {ranks} ranks must give each rank whole "
                             f"groups of the {k.shape[HEADS]} KV heads, or a part of one group; got {local} query "
                             f"heads per rank with {group} query heads per KV head")
    if q.shape[BATCH] % batch_ranks:
        raise ValueError(f"the batch size {q.shape[BATCH]} must be a multiple of {batch_ranks}, the number of batch "
                         f"shards on {_mesh_name(mesh)}")
    if q.shape[HEADS] % head_ranks or k.shape[HEADS] % head_ranks:
        raise ValueError(f"q's {q.shape[HEADS]} heads and k's and v's {k.shape[HEADS]} must each be a multiple of "
                         f"{head_ranks}, the number of head shards on {_mesh_name(mesh)}, so that every rank holds "
                         f"the KV heads of its query heads")


def _cp_group_shapes(q, k, v, mesh, batch_ranks, head_ranks, fields):
    """q, k, v as the context-parallel ranks see them (stand-ins with a shape and a dtype): batch and
    heads cut by the other mesh dims that split them, which the strategies' costs and rules are about."""
    batch = q.shape[BATCH] // batch_ranks
    h_q, h_kv = q.shape[HEADS] // head_ranks, k.shape[HEADS] // head_ranks
    if fields.get("kv_head_dim") is not None:
        ranks = mesh.shape[fields["kv_head_dim"]]
        h_q, h_kv = h_q // ranks, kv_head_slice(h_q, h_kv, ranks, 0)[1]
    return tuple(SimpleNamespace(shape=(batch, h, *t.shape[SEQ:]), dtype=t.dtype)
                 for t, h in ((q, h_q), (k, h_kv), (v, h_kv)))


def kv_head_slice(h_q: int, h_kv: int, ranks: int, rank: int) -> tuple[int, int]:
    """(first, count) of the KV heads used by query heads [rank·h_q/ranks, (rank+1)·h_q/ranks)."""
    local, group = h_q // ranks, h_q // h_kv
    first = rank * local // group
    return first, max(local // group, 1)

