"""Throughput of the dispatched op (``op``) and of the Triton kernels beside cuDNN SDPA, flash
SDPA, FlashAttention-4 called directly and compiled flex_attention, forward and backward, on one
GPU, in bf16. q, k, v are transposed views of (B, S, H, D) projections, as models hand them over.

TFLOP/s count useful work: 2 * B * H_q * (visible query-key pairs) * (d_qk + d_v) for the
forward, 2.5 times that for the backward (causal S x S counts S(S+1)/2 pairs, within 0.01% of
the S^2/2 of ../shared/BASELINES.md); a padded batch counts every pair its mask leaves
visible, padded query rows included, which the op computes (FA4 called directly with
``seqused`` computes the real rows only). Times are medians of triton.testing.do_bench. The SDPA
backends run the shapes SDPA can express; flex_attention runs the others (on the rest cuDNN is
the peer to beat; ``--flex-everywhere`` adds them, at a minute of compiling each). A peer that
cannot express a shape shows '-'; one that fails shows 'ERR'.

``--candidates`` times instead every fused kernel the dispatch may choose for each shape, each
called directly, in ms per call (host time included: a short call is bound by it), and prints
the order that ``ranking.py`` gives the dispatch beside the measured one: the command that
reproduces its figures and shows where they no longer hold.

    python -m attn_compile.kernels.bench_kernels [--peers cudnn,flash,fa4,flex] [--flex-everywhere]
                                                 [--only NAME ...] [--plot out.png] [--candidates]
"""
import argparse
import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from . import dispatch, fa4, ranking, triton_attention
from .problem import Problem
from .visibility import effective_window


@dataclass(frozen=True)
class Shape:
    name: str
    h_q: int
    h_kv: int
    s: int
    d_qk: int = 128
    d_v: int = 128
    is_causal: bool = True
    window: tuple = (-1, -1)
    q_offset: int = 0
    k_offset: int = 0
    documents: tuple = ()  # varlen: packed documents of these lengths, summing to s
    ids: bool = False  # the documents as (1, s) ids to the dense kernels instead of cumulative lengths
    softcap: float = 0.0  # scores capped as softcap * tanh(s / softcap) (Gemma 2)
    padding: tuple = ()  # a padded batch: each row's real tokens, one run
    left: bool = False  # the runs end the rows (left padding) instead of starting them

    @property
    def batch(self) -> int:
        return len(self.padding) or 1

    @property
    def plain(self) -> bool:
        """Expressible by SDPA's is_causal alone."""
        return (self.window == (-1, -1) and self.q_offset == self.k_offset and not self.documents and not self.softcap
                and not self.padding)

    def pairs(self) -> int:
        """Visible query-key pairs: every query row's, padded rows included (they see the real keys
        their band reaches, as eager SDPA gives them)."""
        if self.documents:
            return sum(Shape("", 1, 1, n, is_causal=self.is_causal, window=self.window).pairs() for n in self.documents)
        return sum(self._pairs_with_keys(start, end) for start, end in self.runs())

    def runs(self) -> list:
        """Each batch row's real tokens as positions [start, end): the whole row without padding."""
        return [(self.s - n, self.s) if self.left else (0, n) for n in self.padding] or [(0, self.s)]

    def _pairs_with_keys(self, start, end) -> int:
        """Pairs of the band whose key lies in [start, end) of the row."""
        left, right = effective_window(self.is_causal, self.window)
        i = torch.arange(self.s, dtype=torch.int64) + self.q_offset
        lo, hi = self.k_offset + start, self.k_offset + end - 1
        first = (i - left).clamp(min=lo) if left != -1 else torch.full_like(i, lo)
        last = (i + right).clamp(max=hi) if right != -1 else torch.full_like(i, hi)
        return int((last - first + 1).clamp(min=0).sum())

    def flops(self) -> float:
        return 2.0 * self.h_q * self.pairs() * (self.d_qk + self.d_v)


