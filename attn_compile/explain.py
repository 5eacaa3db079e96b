"""``attn_compile.explain``: what the backend does to each attention site of a model."""
import dataclasses

import torch

from .passes import Site, rewrite_attention
from .passes.placements import Distributed, distribute_attention

_UNLIMITED = 1 << 20


@dataclasses.dataclass
class Report:
    sites: list[Site]
    distributed: list[Distributed] = dataclasses.field(default_factory=list)  # ops on DTensor q, k, v

    @property
    def rewritten(self) -> list[Site]:
        return [s for s in self.sites if s.rewritten]

    @property
    def left(self) -> list[Site]:
        return [s for s in self.sites if not s.rewritten]

    def __str__(self) -> str:
        head = (f"attn_compile: {len(self.sites)} attention site(s), {len(self.rewritten)} rewritten, "
                f"{len(self.left)} left as is")
        lines = [head] + [f"  [{i}] {site}" for i, site in enumerate(self.sites)]
        if self.distributed:
            lines.append("distributed by placements (cost-model estimates, fwd + bwd):")
            lines += [f"  {d}" for d in self.distributed]
        return "\n".join(lines)


def explain(model_or_fn, *args, **kwargs) -> Report:
    """Trace ``model_or_fn(*args, **kwargs)`` with dynamo, run the attn_cp passes, and report each
    site: where it is, its shapes, and what it became (op and kernel) or why it was left; for
    DTensor inputs also the placements, every strategy's estimate and the choice. The call runs
    once, eagerly on the rewritten graphs. Dynamo caches each traced graph with the code it came
    from, so every call of explain adds one more to the entries of the model's code that count
    against ``torch._dynamo.config.recompile_limit`` (8) when that code is compiled later;
    ``torch._dynamo.reset()`` clears them. explain itself traces past that limit."""
    report = Report([])
    traced = []

    def recording_backend(gm, example_inputs):
        traced.append(gm)
        sites = rewrite_attention(gm)
        report.sites.extend(sites)
        report.distributed.extend(distribute_attention(gm, sites))
        return gm.forward

    with torch._dynamo.config.patch(recompile_limit=_UNLIMITED, accumulated_recompile_limit=_UNLIMITED):
        torch.compile(model_or_fn, backend=recording_backend)(*args, **kwargs)
    if not traced:
        raise RuntimeError("explain: dynamo ran the call without tracing a graph, so there is nothing to report "
                           "(see dynamo's warnings above; torch._dynamo.reset() clears its caches)")
    return report
