"""The order in which the dispatch tries the kernels: per problem class and direction, fastest
measured first (BENCHMARKS.md, "Kernels"; H100 80GB HBM3, torch 2.11, triton 3.6, flash-attn-4
4.0.0b36; the document-id rows and windowed key padding on an H200). Kernels a row has no figure
for follow the measured ones in the dispatch's fixed order, and a class without a row keeps that
order.

A class is what decides the relative speeds: the mask's kind (dense, window, position offset,
softcap, document ids, key padding) and, for key padding and document ids, the length. A padded
call of 4096 tokens or fewer is bound by host time, which FA4's mask_mod path (one FA4 launch and
its block tables) cuts by 0.6-1.2 ms per call against FA4's key padding path (two packed FA4
launches, the fills of the rows no call writes, the recompute of rows with holes); at 8192 tokens
the packed path measured 3-13% faster on the GPU in five of six rows and directions (1% slower
in one).
On document ids beyond 4096 tokens FA4's segments path runs both directions: it was the faster
FA4 path in every batch measured there but one forward (documents of 128 tokens, run M). Up to
4096 tokens a call is bound by host time, and the segments path's (about 1 ms a backward: FA4's,
and the Triton launches for its segments and for the rows it does not take) exceeds its GPU
work; there Triton runs the forward and the mask_mod path the backward (run O). Triton's and
the mask_mod path's forwards differ by less than their spread between machines (run M measured
them 0.322 and 0.312 ms, run O 0.330 and 0.354), and their host times decide (0.20 against 0.35
ms a call in run O). Softcapped document ids (Gemma 2's packed rows, head dim 256) are a class of
their own: beyond 4096 tokens the segments path's backward measured 21-26% faster than Triton's;
at 4096 its host time made a compiled site's fwd+bwd slower, as for the other document ids.
``python -m attn_compile.bench kernels --candidates`` times every kernel the dispatch may choose
for each benchmark shape and says where this table's order no longer holds.
"""
import dataclasses
import functools
from typing import Optional

from .problem import Problem


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: the dispatch caches its orders per row
class Measured:
    """One benchmark row: each kernel's figure, forward and backward alone, in ``unit``."""
    forward: dict
    backward: dict
    unit: str  # "TFLOP/s" (higher is faster) or "ms" (lower is faster)
    source: str
    up_to: Optional[int] = None  # the row holds for calls of at most this many keys (None: any)

    def speed(self, kernel: str, backward: bool) -> Optional[float]:
        figure = (self.backward if backward else self.forward).get(kernel)
        return None if figure is None else (figure if self.unit == "TFLOP/s" else 1 / figure)