S = 8192
DOCUMENTS = (8192, 4096, 6144, 2048, 1024, 512, 7168, 1536, 2048)
SHAPES = (
    Shape("MHA 32h d128 causal", 32, 32, S),
    Shape("MHA 32h d128 full", 32, 32, S, is_causal=False),
    Shape("GQA 32/8 d128 causal", 32, 8, S),
    Shape("MLA 16h 192/128 causal", 16, 16, S, 192, 128),
    Shape("GQA+MLA 64/4 192/128 causal S4K", 64, 4, 4096, 192, 128),
    Shape("window 1024 32h d128", 32, 32, S, window=(1023, -1)),
    Shape("varlen 9 docs 32K MLA 16h 192/128", 16, 16, sum(DOCUMENTS), 192, 128, documents=DOCUMENTS),
    Shape("the same 9 docs as document ids", 16, 16, sum(DOCUMENTS), 192, 128, documents=DOCUMENTS, ids=True),
    Shape("128 docs of 256 as document ids, GQA 32/8 d128", 32, 8, 32768, documents=(256,) * 128, ids=True),
    Shape("ring step: causal, offset half a tile", 32, 32, S, q_offset=S + 64, k_offset=S),
    Shape("MHA 32h d128 causal, softcap 50", 32, 32, S, softcap=50.0),
    Shape("Gemma 2: GQA 16/8 d256, window 4096, softcap 50", 16, 8, S, 256, 256, window=(4095, -1), softcap=50.0),
    Shape("right-padded B4 GQA 32/8 d128 causal", 32, 8, S, padding=(8192, 6000, 7000, 3000)),
    Shape("left-padded B4 GQA 32/8 d128 causal", 32, 8, S, padding=(8192, 6000, 7000, 3000), left=True),
    Shape("Llama-shaped B2 S4096, a row right-padded by 1/8", 32, 8, 4096, padding=(4096, 3584)),
    Shape("Llama-shaped B2 S8192, a row right-padded by 1/8", 32, 8, S, padding=(8192, 7168)),
    Shape("Mistral-shaped B2 S4096, window 1023, a row right-padded by 1/8", 32, 8, 4096, window=(1023, -1),
          padding=(4096, 3584)),
)


def _inputs(shape: Shape):
    """q, k, v, dout in (B, H, S, D), bf16, random: transposed views of (B, S, H, D) tensors."""
    def randn(h, d):
        x = torch.randn(shape.batch, shape.s, h, d, device="cuda", dtype=torch.bfloat16)
        return x.transpose(1, 2).requires_grad_()

    return randn(shape.h_q, shape.d_qk), randn(shape.h_kv, shape.d_qk), randn(shape.h_kv, shape.d_v), \
        randn(shape.h_q, shape.d_v).detach()


def _key_padding(shape):
    """(B, S) bool, True on each row's run of real tokens."""
    positions = torch.arange(shape.s, device="cuda")
    start, end = torch.tensor(shape.runs(), device="cuda").T[..., None]
    return (positions >= start) & (positions < end)


def _document_ids(shape):
    """(s,) the document of each position."""
    lengths = torch.tensor(shape.documents, device="cuda")
    return torch.repeat_interleave(torch.arange(len(shape.documents), device="cuda"), lengths)


def _kernels(kernels):
    """(forward, backward) of a module with the kernel interface: triton_attention or the dispatch."""
    def make(shape, q, k, v):
        return _calls(kernels, shape, q, k, v)
    return make


def _packed(shape) -> bool:
    """Documents given as cumulative lengths: a varlen call."""
    return bool(shape.documents) and not shape.ids


def _masking(shape) -> dict:
    """The shape's mask arguments (packed documents: the causal mask, window and softcap only)."""
    masking = dict(is_causal=shape.is_causal, window=shape.window, softcap=shape.softcap)
    if not _packed(shape):
        masking.update(q_offset=shape.q_offset, k_offset=shape.k_offset)
        if shape.padding:
            masking["key_padding_mask"] = _key_padding(shape)
        if shape.ids:
            masking["document_ids"] = _document_ids(shape)[None]
    return masking


def _calls(kernels, shape, q, k, v):
    masking = dict(_masking(shape), scale=shape.d_qk ** -0.5)
    q, k, v = (x.detach() for x in (q, k, v))
    if _packed(shape):
        cu = torch.tensor((0, *shape.documents), device="cuda").cumsum(0).int()
        lengths = (cu, cu, max(shape.documents), max(shape.documents))
        q, k, v = (x[0].transpose(0, 1).contiguous() for x in (q, k, v))  # packed (total, H, D)

        def forward():
            return kernels.varlen_forward(q, k, v, *lengths, **masking)

        def backward(dout, out, lse):
            return kernels.varlen_backward(dout, q, k, v, out, lse, *lengths, **masking)
    else:
        def forward():
            return kernels.attention_forward(q, k, v, **masking)

        def backward(dout, out, lse):
            return kernels.attention_backward(dout, q, k, v, out, lse, **masking)
    return forward, backward


