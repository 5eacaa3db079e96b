"""Document ids and key padding on FlashAttention-4's mask_mod path (kernels/fa4_mask_mod.py) on
the CPU: the block tables its Triton kernel makes (under the interpreter), which problems it
takes, and the whole path through a stand-in for FA4 that attends only where the tables send it
(full blocks unmasked, partial blocks through the mask), against the float64 oracle. A table that misses a
visible block, or calls a block full that is not, fails here. The real FA4 runs in
tests/test_gpu_fa4.py."""
import itertools
from typing import NamedTuple, Optional

import pytest
import torch

from attn_compile.kernels import fa4, fa4_mask_mod, reference
from attn_compile.kernels.documents import same_document_mask
from attn_compile.kernels.triton_mask_blocks import mask_blocks
from attn_compile.kernels.visibility import visible
from oracle import errors_against_oracle
from shapes import document_runs
from test_fa4_adapter import _on, _problem


def _visible(ids, band, keys_only=False):
    """(B, S, S) bool: which keys each query sees, in its document (``keys_only``: the real keys of
    a key padding mask) and the band (left, right)."""
    positions = torch.arange(ids.shape[1])
    mask = ids.bool()[:, None, :].expand(-1, ids.shape[1], -1) if keys_only else same_document_mask(ids)[:, 0]
    return mask & visible(positions, positions, *band)


def _dense(counts, indices, columns):
    """(B, rows, columns) bool from a table; its rows' indices must rise."""
    dense = torch.zeros(*indices.shape[:-1], columns, dtype=torch.bool)
    for position in itertools.product(*map(range, counts.shape)):
        row = indices[position][:int(counts[position])].long()
        assert (row[1:] > row[:-1]).all()
        dense[position][row] = True
    return dense[:, 0]


