"""torch.library.opcheck on both custom ops, for MHA, GQA, MLA and GQA+MLA."""
import pytest
import torch

import attn_compile  # noqa: F401
from shapes import HEADS, make_qkv


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("extra", [(None, True, None), (None, False, 0.3, 4, 2), ("bool", False), ("additive", False),
                                   (None, True, None, 3, -1, "key_padding"),
                                   (None, True, None, -1, -1, None, 0, "documents"),
                                   (None, True, 0.3, 5, -1, None, 0, None, 0.8)])  # a softcap
def test_opcheck_attention(heads, extra):
    torch.manual_seed(0)
    q, k, v = make_qkv(heads, s_q=12)
    if extra[-1] == "documents":  # contiguous runs in row 0 (the packed path), an id that comes back in row 1
        extra = (*extra[:-1], torch.tensor([[0] * 5 + [1] * 7, [0, 0, 1, 1, 0, 0, 2, 2, 2, 2, 2, 2]]))
    elif extra[-1] == "key_padding":
        extra = (*extra[:-1], torch.arange(12).expand(2, 12) >= torch.tensor([[0], [4]]))
    elif extra[0] == "bool":
        extra = (torch.rand(12, 12) > 0.3, *extra[1:])
    elif extra[0] == "additive":
        extra = (torch.randn(2, 1, 12, 12), *extra[1:])
    torch.library.opcheck(torch.ops.attn_cp.attention.default, (q, k, v, *extra))


@pytest.mark.parametrize("heads", list(HEADS))
def test_opcheck_attention_backward(heads):
    torch.manual_seed(0)
    q, k, v = make_qkv(heads, s_q=12, requires_grad=False)
    out, lse = torch.ops.attn_cp.attention(q, k, v, None, True)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.attn_cp.attention_backward.default,
                          (dout, q, k, v, out, lse, None, True, None, -1, -1, None, 5, None))
    out, lse = torch.ops.attn_cp.attention(q, k, v, None, True, None, softcap=0.5)
    torch.library.opcheck(torch.ops.attn_cp.attention_backward.default,
                          (dout, q, k, v, out, lse, None, True, None, -1, -1, None, 0, None, 0.5))