OURS = {"op": _kernels(dispatch), "triton": _kernels(triton_attention)}


def _sdpa(backend):
    def make(shape, q, k, v):
        def forward():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=shape.is_causal, scale=shape.d_qk ** -0.5,
                                                      enable_gqa=shape.h_q != shape.h_kv)
        return forward
    return make


def _flex(shape, q, k, v):
    import torch._functorch.config
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    left, right = effective_window(shape.is_causal, shape.window)
    shift = shape.k_offset - shape.q_offset
    document = None
    if shape.documents:
        document = _document_ids(shape)

    def visible(b, h, q_idx, kv_idx):
        dist = kv_idx + shift - q_idx
        ok = q_idx >= 0
        if right != -1:
            ok = ok & (dist <= right)
        if left != -1:
            ok = ok & (dist >= -left)
        if document is not None:
            ok = ok & (document[q_idx] == document[kv_idx])
        return ok

    def capped(score, b, h, q_idx, kv_idx):
        return shape.softcap * torch.tanh(score / shape.softcap)

    padding = _key_padding(shape) if shape.padding else None

    def visible_unpadded(b, h, q_idx, kv_idx):
        return visible(b, h, q_idx, kv_idx) & padding[b, kv_idx]

    mask = visible_unpadded if shape.padding else visible
    block_mask = create_block_mask(mask, shape.batch if shape.padding else None, None, shape.s, shape.s)
    torch._functorch.config.donated_buffer = False  # the backward is timed again and again, with retain_graph
    # each shape compiled afresh and static: a recompile would otherwise make the shape dynamic,
    # and the peer's speed would depend on the shapes run before it (ring step: 359 or 392 fwd)
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)

    def forward():
        return compiled(q, k, v, score_mod=capped if shape.softcap else None, block_mask=block_mask,
                        scale=shape.d_qk ** -0.5, enable_gqa=shape.h_q != shape.h_kv)
    return forward


def _fa4(shape, q, k, v):
    """FlashAttention-4 as a user calls it: flash_attn_func on (B, S, H, D), or flash_attn_varlen_func
    on packed documents (document ids included) and on a padded batch (its rows' runs as
    cu_seqlens with seqused, computing the real rows only); out comes back as a (B, H, S, D) view."""
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    options = dict(softmax_scale=shape.d_qk ** -0.5, softcap=shape.softcap)
    bshd = [x.transpose(1, 2) for x in (q, k, v)]
    sides = fa4.window_sides(shape.is_causal, shape.window, shape.s, shape.s, shape.k_offset - shape.q_offset)
    if shape.documents:
        cu = torch.tensor((0, *shape.documents), device="cuda").cumsum(0).int()
        packed = [x.flatten(0, 1) for x in bshd]
        longest = max(shape.documents)

        def forward():
            out = flash_attn_varlen_func(*packed, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                         max_seqlen_k=longest, window_size=sides, **options)[0]
            return out[None].transpose(1, 2)
    elif shape.padding:
        lengths = torch.tensor(shape.padding, device="cuda", dtype=torch.int32)
        rows = [b * shape.s + start for b, (start, _) in enumerate(shape.runs())] + [shape.batch * shape.s]
        starts = torch.tensor(rows, device="cuda", dtype=torch.int32)  # each run's first packed row
        packed = [x.flatten(0, 1) for x in bshd]

        def forward():
            out = flash_attn_varlen_func(*packed, cu_seqlens_q=starts, cu_seqlens_k=starts, seqused_q=lengths,
                                         seqused_k=lengths, max_seqlen_q=shape.s, max_seqlen_k=shape.s,
                                         window_size=sides, **options)[0]
            return out.unflatten(0, (shape.batch, shape.s)).transpose(1, 2)
    else:
        def forward():
            return flash_attn_func(*bshd, window_size=sides, **options)[0].transpose(1, 2)
    return forward


PEERS = {"cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION), "flash": _sdpa(SDPBackend.FLASH_ATTENTION), "fa4": _fa4,
         "flex": _flex}


def _median_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _runs(peer, shape, flex_everywhere):
    """The SDPA backends take the shapes is_causal expresses, FA4 every shape, flex_attention the
    others."""
    if peer == "fa4":
        return True
    return (flex_everywhere or not shape.plain) if peer == "flex" else shape.plain