TABLE = {  # class: its rows, the shortest bound first
    "dense": [Measured(
        {"fa4": 671, "cudnn": 560, "triton": 460, "flash": 317},
        {"fa4": 579, "cudnn": 504, "triton": 365, "flash": 296}, "TFLOP/s", "run D, MHA 32h d128 causal, S 8192")],
    "window": [Measured({"fa4": 481, "triton": 388}, {"fa4": 404, "triton": 294}, "TFLOP/s",
                        "run D, window 1024, 32h d128, S 8192")],
    "position offset": [Measured({"fa4": 635, "triton": 454}, {"fa4": 609, "triton": 361}, "TFLOP/s",
                                 "run D, ring step: causal, offset half a tile")],
    "softcap": [Measured({"triton": 387, "fa4": 303}, {"fa4": 389, "triton": 336}, "TFLOP/s",
                         "run D, MHA 32h d128 causal, softcap 50")],
    "document ids": [
        Measured({"triton": 0.330, "fa4 mask_mod": 0.354, "fa4 segments": 0.661},
                 {"fa4 mask_mod": 0.888, "fa4 segments": 0.998, "triton": 1.134}, "ms",
                 "H200, each kernel called directly, Llama-shaped B2 S4096, 3 documents a row (BENCHMARKS.md, run O)",
                 up_to=4096),
        Measured({"fa4 segments": 1.501, "fa4 mask_mod": 1.666, "triton": 2.287},
                 {"fa4 segments": 5.303, "fa4 mask_mod": 6.196, "triton": 8.501}, "ms",
                 "H200, each kernel called directly, 9 documents to 32K, MLA 16h (BENCHMARKS.md)"),
    ],
    "document ids, window": [Measured(
        {"triton": 0.347, "fa4 mask_mod": 0.387}, {"triton": 0.872, "fa4 mask_mod": 0.875}, "ms",
        "Mistral-shaped B2 S 4096, GQA 32/8, causal window 1023, its packed rows' documents; the same order at 8192")],
    "document ids, softcap": [
        Measured({"triton": 0.370, "fa4 segments": 0.502}, {"triton": 2.717, "fa4 segments": 3.859}, "ms",
                 "forward: run T (the next row); backward: one site of the compiled Gemma-2-shaped stack, packed "
                 "B2 S4096, attention fwd+bwd with Triton's forward and each backward, bound by host time "
                 "(BENCHMARKS.md)",
                 up_to=4096),
        Measured({"triton": 0.370, "fa4 segments": 0.502}, {"fa4 segments": 1.246, "triton": 1.677}, "ms",
                 "H200, run T: each kernel called directly, Gemma-2-shaped GQA 16/8 d256, softcap 50, window 4096, "
                 "documents of B2 S4096's packed rows in one row of 8192 tokens (at 16384 tokens fa4 segments "
                 "1.150 / 4.025, triton 1.169 / 5.108; without the window the same order)"),
    ],
    "key padding, window": [Measured(
        {"fa4 mask_mod": 0.292, "triton": 0.313}, {"fa4 mask_mod": 0.913, "triton": 1.035}, "ms",
        "H200, each kernel called directly, Mistral-shaped B2 S4096, window 1023, a row right-padded by 1/8 "
        "(BENCHMARKS.md, run R; the H100's candidates run measured the forwards 0.319 and 0.325, a tie)")],
    "key padding": [
        Measured({"fa4 mask_mod": 0.490, "triton": 0.615, "fa4": 0.903},
                 {"fa4 mask_mod": 1.492, "fa4": 1.595, "triton": 2.057}, "ms",
                 "bench kernels --candidates, Llama-shaped B2 S4096, a row right-padded by 1/8", up_to=4096),
        Measured({"fa4": 1.826, "fa4 mask_mod": 1.994}, {"fa4": 5.099, "fa4 mask_mod": 5.369}, "ms",
                 "Llama-shaped B2 S8192, a row right-padded by 1/8, each path called directly (BENCHMARKS.md)"),
    ],
    "packed documents": [Measured({"fa4": 644, "triton": 407}, {"fa4": 448, "triton": 246}, "TFLOP/s",
                                  "run D, varlen: 9 documents to 32K, MLA 16h")],
}


def problem_class(p: Problem, packed: bool = False) -> str:
    """The class of ``p`` (``packed``: documents given as cumulative lengths, a varlen call)."""
    if packed:
        return "packed documents, window or softcap" if p.windowed or p.softcapped else "packed documents"
    if p.has_mask:
        return "tensor mask"
    if p.softcapped:
        return "document ids, softcap" if p.has_documents else "softcap"
    if p.has_documents or p.has_key_padding:
        kind = "document ids" if p.has_documents else "key padding"
        return f"{kind}, window" if p.windowed else kind
    if p.offset:
        return "position offset"
    return "window" if p.windowed else "dense"


def measured(p: Problem, packed: bool = False) -> Optional[Measured]:
    """The row that orders the kernels for ``p``, or None."""
    rows = TABLE.get(problem_class(p, packed), [])
    return next((row for row in rows if row.up_to is None or p.s_k <= row.up_to), None)


def ranked(kernels: tuple, p: Problem, packed: bool = False) -> tuple:
    """``kernels`` (each with a ``name``) in the order the dispatch tries them for ``p``."""
    return _ranked(kernels, measured(p, packed), p.backward)


@functools.lru_cache(maxsize=None)
def _ranked(kernels, row, backward):
    if row is None:
        return kernels
    known = [kernel for kernel in kernels if row.speed(kernel.name, backward) is not None]
    known.sort(key=lambda kernel: row.speed(kernel.name, backward), reverse=True)
    return tuple(known) + tuple(kernel for kernel in kernels if kernel not in known)
