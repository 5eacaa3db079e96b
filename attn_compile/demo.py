"""``python -m attn_compile demo``: compile a small GQA transformer with backend="attn_cp" on the
CPU, show the rewritten sites and the difference against eager, then run context parallelism."""
import torch
import torch.nn.functional as F
from torch import nn

from .explain import explain

TOLERANCE = 1e-4


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, kv_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyGQATransformer(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 8, kv_heads: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def local_demo() -> int:
    torch.manual_seed(0)
    model = TinyGQATransformer().eval()
    tokens = torch.randint(0, 256, (2, 32))
    print(explain(model, tokens))
    with torch.no_grad():
        expected = model(tokens)
        got = torch.compile(model, backend="attn_cp")(tokens)
    diff = (got - expected).abs().max().item()
    ok = diff <= TOLERANCE
    print(f"compiled vs eager logits: max |diff| = {diff:.3e} ({'ok' if ok else 'MISMATCH'}, tolerance {TOLERANCE})")
    return 0 if ok else 1
