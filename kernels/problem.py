"""The facts about one attention call that decide which kernel may run it."""
import functools
from dataclasses import dataclass

import torch


@functools.cache
def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability of ``device``, (0, 0) off CUDA. Cached: asking the driver
    costs microseconds on every call, and calls are what the kernels' host time is made of."""
    usable = device.type == "cuda" and torch.cuda.is_available()
    return torch.cuda.get_device_capability(device) if usable else (0, 0)


@dataclass(frozen=True)
class Problem:
    device_type: str
    sm: tuple[int, int]  # compute capability, (0, 0) off CUDA
    dtype: torch.dtype
    h_q: int
    h_kv: int
    s_q: int
    s_k: int
    d_qk: int
    d_v: int
    is_causal: bool
    has_mask: bool  # an arbitrary attn_mask (bool or additive)
    has_key_padding: bool  # a (B, S_k) bool key_padding_mask
    has_documents: bool  # (B, S) document_ids
    offset: bool  # query and key positions differ, and a causal or window mask depends on it
    softcapped: bool = False  # scores capped by softcap * tanh(scores / softcap)
    window: tuple[int, int] = (-1, -1)  # (left, right), -1 unbounded
    k_shift: int = 0  # k_offset - q_offset: where the keys start relative to the queries
    ends_aligned: bool = False  # packed segments whose last query and last key share a position
    backward: bool = False  # the call is the backward pass

    @property
    def windowed(self) -> bool:
        return self.window != (-1, -1)

    @classmethod
    def of(cls, q, k, v, *, is_causal=False, window=(-1, -1), attn_mask=None, key_padding_mask=None, q_offset=0,
           k_offset=0, document_ids=None, softcap=0.0, aligned=True, ends_aligned=False, backward=False):
        """q, k, v: tensors, or anything with their shape, dtype and device. ``aligned=False``: packed
        documents whose query and key lengths may differ, so their positions need not line up;
        ``ends_aligned``: they differ, but each segment's last query sits at its last key's position
        (FA2's and FA4's bottom-right alignment)."""
        return cls(
            device_type=q.device.type, sm=capability(q.device), dtype=q.dtype,
            h_q=q.shape[1], h_kv=k.shape[1], s_q=q.shape[2], s_k=k.shape[2], d_qk=q.shape[-1], d_v=v.shape[-1],
            is_causal=bool(is_causal), has_mask=attn_mask is not None,
            has_key_padding=key_padding_mask is not None, has_documents=document_ids is not None,
            offset=(bool(is_causal) or tuple(window) != (-1, -1)) and (q_offset != k_offset or not aligned
                                                                          or ends_aligned),
            softcapped=bool(softcap), window=tuple(window), k_shift=k_offset - q_offset, ends_aligned=ends_aligned,
            backward=backward,
        )
