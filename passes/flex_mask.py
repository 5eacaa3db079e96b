"""Index-only masks that mask_structure.py cannot classify (ORs of conditions, chunks, strides,
per-head masks, ...) run as ``flex_attention`` with a BlockMask; the S_q x S_k mask is then not built.

The mask_mod evaluates the mask's formula (index_formula.evaluate) at (b, h, q_idx, kv_idx); a
formula that reads per-key data (``pad[b, j]``) reads it in the mask_mod, and the tensor becomes an
argument of the emitted call. Reads on the query side (``ids[b, i] == ids[b, j] | j <= i``) are not
routed: that mask ran 20x slower as flex_attention than as the dense mask (H200, torch 2.11,
S=4096). The block mask is created in the graph (``create_block_mask(mask_mod, B or None, H or
None, S_q, S_k)``, B and H only where the formula reads them).

The route is not taken, and the mask stays, where flex_attention would not give eager's answer
or cannot run:
- a query that sees no key: flex gives it 0, as SDPA does for a bool or -inf mask, but
  hand-written softmax gives NaN and an additive dtype-minimum mask the mean of v; other sites are
  routed only where each query provably sees a key (its own position, or the first key);
- q, k, v on CPU that need gradients (flex_attention has no CPU backward), or DTensors;
- sizes of the block mask that are symbolic (dynamic shapes): Inductor fails on the block mask
  made from them ("A subgraph argument other than striding has been modified", torch 2.13); such a
  graph keeps the mask, so a new sequence length still reuses it, without flex_attention;
- on CPU, a result not transposed away first: Inductor's CPU flex template (torch 2.13) raises
  on a pointwise consumer it fuses into the kernel ("Unsupported for epilogue_nodes").
"""
import dataclasses
from typing import Optional

import torch
from torch.fx import Graph, Node
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from .call import AttentionCall, eager_empty_row
from .index_formula import (B, H, I, J, Affine, And, Compare, Eq, Gather, Le, Number, Or, all_of, axes_of, evaluate,
                            gathers_of, substitute)
from .layouts import transposed_away
from .mask_trace import Unsupported
from .nodes import is_mutated
from .sdpa import SDPA
from .shapes import example_tensor, hinted_shape, known_equal


@dataclasses.dataclass(frozen=True)
class FlexMask:
    formula: object  # True = the key is visible
    data: tuple[Node, ...]  # the tensors the formula reads (_sources), as the call passes them

    def __str__(self) -> str:
        return f"flex_attention mask_mod {self.formula}"


def _sources(formula) -> list[Node]:
    """The tensors the formula reads, in the order the call passes them."""
    return list(dict.fromkeys(g.source for g in gathers_of(formula)))


class FlexAttention:
    """The emitted call: ``flex_attention(q, k, v, *data)`` with the mask's BlockMask."""

    __name__ = "flex_attention"

    def __init__(self, mask: FlexMask, scale: Optional[float], enable_gqa: bool, softcap: float = 0.0):
        self.formula, self.scale, self.enable_gqa, self.softcap = mask.formula, scale, enable_gqa, softcap
        self.positions = {node: p for p, node in enumerate(_sources(mask.formula))}
        self.axes = axes_of(mask.formula)

    def __call__(self, q, k, v, *data):
        def gather(element: Gather, index: list):
            return data[self.positions[element.source]][tuple(index)]

        def mask_mod(b, h, q_idx, kv_idx):
            return evaluate(self.formula, {B: b, H: h, I: q_idx, J: kv_idx}, gather)

        block_mask = create_block_mask(mask_mod, q.shape[0] if B in self.axes else None,
                                       q.shape[1] if H in self.axes else None, q.shape[2], k.shape[2], device=q.device)
        def capped(score, b, h, q_idx, kv_idx):  # flex_attention hands score_mod the scaled scores
            return self.softcap * torch.tanh(score / self.softcap)

        return flex_attention(q, k, v, score_mod=capped if self.softcap else None, block_mask=block_mask,
                              scale=self.scale, enable_gqa=self.enable_gqa)


def _per_key(element: Gather) -> bool:
    """``t[b, j]`` (or ``t[0, j]`` of a tensor broadcast over the batch)."""
    return len(element.index) == 2 and element.index[0] in (Affine.index(B), Affine()) and \
        element.index[1] == Affine.index(J)


