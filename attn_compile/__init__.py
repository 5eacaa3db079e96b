"""attn_compile: a torch.compile backend ("attn_cp") that rewrites attention into fused,
context-parallel ops. ``torch.compile(model, backend="attn_cp")`` needs no import of this package."""
from . import cpu_sdpa_sharding  # noqa: F401  (DTensor rules for SDPA's CPU kernel, before anything traces)
from . import ops  # registers torch.ops.attn_cp.*
from .cp.api import context_parallel_attention
from .cp.documents import shard_varlen, unshard_varlen
from .cp.layout import shard_sequence, unshard_sequence
from .explain import Report, explain
from .varlen import varlen_attention

__all__ = ["context_parallel_attention", "shard_sequence", "unshard_sequence", "varlen_attention", "shard_varlen",
           "unshard_varlen", "explain", "Report", "ops"]
