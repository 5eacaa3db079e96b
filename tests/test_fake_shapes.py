"""The fake functions give exact shapes for GQA+MLA, with static and with symbolic sizes."""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv, StatelessSymbolicContext, DimDynamic

import attn_compile  # noqa: F401


def test_static_gqa_mla_shapes():
    with FakeTensorMode():
        q = torch.empty(2, 64, 128, 192, dtype=torch.bfloat16)
        k = torch.empty(2, 4, 96, 192, dtype=torch.bfloat16)
        v = torch.empty(2, 4, 96, 128, dtype=torch.bfloat16)
        out, lse = torch.ops.attn_cp.attention(q, k, v, None, False)
        dq, dk, dv = torch.ops.attn_cp.attention_backward(torch.empty_like(out), q, k, v, out, lse, None, False,
                                                          None, -1, -1, None, 0)
    assert out.shape == (2, 64, 128, 128) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 64, 128) and lse.dtype == torch.float32
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_symbolic_sequence_lengths():
    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env)
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, DimDynamic.STATIC, DimDynamic.DYNAMIC,
                                                      DimDynamic.STATIC])
    q = mode.from_tensor(torch.empty(2, 16, 40, 24), symbolic_context=dynamic)
    k = mode.from_tensor(torch.empty(2, 1, 56, 24), symbolic_context=dynamic)
    v = mode.from_tensor(torch.empty(2, 1, 56, 16), symbolic_context=dynamic)
    with mode:
        out, lse = torch.ops.attn_cp.attention(q, k, v, None, False)
    assert isinstance(q.shape[2], torch.SymInt)
    assert out.shape == (2, 16, q.shape[2], 16)
    assert lse.shape == (2, 16, q.shape[2])
    assert str(out.shape[2]) == str(q.shape[2]) != str(k.shape[2])