def _holds_everywhere(formula) -> bool:
    """A sufficient check that formula is True for every non-negative index."""
    if isinstance(formula, Number):
        return formula.value is True
    if isinstance(formula, Le):  # no positive coefficient, constant <= 0
        return all(c < 0 for _, c in formula.value.coefficients) and formula.value.constant <= 0
    if isinstance(formula, Eq):
        return formula.value == Affine()
    if isinstance(formula, And):
        return all(map(_holds_everywhere, formula.terms))
    if isinstance(formula, Or):
        return any(map(_holds_everywhere, formula.terms))
    if isinstance(formula, Compare):
        if formula.left == formula.right:
            return formula.op in ("eq", "le", "ge")
        if not axes_of(formula) and not gathers_of(formula):
            return bool(evaluate(formula, {}, None))
    return False


def _sees_a_key(formula, s_q, s_k) -> bool:
    """Each query (b, h, i) sees the first key, or its own position (a key when S_q == S_k)."""
    witnesses = [Affine()] + ([Affine.index(I)] if known_equal(s_q, s_k) else [])
    return any(_holds_everywhere(substitute(formula, {J: j})) for j in witnesses)


def _why_not(call: AttentionCall, formula, hiding, data: list) -> Optional[str]:
    q, k, v = (example_tensor(n) for n in (call.q, call.k, call.v))
    if not {I, J} & axes_of(formula):
        return "the mask does not depend on the query or key index"
    reads = [g for g in gathers_of(formula) if not _per_key(g)]
    if reads:
        return f"the mask reads {reads[0]}: only per-key tensors read at [b, j] go into a mask_mod"
    for node in data:
        t = example_tensor(node)
        if t is None or t.device != q.device:
            return f"the mask reads {node.name}, which is not a tensor on q's device"
        if is_mutated(node):
            return f"the mask reads {node.name}, which is modified in place"
    sizes = [q.shape[2], k.shape[2]] + [q.shape[0]] * (B in axes_of(formula)) + [q.shape[1]] * (H in axes_of(formula))
    if not all(isinstance(size, int) for size in sizes):
        return ("the block mask's sizes are symbolic (dynamic shapes): Inductor fails on a block mask made from them "
                "in the graph (torch 2.13)")
    if any(type(t).__name__ == "DTensor" for t in (q, k, v)):
        return "flex_attention does not take DTensor q, k, v"
    if q.device.type not in ("cuda", "cpu"):
        return f"flex_attention runs on CUDA and CPU, not {q.device.type}"
    if q.device.type == "cpu":
        if any(t.requires_grad for t in (q, k, v)):
            return "flex_attention has no backward on CPU"
        if not transposed_away(call.anchor):
            return ("on CPU the result must first be transposed and copied (Inductor's CPU flex_attention "
                    "cannot fuse the operations that read it)")
    eager_gives_zero = call.anchor.target is SDPA and hiding in (None, -torch.inf)
    if not eager_gives_zero and not _sees_a_key(formula, q.shape[2], k.shape[2]):
        return f"a query may see no key: flex_attention gives it 0, where the code as written gives " \
               f"{eager_empty_row(hiding)}"
    return None


def to_flex(call: AttentionCall, formula, hiding, why_unstructured: Unsupported) -> AttentionCall:
    """The call routed to flex_attention with the formula as its mask_mod, or noted with why the
    mask stays: why it has no structure, and why flex_attention does not fit either."""
    if call.is_causal:  # SDPA's is_causal with a mask: both hide keys
        formula = all_of((formula, Le(Affine.index(J) - Affine.index(I))))
    data = _sources(formula)
    reason = _why_not(call, formula, hiding, data)
    if reason is not None:
        return call.noted(f"mask kept: {why_unstructured}").noted(f"not flex_attention: {reason}")
    mask = FlexMask(formula, tuple(data))
    return call.noted(f"mask -> {mask}", attn_mask=None, is_causal=False, flex_mask=mask)


def emit_flex(graph: Graph, call: AttentionCall) -> None:
    """Insert the flex_attention call before the anchor and make the anchor's users read it."""
    h_q, h_kv = (hinted_shape(example_tensor(n))[1] for n in (call.q, call.k))
    target = FlexAttention(call.flex_mask, call.scale, enable_gqa=h_q != h_kv, softcap=call.softcap)
    with graph.inserting_before(call.anchor):
        out = graph.call_function(target, (call.q, call.k, call.v, *call.flex_mask.data))
    out.meta.update(call.anchor.meta)
    call.anchor.replace_all_uses_with(out)
    graph.erase_node(call.anchor)
