"""Benchmark Hugging Face (and torchtitan) model stacks compiled with backend="attn_cp" against
the same compiler without the attention rewrite (backend="inductor" by default), side by side.

Stacks: Llama-3-8B-shaped, Mistral-7B-shaped and Gemma-2-9B-shaped (``LlamaModel``,
``MistralModel``, ``Gemma2Model``; random weights, 4 layers, bf16, batch 2, S = 4096 and 8192).
The Mistral stack uses a 1024-token sliding window (the window of ../shared/BASELINES.md). Gemma 2
runs Hugging Face's eager attention, as it must (its scores are softcapped, which SDPA cannot
take), with its own 4096-token window on every other layer; the attention measured is its first
layer's. Inputs (``--inputs``): ``padding``, an attention mask with the second row right-padded
by 1/8; or ``packed``, Hugging Face's training input for packed sequences: position_ids that
restart at each document (row 0: documents of 1/2, 1/4, 1/8 and 1/8 of S; row 1: 3/8 and 5/8),
no attention mask. Measured, as medians of ``triton.testing.do_bench``:

- attention: Hugging Face's own mask construction and SDPA integration (repeat_kv, the explicit
  bool mask; Gemma 2: its eager attention function) on (B, H, S, D) q, k, v laid out as the
  model's projections give them (transposed (B, S, H, D) memory), forward and forward+backward;
- step: the whole stack, forward and backward of a mean-square loss of its output (with
  ``--checkpointing``, each layer in an activation checkpoint, recomputed in the backward), and
  on the GPU its peak memory.

``titan-llama3`` (run only when named; needs torchtitan 0.3.0, which needs torch >= 2.12) is
torchtitan's own Llama 3 8B, its first 4 layers, parameters in bf16 (its debug model's first 2
with ``--tiny``), with packed documents (the rows above) through ``positions``, its masks built
from them outside the model as its trainer builds them (untimed). Three sides: its varlen backend
(``varlen_attn`` on aten's own FlashAttention 2, not the FA3 or FA4 torchtitan switches aten to
where their packages are installed) and its default flex backend
(the BlockMask of its packed-document mask_mod), both compiled with the baseline compiler, and the
varlen model compiled with attn_cp. The attention measured is layer 0's inner attention on
(B, S, H, D) q, k, v; the step's loss is the mean square of the logits. On the CPU the varlen side
does not run (varlen_attn has no CPU kernel) and the flex side runs its attention forward only
(flex_attention has no CPU backward).

Each side, and each side's step, starts from freed memory: without it (and with one timed sample
of a step), the Gemma 2 step at S = 8192, whose baseline peaks at 73 of 80 GB, measured 2x slower
on both sides.

``--tiny`` runs small one-layer shapes on the CPU with a wall-clock median instead: a smoke test. transformers,
torchtitan and triton are imported only when a benchmark that needs them runs.
"""
import argparse
import gc
import statistics
import time
from typing import Callable, NamedTuple
from unittest import mock

import torch

from .explain import explain

BATCH = 2
SHAPES = {
    "llama3-8b": {"num_hidden_layers": 4, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0},
    "mistral-7b": {"num_hidden_layers": 4, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "vocab_size": 32000, "sliding_window": 1024},
    "gemma2-9b": {"num_hidden_layers": 4, "hidden_size": 3584, "intermediate_size": 14336, "num_attention_heads": 16,
                  "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000, "sliding_window": 4096,
                  "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0},
}
_TINY = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 128}
TINY_SHAPES = {"llama3-8b": _TINY, "mistral-7b": {**_TINY, "sliding_window": 16},
               "gemma2-9b": {**_TINY, "head_dim": 16, "sliding_window": 16, "query_pre_attn_scalar": 16,
                             "attn_logit_softcapping": 50.0}}
TITAN = "titan-llama3"
TITAN_SHAPES = {False: ("8B", 4), True: ("debugmodel", 2)}  # --tiny -> torchtitan's flavor, its first layers
TITAN_PACKAGES = ("torchtitan==0.3.0", "spmd_types==0.2.3", "tyro==1.0.17", "docstring_parser==0.18.0")
MODELS = {  # transformers' config and model classes, and the attention implementation
    "llama3-8b": ("LlamaConfig", "LlamaModel", "sdpa"),
    "mistral-7b": ("MistralConfig", "MistralModel", "sdpa"),
    "gemma2-9b": ("Gemma2Config", "Gemma2Model", "eager"),
}