def _error(error) -> str:
    return f"ERR {type(error).__name__}: {str(error).splitlines()[0][:60]}"


def _measure_peer(make, shape, q, k, v, dout):
    """(fwd ms, bwd ms); a direction that fails holds its error message instead: a peer's
    failure is a result to report, not a reason to stop."""
    try:
        forward = make(shape, q, k, v)
        out = forward()
        fwd = _median_ms(forward)
    except Exception as error:
        return _error(error), _error(error)
    try:
        return fwd, _median_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
    except Exception as error:
        return fwd, _error(error)


def measure(shape: Shape, peers, flex_everywhere=False):
    """{kernel: None where it does not run the shape, else (fwd, bwd) TFLOP/s or error strings}."""
    torch.manual_seed(0)
    q, k, v, dout = _inputs(shape)
    packed_dout = dout[0].transpose(0, 1).contiguous() if shape.documents and not shape.ids else dout
    times = {}
    for name, make in OURS.items():
        forward, backward = make(shape, q, k, v)
        out, lse = forward()
        times[name] = (_median_ms(forward), _median_ms(lambda: backward(packed_dout, out, lse)))
        del out, lse
    for name in peers:
        times[name] = _measure_peer(PEERS[name], shape, q, k, v, dout) if _runs(name, shape, flex_everywhere) else None
    flops = (shape.flops(), 2.5 * shape.flops())
    return {name: None if t is None else tuple(f / ms / 1e9 if isinstance(ms, float) else ms for f, ms in zip(flops, t))
            for name, t in times.items()}


def candidates(problem: Problem, packed=False):
    """[(kernel, takes the forward, takes the backward)] for every fused kernel that takes
    ``problem`` in one direction or both, in the order the dispatch tries them for the forward."""
    kernels = dispatch.FUSED_VARLEN if packed else dispatch.FUSED
    backward = dataclasses.replace(problem, backward=True)
    taken = [(kernel, kernel.supports(problem), kernel.supports(backward))
             for kernel in ranking.ranked(kernels, problem, packed)]
    return [entry for entry in taken if entry[1] or entry[2]]


def measure_candidates(shape: Shape):
    """{kernel name: (fwd ms, bwd ms)}, None for a direction the kernel does not take; each
    backward from the dispatched forward's out and LSE (every kernel takes the same LSE)."""
    torch.manual_seed(0)
    q, k, v, dout = _inputs(shape)
    dout = dout[0].transpose(0, 1).contiguous() if _packed(shape) else dout
    problem = Problem.of(q, k, v, **_masking(shape))
    out, lse = _calls(dispatch, shape, q, k, v)[0]()
    results = {}
    for kernel, takes_forward, takes_backward in candidates(problem, _packed(shape)):
        entries = SimpleNamespace(attention_forward=kernel.forward, attention_backward=kernel.backward,
                                  varlen_forward=kernel.forward, varlen_backward=kernel.backward)
        forward, backward = _calls(entries, shape, q, k, v)
        results[kernel.name] = (_median_ms(forward) if takes_forward else None,
                                _median_ms(lambda: backward(dout, out, lse)) if takes_backward else None)
    return problem, results


def candidates_table(rows) -> str:
    """Per shape and kernel, fwd / bwd ms; per shape and direction, the dispatch's kernel and the
    fastest measured one."""
    lines = []
    for shape, problem, results in rows:
        lines.append(shape.name)
        lines += [f"  {name:14s} " + " / ".join("-" if ms is None else f"{ms:.3f}" for ms in times) + " ms"
                  for name, times in results.items()]
        for index, direction in enumerate(("forward", "backward")):
            timed = {name: times[index] for name, times in results.items() if times[index] is not None}
            chosen = dispatch.kernel_name(dataclasses.replace(problem, backward=bool(index)), _packed(shape))
            fastest = min(timed, key=timed.get) if timed else None
            verdict = "agrees" if chosen == fastest else "DIFFERS"
            lines.append(f"  {direction}: the dispatch runs {chosen}, fastest measured {fastest}: {verdict}")
    return "\n".join(lines)


def _rate(result, index):
    """TFLOP/s of one direction, or None where the kernel did not run or failed."""
    value = None if result is None else result[index]
    return None if isinstance(value, str) else value


def _cell(result, index):
    if result is None:
        return "-"
    return "ERR" if _rate(result, index) is None else f"{result[index]:.0f}"


