"""``attn_compile.explain``: what the backend does to each attention site of a model."""
import dataclasses

import torch

from .passes import Site, rewrite_attention


@dataclasses.dataclass
class Report:
    sites: list[Site]

    @property
    def rewritten(self) -> list[Site]:
        return [s for s in self.sites if s.rewritten]

    @property
    def left(self) -> list[Site]:
        return [s for s in self.sites if not s.rewritten]

    def __str__(self) -> str:
        head = (f"attn_compile: {len(self.sites)} attention site(s), {len(self.rewritten)} rewritten, "
                f"{len(self.left)} left as is")
        return "\n".join([head] + [f"  [{i}] {site}" for i, site in enumerate(self.sites)])


def explain(model_or_fn, *args, **kwargs) -> Report:
    """Trace ``model_or_fn(*args, **kwargs)`` with dynamo, run the attn_cp passes, and report each
    site: where it is, its shapes, and what it became (op and kernel) or why it was left. The call
    runs once, eagerly on the rewritten graphs; the user's own compiled functions are untouched."""
    sites: list[Site] = []

    def recording_backend(gm, example_inputs):
        sites.extend(rewrite_attention(gm))
        return gm.forward

    torch.compile(model_or_fn, backend=recording_backend)(*args, **kwargs)
    return Report(sites)
