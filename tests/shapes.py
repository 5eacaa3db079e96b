"""The head configurations every numerical test runs: (h_q, h_kv, d_qk, d_v), and document ids."""
import torch

HEADS = {
    "mha": (4, 4, 16, 16),
    "gqa": (8, 2, 16, 16),
    "mla": (4, 4, 24, 16),
    # the seed-000 case h_q=64, h_kv=4, d_qk=192, d_v=128, scaled down with its ratios kept
    "gqa_mla": (16, 1, 24, 16),
}


def make_qkv(name, batch=2, s_q=40, s_k=None, dtype=torch.float32, device="cpu", requires_grad=True):
    h_q, h_kv, d_qk, d_v = HEADS[name]
    s_k = s_q if s_k is None else s_k
    q = torch.randn(batch, h_q, s_q, d_qk, dtype=dtype, device=device)
    k = torch.randn(batch, h_kv, s_k, d_qk, dtype=dtype, device=device)
    v = torch.randn(batch, h_kv, s_k, d_v, dtype=dtype, device=device)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def document_runs(*lengths):
    """One batch row of document ids: a document of each length, in order (0, 1, ...)."""
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