def _ratio(results, index):
    """The op against the best peer (the Triton kernels are part of the op, not a peer)."""
    peers = [_rate(r, index) for name, r in results.items() if name not in OURS and _rate(r, index) is not None]
    return f"{results['op'][index] / max(peers):.2f}" if peers else "-"


def table(rows, peers) -> str:
    kernels = [*OURS, *peers]
    head = ["shape", *(f"{k} fwd" for k in kernels), "fwd vs best", *(f"{k} bwd" for k in kernels), "bwd vs best"]
    lines = [head]
    for shape, results in rows:
        lines.append([shape.name, *(_cell(results[k], 0) for k in kernels), _ratio(results, 0),
                      *(_cell(results[k], 1) for k in kernels), _ratio(results, 1)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = [" | ".join(cell.ljust(w) for cell, w in zip(line, widths)) for line in lines]
    text.insert(1, "-|-".join("-" * w for w in widths))
    errors = [f"{shape.name} / {kernel} {direction}: {value}" for shape, results in rows
              for kernel, result in results.items() if result is not None
              for direction, value in zip(("fwd", "bwd"), result) if isinstance(value, str)]
    return "\n".join(text + errors)


def plot(rows, peers, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kernels = [*OURS, *peers]
    fig, axes = plt.subplots(1, 2, figsize=(16, 6), sharey=True)
    width = 0.8 / len(kernels)
    for index, (axis, title) in enumerate(zip(axes, ("forward", "backward"))):
        for n, kernel in enumerate(kernels):
            values = [_rate(r[kernel], index) or 0.0 for _, r in rows]
            axis.bar([i + n * width for i in range(len(rows))], values, width, label=kernel)
        axis.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [s.name for s, _ in rows], rotation=60,
                        ha="right", fontsize=7)
        axis.set_title(f"{title}, TFLOP/s")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _chosen(shape):
    """The kernel the dispatch picks for the shape (forward, and backward where it differs), from
    the shape's metadata: q, k, v are broadcast views of one element each."""
    def view(h, d):
        return torch.empty(1, 1, 1, 1, device="cuda", dtype=torch.bfloat16).expand(shape.batch, h, shape.s, d)

    problem = Problem.of(view(shape.h_q, shape.d_qk), view(shape.h_kv, shape.d_qk), view(shape.h_kv, shape.d_v),
                         **_masking(shape))
    return described(problem, _packed(shape))


def described(problem, packed=False) -> str:
    """What the dispatch runs ``problem`` on, as ``explain`` says it; 'varlen ...' for packed
    documents."""
    return ("varlen " if packed else "") + dispatch.describe(problem, packed)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m attn_compile.bench kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="cudnn,flash,fa4,flex", help="comma-separated subset of " + ",".join(PEERS))
    parser.add_argument("--flex-everywhere", action="store_true", help="run flex_attention on SDPA's shapes too")
    parser.add_argument("--only", nargs="*", default=(), help="run only shapes whose name contains one of these")
    parser.add_argument("--plot", help="also draw the table into this PNG (needs matplotlib)")
    parser.add_argument("--candidates", action="store_true",
                        help="time every kernel the dispatch may choose per shape, against ranking.py's order")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (torch.cuda.is_available() is False here)")
    peers = [p for p in args.peers.split(",") if p]
    unknown = set(peers) - set(PEERS)
    if unknown:
        parser.error(f"--peers: unknown {sorted(unknown)}")
    fa4_version = "absent" if fa4.interface() is None else __import__("importlib.metadata").metadata.version(
        "flash-attn-4")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", __import__("triton").__version__,
          "flash-attn-4", fa4_version)
    shapes = [shape for shape in SHAPES if not args.only or any(word in shape.name for word in args.only)]
    if args.candidates:
        rows = []
        for shape in shapes:
            rows.append((shape, *measure_candidates(shape)))
            print(candidates_table(rows[-1:]), flush=True)
            torch.cuda.empty_cache()
        return
    print("op kernels:", "; ".join(f"{shape.name}: {_chosen(shape)}" for shape in shapes))
    rows = []
    for shape in shapes:
        results = measure(shape, peers, args.flex_everywhere)
        rows.append((shape, results))
        print(shape.name, "fwd/bwd:", ", ".join(f"{k} {_cell(r, 0)}/{_cell(r, 1)}" for k, r in results.items()),
              flush=True)
        torch.cuda.empty_cache()
    print(table(rows, peers))
    if args.plot:
        plot(rows, peers, args.plot)


if __name__ == "__main__":
    main()