def _model(name: str, dims: dict, seq: int, device, dtype, checkpointing: bool):
    import transformers

    config_cls, model_cls, attention = MODELS[name]
    config = getattr(transformers, config_cls)(max_position_embeddings=seq, **dims)
    config._attn_implementation = attention
    model = getattr(transformers, model_cls)(config).to(device=device, dtype=dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _hf_attention(model) -> Callable:
    """q, k, v, the inputs' mask arguments -> attention output, through HF's mask and SDPA code for
    this model."""
    from transformers import masking_utils
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    config, module = model.config, model.layers[0].self_attn
    make_mask = (masking_utils.create_sliding_window_causal_mask if getattr(config, "sliding_window", None)
                 else masking_utils.create_causal_mask)
    forward = eager_attention_forward if config._attn_implementation == "eager" else sdpa_attention_forward
    softcap = {"softcap": config.attn_logit_softcapping} if forward is eager_attention_forward else {}

    def attention(q, k, v, masking: dict):
        embeds = q.transpose(1, 2)  # (B, S, ...): the mask helpers read batch, length, dtype and device
        mask = make_mask(config=config, inputs_embeds=embeds, past_key_values=None, **masking)
        return forward(module, q, k, v, mask, scaling=module.scaling, **softcap)[0]
    return attention


def _masking(inputs: str, seq: int, device) -> dict:
    """The model's mask arguments for ``inputs`` (the module docstring): attention_mask and
    position_ids."""
    if inputs == "packed":
        rows = [(4, 2, 1, 1), (3, 5)]  # document lengths in eighths of seq
        positions = [torch.cat([torch.arange(n * seq // 8) for n in row]) for row in rows]
        return {"attention_mask": None, "position_ids": torch.stack(positions).to(device)}
    padding = torch.ones(BATCH, seq, dtype=torch.long, device=device)
    padding[1, seq - seq // 8:] = 0
    return {"attention_mask": padding, "position_ids": torch.arange(seq, device=device)[None]}


def _as_projected(batch, heads, seq, head_dim, device, dtype):
    """A leaf (B, H, S, D) tensor laid out as Hugging Face's attention gets q, k and v: a
    (B, S, H * D) projection viewed as heads and transposed."""
    x = torch.randn(batch, seq, heads, head_dim, device=device, dtype=dtype).transpose(1, 2)
    return x.requires_grad_()


def _timer(device) -> Callable[[Callable], float]:
    if device.type == "cuda":
        from triton.testing import do_bench

        def at_least_ten(fn):  # do_bench's default 100 ms of repetitions is one sample of a 200 ms step
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return do_bench(fn, rep=max(100, 10 * start.elapsed_time(end)), return_mode="median")
        return at_least_ten

    def wall_clock_median(fn, repeats=5):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    return wall_clock_median


def _free(device) -> None:
    """Returns what the caching allocator holds to the GPU and restarts its peak count."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


MEASURES = ("attention fwd", "attention fwd+bwd", "step fwd+bwd")


class Side(NamedTuple):
    """One way of running a stack, as ``_measure`` times it."""

    compile: Callable  # a function or module -> its compiled form
    model: torch.nn.Module
    attention: Callable  # q, k, v, masks -> the model's attention output
    masks: object  # the attention's mask arguments
    qkv: Callable[[], tuple]  # fresh leaf q, k, v, laid out as the model's projections give them
    forward: Callable  # the compiled model -> its output
    measures: tuple = MEASURES  # those it runs here


def _measure(side: Side, device, timer) -> dict:
    """Milliseconds of each of the side's measures (attention fwd, attention fwd+bwd, the step), and
    on the GPU the step's peak memory in GB."""
    _free(device)
    torch.manual_seed(0)
    q, k, v = side.qkv()
    attention = side.compile(side.attention)
    out = attention(q, k, v, side.masks)
    dout = torch.randn_like(out)
    stack = side.compile(side.model)
    params = list(side.model.parameters())

    def step():
        return torch.autograd.grad(side.forward(stack).float().square().mean(), params)

    runs = {"attention fwd": lambda: attention(q, k, v, side.masks),
            "attention fwd+bwd": lambda: torch.autograd.grad(attention(q, k, v, side.masks), (q, k, v), dout),
            "step fwd+bwd": step}
    times = {}
    for measure in side.measures:
        if measure == "step fwd+bwd":
            _free(device)
        runs[measure]()  # compiles
        times[measure] = timer(runs[measure])
    if device.type == "cuda":
        times["step peak GB"] = torch.cuda.max_memory_allocated(device) / 1e9
    return times


class Stack(NamedTuple):
    sides: dict  # name -> Side
    layers: int
    explain: Callable  # () -> the attn_cp side's explain report


def _hf_stack(name: str, dims: dict, seq: int, inputs: str, checkpointing: bool, device, dtype, backends) -> Stack:
    model = _model(name, dims, seq, device, dtype, checkpointing)
    masking = _masking(inputs, seq, device)
    heads, kv_heads = dims["num_attention_heads"], dims["num_key_value_heads"]
    head_dim = dims.get("head_dim", dims["hidden_size"] // heads)
    ids = torch.randint(0, dims["vocab_size"], (BATCH, seq), device=device)

    def qkv():
        return tuple(_as_projected(BATCH, n, seq, head_dim, device, dtype) for n in (heads, kv_heads, kv_heads))

    def forward(stack):
        return stack(input_ids=ids, use_cache=False, **masking).last_hidden_state

    attention = _hf_attention(model)
    return Stack({backend: Side(compile_fn, model, attention, masking, qkv, forward)
                  for backend, compile_fn in backends.items()}, dims["num_hidden_layers"],
                 lambda: explain(model, input_ids=ids, use_cache=False, **masking))


def _torchtitan_llama3():
    """torchtitan's Llama 3 model registry; ImportError names what to install."""
    try:
        from torchtitan.models.llama3 import model_registry
    except ImportError as error:
        raise ImportError(f"--models {TITAN} needs {TITAN_PACKAGES[0]} with torch >= 2.12 (found torch "
                          f"{torch.__version__}): pip install --no-deps {' '.join(TITAN_PACKAGES)} (its other "
                          f"dependencies serve its trainer), or put a folder holding them on PYTHONPATH. "
                          f"Importing it failed: {error}") from error
    return model_registry


def _titan_model(attn_backend: str, tiny: bool, device, dtype):
    """torchtitan's Llama 3 (8B, or its debug model with --tiny), its first layers, random weights,
    parameters in dtype; built as its trainer builds it: on the meta device, then initialised."""
    flavor, layers = TITAN_SHAPES[tiny]
    config = _torchtitan_llama3()(flavor, attn_backend=attn_backend).model
    config.layers = config.layers[:layers]
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the parameters' dtype; RoPE's cache is complex64 whatever it is
    try:  # aten's own FlashAttention 2: torchtitan's switch to FA3 or FA4 needs their packages, and
        # would change every later SDPA call in the process (the other stacks' too)
        with torch.device("meta"), mock.patch("torchtitan.tools.utils.get_cuda_flash_attention_impl",
                                              return_value=None):
            model = config.build()
    finally:
        torch.set_default_dtype(default)
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_states(buffer_device=device)
    return model


def _titan_stack(seq: int, tiny: bool, device, dtype, backends) -> Stack:
    (compiler, compile_fn), (_, attn_cp) = backends.items()
    models = {backend: _titan_model(backend, tiny, device, dtype) for backend in ("varlen", "flex")}
    positions = _masking("packed", seq, device)["position_ids"]
    tokens = torch.randint(0, models["varlen"].config.vocab_size, positions.shape, device=device)
    masks = {backend: model.get_attention_masks(positions)  # as its trainer builds them, outside the model
             for backend, model in models.items()}
    attention = models["varlen"].layers["0"].attention
    shape = (BATCH, seq, attention.n_heads, attention.head_dim)
    kv_shape = (BATCH, seq, attention.n_kv_heads, attention.head_dim)

    def side(compile_fn, backend, measures=MEASURES):
        model = models[backend]

        def qkv():  # flex_attention refuses inputs that require grad where it has no backward
            return tuple(torch.randn(s, device=device, dtype=dtype, requires_grad=measures != MEASURES[:1])
                         for s in (shape, kv_shape, kv_shape))

        def inner_attention(q, k, v, masks):
            return model.layers["0"].attention.inner_attention(
                q, k, v, attention_masks=masks, scale=attention.scaling, enable_gqa=attention.enable_gqa)
        return Side(compile_fn, model, inner_attention, masks[backend], qkv,
                    lambda stack: stack(tokens, positions, attention_masks=masks[backend]), measures)

    on_cpu = device.type == "cpu"  # varlen_attn has no CPU kernel, flex_attention no CPU backward
    return Stack({f"varlen {compiler}": side(compile_fn, "varlen", () if on_cpu else MEASURES),
                  f"flex {compiler}": side(compile_fn, "flex", MEASURES[:1] if on_cpu else MEASURES),
                  "attn_cp": side(attn_cp, "varlen")}, len(models["varlen"].layers),
                 lambda: explain(models["varlen"], tokens, positions, attention_masks=masks["varlen"]))


def _cell(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attn_compile.bench models", description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU: a smoke test")
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor",
                        help="the baseline backend, and attn_cp's inner compiler")
    parser.add_argument("--seq", type=int, nargs="+", help="sequence lengths (default 4096 8192; --tiny: 32)")
    parser.add_argument("--models", nargs="+", choices=(*SHAPES, TITAN), default=tuple(SHAPES),
                        help=f"stacks to run (default: the Hugging Face ones; {TITAN} needs torchtitan)")
    parser.add_argument("--inputs", choices=("padding", "packed"),
                        help="padding (the default): an attention mask, a row right-padded; packed: position_ids of "
                             f"packed documents, no attention mask ({TITAN}: packed only)")
    parser.add_argument("--checkpointing", action="store_true", help="each layer in an activation checkpoint")
    parser.add_argument("--mode", choices=("reduce-overhead", "max-autotune-no-cudagraphs"),
                        help="torch.compile mode for both sides (reduce-overhead: CUDA graphs, no per-call host time)")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("needs a CUDA device (torch.cuda.is_available() is False here); --tiny runs on the CPU")
    if args.mode is not None and args.compiler != "inductor":
        parser.error(f"--mode applies to --compiler inductor only; got --compiler {args.compiler}")
    if TITAN in args.models:
        if args.inputs == "padding" or args.checkpointing:
            parser.error(f"--models {TITAN} takes packed documents (--inputs packed) and no --checkpointing: "
                         "torchtitan's masks come from positions, and its trainer applies checkpointing")
        try:
            _torchtitan_llama3()
        except ImportError as error:
            parser.error(str(error))
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    seqs = args.seq or ([32] if args.tiny else [4096, 8192])
    shapes = TINY_SHAPES if args.tiny else SHAPES
    timer = _timer(device)
    backends = {
        args.compiler: lambda fn: torch.compile(fn, backend=args.compiler, mode=args.mode),
        # torch.compile takes a mode or options, not both; with a mode the inner compiler is Inductor, the default
        "attn_cp": lambda fn: (torch.compile(fn, backend="attn_cp", mode=args.mode) if args.mode else
                               torch.compile(fn, backend="attn_cp", options={"inner": args.compiler})),
    }
    print(f"batch {BATCH}, {dtype}, {device}, inputs {args.inputs or 'padding'} ({TITAN}: packed), checkpointing "
          f"{args.checkpointing}, mode {args.mode}; times in ms (medians), the step's peak memory in GB; each "
          f"'vs' column is that side / attn_cp")
    for name in args.models:
        for seq in seqs:
            torch._dynamo.reset()
            stack = (_titan_stack(seq, args.tiny, device, dtype, backends) if name == TITAN else
                     _hf_stack(name, shapes[name], seq, args.inputs or "padding", args.checkpointing, device, dtype,
                               backends))
            report = stack.explain()
            results = {side_name: _measure(side, device, timer) if side.measures else {}
                       for side_name, side in stack.sides.items()}
            baselines = [side_name for side_name in stack.sides if side_name != "attn_cp"]
            print(f"{'model':<12}{'layers':>7}{'S':>6}  {'measure':<20}" + "".join(f"{s:>16}" for s in stack.sides)
                  + "".join(f"{'vs ' + s.split()[0]:>14}" for s in baselines))
            for measure in results["attn_cp"]:
                ours = results["attn_cp"][measure]
                ratios = [results[b].get(measure) and results[b][measure] / ours for b in baselines]
                print(f"{name:<12}{stack.layers:>7}{seq:>6}  {measure:<20}"
                      + "".join(f"{_cell(results[s].get(measure)):>16}" for s in stack.sides)
                      + "".join(f"{'-' if r is None else f'{r:.2f}x':>14}" for r in ratios))
            print(f"{'':<27}{len(report.rewritten)} of {len(report.sites)} attention sites rewritten"
                  + (f"; the first: {report.sites[0]}" if report.sites else ""))
            del stack
    return 0
