"""torch.library.opcheck on every attn_cp context-parallel op, forward and backward, in a gloo group."""
import itertools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import attn_compile.cp.api  # noqa: F401  (registers the attn_cp context-parallel ops)
from attn_compile import shard_varlen
import attn_compile.cp.sequence_checks  # noqa: F401  (registers attn_cp::check_one_sequence, ::check_no_padding)
from dist_harness import run_distributed

SCALE = 0.3


def _opcheck_all(rank, world):
    ops = torch.ops.attn_cp
    torch.manual_seed(0)  # the same inputs on every rank
    mesh = init_device_mesh("cpu", (1, 2))  # ring of one across the outer dim, Ulysses across the inner
    name = dist.group.WORLD.group_name
    hybrid_names = tuple(mesh.get_group(dim).group_name for dim in range(2))
    for is_causal, layout, memory in ((True, "zigzag", "BHSD"), (False, "contiguous", "BSHD")):
        # GQA + MLA: 4/2 heads, d_qk 24, d_v 16; BSHD memory as a model's .transpose(1, 2) hands it over
        q, k, v = (_in_memory(torch.randn(2, h, 8, d), memory).requires_grad_() for h, d in ((4, 24), (2, 24), (2, 16)))
        # Ulysses and hybrid hand their head shards to the backward, then k's head count
        for op, backward, names in ((ops.ulysses_attention, ops.ulysses_attention_backward, (name, world)),
                                    (ops.hybrid_attention, ops.hybrid_attention_backward, (*hybrid_names, world))):
            config = (*names, SCALE, is_causal, layout)
            torch.library.opcheck(op.default, (q, k, v, *config))
            out, lse, *heads = op(q, k, v, *config)
            torch.library.opcheck(backward.default, (torch.randn_like(out), *_detached(*heads), k.shape[1], *config))
        # ring and all-gather keep the K and V they received, or with recompute_kv receive them again
        for (op, backward), recompute_kv in itertools.product(
                ((ops.ring_attention, ops.ring_attention_backward),
                 (ops.allgather_attention, ops.allgather_attention_backward)), (False, True)):
            config = (name, SCALE, is_causal, layout)
            forward_args = (q, k, v, name, world, *config[1:], recompute_kv)
            torch.library.opcheck(op.default, forward_args)
            out, lse, k_kept, v_kept = op(*forward_args)
            kept = (None, None) if recompute_kv else (k_kept, v_kept)
            torch.library.opcheck(backward.default, (torch.randn_like(out), *_detached(q, k, v, out), lse, *kept,
                                                     *config))
    # packed documents (lengths 3, 1, 7, with a window): Ulysses and the hybrid keep their head
    # shards in buffers of a bound the shards' shape gives, and hand them to the backward
    cu_seqlens = torch.tensor([0, 3, 4, 11], dtype=torch.int32)
    q, k, v = (shard_varlen(torch.randn(11, h, d), cu_seqlens, mesh)[0].transpose(0, 1)[None].requires_grad_()
               for h, d in ((4, 24), (2, 24), (2, 16)))
    for op, backward, names in ((ops.ulysses_attention, ops.ulysses_attention_backward, (name, world)),
                                (ops.hybrid_attention, ops.hybrid_attention_backward, (*hybrid_names, world))):
        config = (*names, SCALE, True, "zigzag", 2, 0, cu_seqlens, 7)
        torch.library.opcheck(op.default, (q, k, v, *config))
        out, lse, *heads = op(q, k, v, *config)
        assert heads[0].shape[2] >= 11  # the whole batch's rows, and the bound's zeros after them
        torch.library.opcheck(backward.default, (torch.randn_like(out), *_detached(*heads), k.shape[1], *config))
    # packed documents on the ring (its kept halo) and the all-gather (which gathers again): the
    # shards' token-major memory, as varlen_attention hands them over, is the output's order
    for op, backward, recompute_kv in ((ops.ring_attention, ops.ring_attention_backward, False),
                                       (ops.allgather_attention, ops.allgather_attention_backward, True)):
        config = (name, SCALE, True, "zigzag", 2, 0, cu_seqlens, 7)
        forward_args = (q, k, v, name, world, *config[1:4], recompute_kv, *config[4:])
        torch.library.opcheck(op.default, forward_args)
        out, lse, k_kept, v_kept = op(*forward_args)
        assert out.transpose(1, 2).is_contiguous()
        kept = (None, None) if recompute_kv else (k_kept, v_kept)
        torch.library.opcheck(backward.default, (torch.randn_like(out), *_detached(q, k, v, out), lse, *kept,
                                                 *config))
    for layout in ("zigzag", "contiguous"):
        shard = [rank, 3 - rank] if layout == "zigzag" else [2 * rank, 2 * rank + 1]
        positions = torch.arange(16)[None].expand(2, -1) + torch.tensor([[0], [5]])
        for op, whole in ((ops.check_one_sequence, positions), (ops.check_no_padding, positions >= 0)):
            torch.library.opcheck(op.default, (whole.reshape(2, 4, 4)[:, shard].reshape(2, 8), [name], layout))


def _in_memory(x, memory):
    return x.transpose(1, 2).contiguous().transpose(1, 2) if memory == "BSHD" else x


def _detached(*tensors):
    return tuple(t.detach() for t in tensors)


def test_opcheck_every_op():
    run_distributed(_opcheck_all, 2)
