"""PyTorch's fused CUDA attention kernels that return the LSE: cuDNN, flash (FA2) and efficient.

Each is used only through ``supports``: a kernel is never handed a shape or an argument it
cannot take. None of them takes a window, a mask, position offsets that matter or a softcap, so
the mask arguments other than ``is_causal`` reach them only at values that change nothing.
"""
import torch

from .problem import Problem

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


def _plain(p: Problem) -> bool:
    """What all three need: CUDA, no window, no offsets, no softcap, and causal only when square."""
    return (
        p.device_type == "cuda"
        and not p.windowed
        and not p.offset
        and not p.has_mask
        and not p.has_key_padding
        and not p.has_documents
        and not p.softcapped
        and (not p.is_causal or p.s_q == p.s_k)
        and p.d_qk % 8 == 0
        and p.d_v % 8 == 0
    )


def _like(x: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    """x copied into layout's strides: the backward kernels expect dout laid out like out."""
    return x if x.stride() == layout.stride() else torch.empty_like(layout).copy_(x)


def _heads_inner(x: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) x as a view of a contiguous (B, S, H, D) tensor, copied there if it lies
    otherwise: the efficient backward reads out with that layout's row stride (H·D, its
    ``o_strideM``) whatever out's strides say, and the op's out follows q's order of dims."""
    bshd = x.transpose(1, 2)
    return x if bshd.is_contiguous() else bshd.contiguous().transpose(1, 2)


class Cudnn:
    name = "cudnn"

    @staticmethod
    def supports(p: Problem) -> bool:
        return (
            _plain(p) and p.dtype in _HALF and p.d_qk <= 256 and p.d_v <= 256
            and (p.s_q, p.s_k) != (1, 1)  # cuDNN's backward refuses a single query against a single key
            and p.sm >= (9, 0) and torch.backends.cuda.cudnn_sdp_enabled()
        )

    @staticmethod
    def forward(q, k, v, *, scale, is_causal=False, **_trivial_masking):
        out, lse, *_ = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, is_causal, False, scale=scale)
        return out, lse.reshape(q.shape[:-1])

    @staticmethod
    def backward(dout, q, k, v, out, lse, *, scale, is_causal=False, **_trivial_masking):
        # Undefined (None) cumulative lengths: defined ones would select cuDNN's packed (varlen) path.
        empty = q.new_empty(0)
        lse = lse.reshape(*q.shape[:-1], 1).contiguous()
        s_q, s_k = q.shape[2], k.shape[2]
        return aten._scaled_dot_product_cudnn_attention_backward(
            _like(dout, out), q, k, v, out, lse, empty, empty, None, None, None, s_q, s_k, 0.0, is_causal, scale=scale
        )


class Flash:
    name = "flash"

    @staticmethod
    def supports(p: Problem) -> bool:
        return (
            _plain(p) and p.dtype in _HALF and p.h_q == p.h_kv and p.d_qk == p.d_v and p.d_qk <= 256
            and p.sm >= (8, 0) and torch.backends.cuda.flash_sdp_enabled()
        )

    @staticmethod
    def forward(q, k, v, *, scale, is_causal=False, **_trivial_masking):
        out, lse, *_ = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
        return out, lse

    @staticmethod
    def backward(dout, q, k, v, out, lse, *, scale, is_causal=False, **_trivial_masking):
        empty = q.new_empty(0)
        return aten._scaled_dot_product_flash_attention_backward(
            _like(dout, out), q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, is_causal,
            empty, empty, scale=scale,
        )


class Efficient:
    name = "efficient"

    @staticmethod
    def supports(p: Problem) -> bool:
        return (
            _plain(p) and p.dtype in (*_HALF, torch.float32) and p.h_q == p.h_kv
            and p.sm >= (5, 0) and torch.backends.cuda.mem_efficient_sdp_enabled()
        )

    @staticmethod
    def forward(q, k, v, *, scale, is_causal=False, **_trivial_masking):
        out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, is_causal, scale=scale)
        return out, lse[..., : q.shape[2]]

    @staticmethod
    def backward(dout, q, k, v, out, lse, *, scale, is_causal=False, **_trivial_masking):
        empty = q.new_empty(0)
        out = _heads_inner(out)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            _like(dout, out), q, k, v, None, out, lse.contiguous(), empty, empty, 0.0, [True, True, True, False],
            is_causal, scale=scale,
        )
        return dq, dk, dv


class FlashVarlen:
    """FA2's packed-document kernel, (total, H, D) with cumulative lengths. It takes a window and
    GQA but needs d_v == d_qk: for MLA (d_v < d_qk) V is zero-padded to d_qk here, and the output
    and dV trimmed. Only this kernel pads; the kernels that take d_v != d_qk get V as it is."""
    name = "flash"

    @staticmethod
    def supports(p: Problem) -> bool:
        return (
            p.device_type == "cuda" and p.dtype in _HALF and not p.has_mask and not p.has_key_padding
            and not p.has_documents and not p.offset and not p.softcapped and p.d_qk % 8 == 0 and p.d_v <= p.d_qk <= 256
            and p.sm >= (8, 0) and torch.backends.cuda.flash_sdp_enabled()
        )

    @staticmethod
    def _padded(x, d):
        return torch.nn.functional.pad(x, (0, d - x.shape[-1])) if x.shape[-1] != d else x

    @staticmethod
    def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale, is_causal=False,
                window=(-1, -1), **_trivial_masking):
        out, lse, *_ = aten._flash_attention_forward(
            q, k, FlashVarlen._padded(v, q.shape[-1]), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0,
            is_causal, False, scale=scale, window_size_left=window[0], window_size_right=window[1])
        return out[..., : v.shape[-1]], lse.transpose(0, 1)

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale,
                 is_causal=False, window=(-1, -1), **_trivial_masking):
        d = q.shape[-1]
        empty = q.new_empty(0)
        dq, dk, dv = aten._flash_attention_backward(
            FlashVarlen._padded(dout, d).contiguous(), q, k, FlashVarlen._padded(v, d),
            FlashVarlen._padded(out, d).to(q.dtype).contiguous(), lse.transpose(0, 1).contiguous(), cu_seqlens_q,
            cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, is_causal, empty, empty, scale=scale,
            window_size_left=window[0], window_size_right=window[1])
        return dq, dk, dv[..., : v.shape[-1]]