def _blocks_of(visible, query_block, key_block, rows_are_queries):
    """(seen, full) (B, rows, columns): blocks holding a visible pair, and blocks wholly visible and
    inside S."""
    s = visible.shape[-1]
    seen, full = [], []
    for m in range(-(-s // query_block)):
        for n in range(-(-s // key_block)):
            block = visible[:, m * query_block:(m + 1) * query_block, n * key_block:(n + 1) * key_block].flatten(1)
            whole = (m + 1) * query_block <= s and (n + 1) * key_block <= s
            seen.append(block.any(1))
            full.append(block.all(1) & whole)
    shape = (visible.shape[0], -(-s // query_block), -(-s // key_block))
    seen, full = (torch.stack(x, 1).view(shape) for x in (seen, full))
    return (seen, full) if rows_are_queries else (seen.transpose(1, 2), full.transpose(1, 2))


TABLES = {  # name: (s, query block, key block, band (left, right), rows are queries)
    "forward, causal": (300, 32, 16, (-1, 0), True),
    "backward, causal, key blocks not dividing S": (300, 32, 24, (-1, 0), False),
    "forward, not causal": (256, 32, 32, (-1, -1), True),
    "backward, not causal": (200, 16, 24, (-1, -1), False),
    "short, blocks past S": (77, 16, 8, (-1, 0), True),
    "forward, causal window 64": (300, 16, 16, (64, 0), True),
    "backward, causal window 64": (300, 16, 24, (64, 0), False),
    "forward, window (40, 24)": (256, 16, 16, (40, 24), True),
    "backward, window (40, 24)": (256, 16, 16, (40, 24), False),
}


@pytest.mark.parametrize("keys_only", [False, True], ids=["document ids", "key padding"])
@pytest.mark.parametrize("name", list(TABLES))
def test_block_tables(name, keys_only):
    """Row 0 holds documents as runs (key padding: real keys, then padding, then real keys): its
    tables are exact, but for key padding under a window's left side. Row 1's ids come back after
    others (key padding: holes everywhere): every block with a visible pair is listed, and none is
    full that is not."""
    s, query_block, key_block, band, rows_are_queries = TABLES[name]
    torch.manual_seed(0)
    if keys_only:
        ids = torch.stack([(torch.arange(s) < s // 3) | (torch.arange(s) >= s // 2), torch.rand(s) < 0.7])
    else:
        ids = torch.stack([document_runs(*torch.randint(1, 130, (40,)).tolist())[:s], torch.randint(0, 3, (s,))])
    tables = mask_blocks(ids.int() if keys_only else ids, query_block, key_block, band, rows_are_queries,
                             keys_only=keys_only)
    seen, full = _blocks_of(_visible(ids, band, keys_only), query_block, key_block, rows_are_queries)
    columns = seen.shape[-1]
    partial, listed_full = _dense(tables.partial_count, tables.partial_index, columns), \
        _dense(tables.full_count, tables.full_index, columns)
    assert not (partial & listed_full).any()
    assert ((partial | listed_full) >= seen).all()
    assert not (listed_full & ~full).any()
    assert torch.equal(listed_full[0], full[0])
    if not (keys_only and band[0] >= 0):  # a key block can hold real keys and band pairs, apart
        assert torch.equal(partial[0], seen[0] & ~full[0])
    assert listed_full[0].any() and partial[1].any()


# What the path takes ----------------------------------------------------------------------------------------

SUPPORTS = {  # name: (problem, facts, taken)
    "causal, gqa": (_problem(h_q=8, h_kv=2, d_qk=128, d_v=128, is_causal=True, document_ids=torch.empty(0)), {}, True),
    "not causal": (_problem(document_ids=torch.empty(0)), {}, True),
    "mla 192/128 backward": (_problem(d_qk=192, d_v=128, is_causal=True, document_ids=torch.empty(0),
                                      backward=True), {}, True),
    "no document ids": (_problem(is_causal=True), {}, False),
    "sm100": (_problem(is_causal=True, document_ids=torch.empty(0)), {"sm": (10, 0)}, False),
    "window": (_problem(window=(8, 0), document_ids=torch.empty(0)), {}, True),
    "causal window": (_problem(is_causal=True, window=(8, -1), document_ids=torch.empty(0)), {}, True),
    "softcap": (_problem(is_causal=True, softcap=30.0, document_ids=torch.empty(0)), {}, False),
    "document ids and key padding": (_problem(key_padding_mask=torch.empty(0), document_ids=torch.empty(0)), {},
                                     False),
    "key padding, causal, gqa": (_problem(h_q=8, h_kv=2, is_causal=True, key_padding_mask=torch.empty(0)), {}, True),
    "key padding, window": (_problem(window=(8, 0), key_padding_mask=torch.empty(0)), {}, True),
    "key padding, keys longer than queries": (_problem(s_q=16, is_causal=True, key_padding_mask=torch.empty(0)), {},
                                              False),
    "key padding, softcap": (_problem(softcap=30.0, key_padding_mask=torch.empty(0)), {}, False),
    "position offset": (_problem(is_causal=True, q_offset=32, k_offset=0, document_ids=torch.empty(0)), {}, False),
    "d 256": (_problem(d_qk=256, d_v=256, document_ids=torch.empty(0)), {}, False),
    "gqa+mla": (_problem(h_q=8, h_kv=2, d_qk=192, d_v=128, document_ids=torch.empty(0)), {}, False),
    "float32": (_problem(dtype=torch.float32, document_ids=torch.empty(0)), {}, False),
}


@pytest.mark.parametrize("name", list(SUPPORTS))
def test_supports(standin, name):
    problem, facts, taken = SUPPORTS[name]
    assert fa4_mask_mod.supports(_on(problem, **facts)) is taken


def test_refused_without_triton(standin, monkeypatch):
    """The block tables are a Triton kernel: without Triton the path takes nothing."""
    monkeypatch.setattr(fa4_mask_mod, "mask_blocks", None)
    assert not fa4_mask_mod.supports(_on(_problem(is_causal=True, document_ids=torch.empty(0))))


# The path through a stand-in --------------------------------------------------------------------------------


class Tables(NamedTuple):
    """FA4's ``BlockSparseTensorsTorch``, the fields this path fills."""
    mask_block_cnt: torch.Tensor
    mask_block_idx: torch.Tensor
    full_block_cnt: torch.Tensor
    full_block_idx: torch.Tensor
    block_size: Optional[tuple] = None


class StandIn:
    """FA4's ``_flash_attn_fwd`` and ``_flash_attn_bwd`` with ``mask_mod``, ``aux_tensors`` and
    block tables: (B, S, H, D) tensors; a query attends to the keys of the blocks its tables list,
    all of a full block and, in a partial one, those the mask keeps (``mask_mod`` is stood in for
    by its band)."""
    BlockSparseTensorsTorch = Tables

    def __init__(self):
        self.calls = []

    @staticmethod
    def _attended(ids, mask, tables, backward):
        block_q, block_k = tables.block_size
        s = ids.shape[1]
        rows = (block_k if backward else block_q)
        columns = (block_q if backward else block_k)
        partial = _dense(tables.mask_block_cnt, tables.mask_block_idx, -(-s // columns))
        full = _dense(tables.full_block_cnt, tables.full_block_idx, -(-s // columns))
        expand = lambda x: x.repeat_interleave(rows, 1)[:, :s].repeat_interleave(columns, 2)[:, :, :s]
        partial, full = expand(partial), expand(full)
        if backward:
            partial, full = partial.transpose(1, 2), full.transpose(1, 2)
        left, right, keys_only = mask
        return (full | (partial & _visible(ids, (left, right), keys_only)))[:, None]

    def _flash_attn_fwd(self, q, k, v, softmax_scale, out, lse, return_lse, mask_mod, aux_tensors,
                        block_sparse_tensors):
        self.calls.append(("fwd", mask_mod, block_sparse_tensors.block_size, aux_tensors[0]))
        visible = self._attended(aux_tensors[0], mask_mod, block_sparse_tensors, backward=False)
        assert aux_tensors[0].dtype != torch.bool and aux_tensors[0].is_contiguous()
        o, l = reference.attention_forward(*(x.transpose(1, 2).double() for x in (q, k, v)), scale=softmax_scale,
                                           attn_mask=visible)
        out.copy_(o.transpose(1, 2))
        lse.copy_(l)

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, softmax_scale, causal, softcap, dq, dk, dv, mask_mod,
                        aux_tensors, block_sparse_tensors):
        assert causal is False and softcap == 0.0  # the mask carries causality
        self.calls.append(("bwd", mask_mod, block_sparse_tensors.block_size, aux_tensors[0]))
        visible = self._attended(aux_tensors[0], mask_mod, block_sparse_tensors, backward=True)
        grads = reference.attention_backward(*(x.transpose(1, 2).double() for x in (dout, q, k, v, out)), lse.double(),
                                             scale=softmax_scale, attn_mask=visible)
        for into, grad in zip((dq, dk, dv), grads):
            into.copy_(grad.transpose(1, 2))


@pytest.fixture
def standin(monkeypatch):
    stand_in = StandIn()
    monkeypatch.setattr(fa4, "interface", lambda: stand_in)
    monkeypatch.setattr(fa4_mask_mod, "_mask_mod", lambda left, right, keys_only: (left, right, keys_only))
    monkeypatch.setattr(fa4_mask_mod, "QUERY_BLOCK", 16)
    monkeypatch.setattr(fa4_mask_mod, "key_block", lambda d_qk, backward: 24 if backward else 8)
    return stand_in


IDS = {  # name: (B, S) ids of one S, and whether they are a key padding mask
    "runs": lambda s: (torch.stack([document_runs(9, 30, 1, 40)[:s], document_runs(s)]), False),
    "ids that come back": lambda s: (torch.stack([torch.arange(s) // 7 % 3, torch.arange(s) // 20 % 2]), False),
    "bool ids": lambda s: (torch.stack([torch.arange(s) < 33, torch.arange(s) % 40 < 25]), False),
    "key padding, right and left": lambda s: (torch.stack([torch.arange(s) < 41, torch.arange(s) >= 29]), True),
    "key padding, holes and a row without a real key": lambda s: (
        torch.stack([(torch.arange(s) % 9 != 4) & (torch.arange(s) < 60), torch.zeros(s, dtype=torch.bool)]), True),
}


MASKING = {  # name: (masking, band)
    "causal": (dict(is_causal=True), (-1, 0)),
    "full": ({}, (-1, -1)),
    "causal window 9": (dict(is_causal=True, window=(9, -1)), (9, 0)),
    "window (6, 3)": (dict(window=(6, 3)), (6, 3)),
}


@pytest.mark.parametrize("masking", list(MASKING))
@pytest.mark.parametrize("ids", list(IDS))
def test_path_against_oracle(standin, ids, masking):
    """GQA, MLA head dims, projected (B, S, H, D) views, S = 70 (no block size divides it)."""
    torch.manual_seed(1)
    s = 70
    ids, keys_only = IDS[ids](s)
    q, k, v = (torch.randn(2, s, h, d).transpose(1, 2) for h, d in ((4, 24), (2, 24), (2, 16)))
    masking, band = MASKING[masking]
    masking = dict(masking, **{"key_padding_mask" if keys_only else "document_ids": ids})
    scale = 24 ** -0.5
    out, lse = fa4_mask_mod.attention_forward(q, k, v, scale=scale, **masking)
    dout = torch.randn_like(out)
    grads = fa4_mask_mod.attention_backward(dout, q, k, v, out, lse, scale=scale, **masking)
    assert [call[0] for call in standin.calls] == ["fwd", "bwd"]
    assert all(call[1] == (*band, keys_only) for call in standin.calls)
    assert [call[2] for call in standin.calls] == [(16, 8), (16, 24)]
    if ids.dtype == torch.bool:  # handed to FA4 as its bytes, not converted per call
        assert all(call[3].dtype == torch.uint8 and call[3].data_ptr() == ids.data_ptr() for call in standin.calls)
    assert out.stride() == torch.empty(2, s, 4, 16).transpose(1, 2).stride()  # q's memory order
    oracle_masking = dict(masking)
    if not keys_only:
        oracle_masking["attn_mask"] = same_document_mask(oracle_masking.pop("document_ids"))
    errors = errors_against_oracle(q, k, v, dout, out, grads, **oracle_masking)
    assert max(errors) <= 1e-5, errors
    for grad, x in zip(grads, (q, k, v)):
        assert grad.stride() == torch.empty_like(x).stride()
