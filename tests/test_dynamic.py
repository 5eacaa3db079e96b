"""dynamic=True: a new sequence length reuses the compiled graph."""
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from oracle import rel_err
from shapes import make_qkv


def test_sequence_length_change_does_not_recompile():
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("attn_cp")
    fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                       backend=counter, dynamic=True)
    for seq in (20, 24, 37, 64):  # none equal to a head count or dim, which duck sizing would tie
        q, k, v = make_qkv("gqa_mla", s_q=seq)
        got = fn(q, k, v)
        assert got.shape == (*q.shape[:-1], v.shape[-1])
        assert rel_err(got, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)) <= 1e-5
        got.sum().backward()
    assert counter.frame_count == 1
