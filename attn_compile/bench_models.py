"""Benchmark Hugging Face model stacks compiled with backend="attn_cp" against the same compiler
without the attention rewrite (backend="inductor" by default), side by side.

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

Each side, and each side's step, starts from freed memory: without it (and with one timed sample
of a step), the Gemma 2 step at S = 8192, whose baseline peaks at 73 of 80 GB, measured 2x slower
on both sides.

``--tiny`` runs small one-layer shapes on the CPU with a wall-clock median instead: a smoke test. transformers
and triton are imported only when a benchmark runs.
"""
import argparse
import gc
import statistics
import time
from typing import Callable

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


def _measure(compile_fn, model, dims: dict, masking: dict, device, dtype, timer) -> dict:
    """Milliseconds of attention fwd, attention fwd+bwd and the step, for one way of compiling,
    and on the GPU the step's peak memory in GB."""
    _free(device)
    torch.manual_seed(0)
    heads, kv_heads = dims["num_attention_heads"], dims["num_key_value_heads"]
    head_dim = dims.get("head_dim", dims["hidden_size"] // heads)
    seq = masking["position_ids"].shape[1]
    q, k, v = (_as_projected(BATCH, n, seq, head_dim, device, dtype) for n in (heads, kv_heads, kv_heads))
    ids = torch.randint(0, dims["vocab_size"], (BATCH, seq), device=device)

    attention = compile_fn(_hf_attention(model))
    out = attention(q, k, v, masking)
    dout = torch.randn_like(out)
    stack = compile_fn(model)
    params = list(model.parameters())

    def step():
        hidden = stack(input_ids=ids, use_cache=False, **masking).last_hidden_state
        return torch.autograd.grad(hidden.float().square().mean(), params)

    runs = {"attention fwd": lambda: attention(q, k, v, masking),
            "attention fwd+bwd": lambda: torch.autograd.grad(attention(q, k, v, masking), (q, k, v), dout),
            "step fwd+bwd": step}
    times = {}
    for measure, run in runs.items():
        if measure == "step fwd+bwd":
            _free(device)
        run()  # compiles
        times[measure] = timer(run)
    if device.type == "cuda":
        times["step peak GB"] = torch.cuda.max_memory_allocated(device) / 1e9
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attn_compile.bench models", description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU: a smoke test")
    parser.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor",
                        help="the baseline backend, and attn_cp's inner compiler")
    parser.add_argument("--seq", type=int, nargs="+", help="sequence lengths (default 4096 8192; --tiny: 32)")
    parser.add_argument("--models", nargs="+", choices=tuple(SHAPES), default=tuple(SHAPES), help="stacks to run")
    parser.add_argument("--inputs", choices=("padding", "packed"), default="padding",
                        help="padding: an attention mask, a row right-padded; packed: position_ids of packed "
                             "documents, no attention mask")
    parser.add_argument("--checkpointing", action="store_true", help="each layer in an activation checkpoint")
    parser.add_argument("--mode", choices=("reduce-overhead", "max-autotune-no-cudagraphs"),
                        help="torch.compile mode for both sides (reduce-overhead: CUDA graphs, no per-call host time)")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("needs a CUDA device (torch.cuda.is_available() is False here); --tiny runs on the CPU")
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    seqs = args.seq or ([32] if args.tiny else [4096, 8192])
    shapes = TINY_SHAPES if args.tiny else SHAPES
    timer = _timer(device)
    if args.mode is not None and args.compiler != "inductor":
        parser.error(f"--mode applies to --compiler inductor only; got --compiler {args.compiler}")
    backends = {
        args.compiler: lambda fn: torch.compile(fn, backend=args.compiler, mode=args.mode),
        # torch.compile takes a mode or options, not both; with a mode the inner compiler is Inductor, the default
        "attn_cp": lambda fn: (torch.compile(fn, backend="attn_cp", mode=args.mode) if args.mode else
                               torch.compile(fn, backend="attn_cp", options={"inner": args.compiler})),
    }
    print(f"batch {BATCH}, {dtype}, {device}, inputs {args.inputs}, checkpointing {args.checkpointing}, "
          f"mode {args.mode}; times in ms (medians), the step's peak memory in GB; the last column is "
          f"{args.compiler} / attn_cp")
    print(f"{'model':<12}{'layers':>7}{'S':>6}  {'measure':<20}{args.compiler:>12}{'attn_cp':>12}{'speedup':>9}")
    for name in args.models:
        dims = shapes[name]
        for seq in seqs:
            torch._dynamo.reset()
            model = _model(name, dims, seq, device, dtype, args.checkpointing)
            masking = _masking(args.inputs, seq, device)
            report = explain(model, input_ids=torch.randint(0, dims["vocab_size"], (BATCH, seq), device=device),
                             use_cache=False, **masking)
            results = {backend: _measure(compile_fn, model, dims, masking, device, dtype, timer)
                       for backend, compile_fn in backends.items()}
            for measure in results["attn_cp"]:
                base, ours = results[args.compiler][measure], results["attn_cp"][measure]
                print(f"{name:<12}{dims['num_hidden_layers']:>7}{seq:>6}  {measure:<20}"
                      f"{base:>12.3f}{ours:>12.3f}{base / ours:>8.2f}x")
            print(f"{'':<27}{len(report.rewritten)} of {len(report.sites)} attention sites rewritten"
                  + (f"; the first: {report.sites[0]}" if report.sites else ""))
            del model
    return 0
