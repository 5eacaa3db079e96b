"""The ``attn_cp`` torch.compile backend: rewrite attention, then hand the graph to an inner compiler.

Registered through the ``torch_dynamo_backends`` entry point (pyproject.toml), so
``torch.compile(model, backend="attn_cp")`` works without importing this package first.
"""
import torch

from .passes import rewrite_attention

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
DEFAULT_OPTIONS = {"inner": "inductor"}


def parse_options(options) -> dict:
    options = dict(options or {})
    unknown = sorted(set(options) - set(DEFAULT_OPTIONS))
    if unknown:
        raise ValueError(f"unknown attn_cp option(s) {unknown}; valid options: {sorted(DEFAULT_OPTIONS)}")
    merged = {**DEFAULT_OPTIONS, **options}
    if merged["inner"] not in INNER_COMPILERS:
        raise ValueError(f"options['inner'] must be one of {INNER_COMPILERS}; got {merged['inner']!r}")
    return merged


def _inner_compile(gm, example_inputs, inner: str, mode):
    if mode is not None and inner != "inductor":
        raise ValueError(f"mode={mode!r} applies to the inductor inner compiler only; got inner={inner!r}")
    if inner == "eager":
        return gm.forward
    if inner == "aot_eager":
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
    from torch._inductor.compile_fx import compile_fx

    patches = torch._inductor.list_mode_options(mode) if mode is not None else {}
    return compile_fx(gm, example_inputs, config_patches=patches)


def attn_cp(gm, example_inputs, *, mode=None, options=None):
    """torch.compile backend. ``options={"inner": "inductor" | "aot_eager" | "eager"}``."""
    opts = parse_options(options)
    rewrite_attention(gm)
    return _inner_compile(gm, example_inputs, opts["inner"], mode)
