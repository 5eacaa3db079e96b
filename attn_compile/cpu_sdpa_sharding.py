"""DTensor sharding rules for SDPA's CPU kernel, ``aten._scaled_dot_product_flash_attention_for_cpu``
and its backward, as PyTorch gives its CUDA kernels (torch/distributed/tensor/_ops/_matrix_ops.py):
everything replicated, or q, k, v, the output and the LSE all split by batch or all by heads.

Without a rule, dynamo's trace of a sequence split did not finish (DTensor propagated the sharding
through the kernel's math decomposition, matmul by matmul, round and round), and a causal one
stopped at the missing rule ("does not have a sharding strategy registered"). With the rules, SDPA on
DTensors on the CPU (d_qk == d_v, which that kernel takes) runs as on CUDA: a sequence split is
redistributed to one of these placements when called eagerly, and traces, so that the backend's
placements pass makes it context-parallel attention. The kernel takes its mask as a keyword
argument, which DTensor never redistributes: a DTensor mask must come replicated. Registered once,
on import, unless DTensor already has a rule for the kernel.
"""
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
from torch.distributed.tensor.experimental import register_sharding

_aten = torch.ops.aten
FORWARD = _aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_BATCH, _HEADS = 0, 1


def _check_mask(attn_mask) -> None:
    if attn_mask is not None and not all(p.is_replicate() for p in attn_mask.placements):
        raise ValueError(f"attn_mask must be replicated for SDPA on DTensors on the CPU; got placements "
                         f"{tuple(attn_mask.placements)}. DTensor does not redistribute the kernel's attn_mask, a "
                         f"keyword argument: pass attn_mask.redistribute(placements=[Replicate()] * mesh.ndim)")


def _broadcasts(attn_mask, dim: int) -> bool:
    """The mask has one entry along q's ``dim`` (it broadcasts there), so it fits a split of it."""
    return attn_mask is None or attn_mask.ndim < 4 - dim or attn_mask.shape[dim - 4] == 1


def _strategies(outputs: int, inputs: int, attn_mask):
    """(output placements, input placements) for each way the kernel may run: replicated, split by
    batch, split by heads; every tensor of the call but the mask is (B, H, ...), so all split alike.
    A DTensor mask stays replicated, so only splits of dims it broadcasts over take it."""
    _check_mask(attn_mask)
    mask = [] if attn_mask is None else [Replicate()]
    splits = [dim for dim in (_BATCH, _HEADS) if _broadcasts(attn_mask, dim)]
    return [([Replicate()] * outputs, [Replicate()] * inputs + mask)] + [
        ([Shard(dim)] * outputs, [Shard(dim)] * inputs + mask) for dim in splits]


def _forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    return _strategies(2, 3, attn_mask)  # (out, lse); (q, k, v)


def _backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):
    return _strategies(3, 6, attn_mask)  # (dq, dk, dv); (dout, q, k, v, out, lse)


def _has_rule(op) -> bool:
    propagator = DTensor._op_dispatcher.sharding_propagator
    return any(op in getattr(propagator, table, {}) for table in ("op_strategy_funcs", "op_single_dim_strategy_funcs",
                                                                   "op_to_rules"))


def register() -> None:
    propagator = DTensor._op_dispatcher.sharding_propagator
    for op, rule in ((FORWARD, _forward), (BACKWARD, _backward)):
        if not _has_rule(op):
            register_sharding(op)(rule)
            # DTensor caches a rule's answer by the call's DTensor arguments and the keyword arguments
            # named here: the mask, whose shape decides which splits it fits, must be among them
            propagator.op_to_schema_info[op] = RuntimeSchemaInfo(static_kwargkey=["attn_mask"], needs_pytree=True)


register()
