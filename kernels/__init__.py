"""Attention kernels: the pure-PyTorch reference and the fused aten kernels, behind one dispatch."""
from .dispatch import (attention_backward, attention_forward, select_kernel, select_varlen_kernel, varlen_backward,
                       varlen_forward)

__all__ = ["attention_forward", "attention_backward", "select_kernel", "varlen_forward", "varlen_backward",
           "select_varlen_kernel"]
