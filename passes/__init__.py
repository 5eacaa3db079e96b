"""FX passes that find attention in dynamo graphs and rewrite it into attn_cp ops."""
import logging

from torch.fx import GraphModule

from .sdpa import rewrite_sdpa
from .site import Site

log = logging.getLogger("attn_compile")


def rewrite_attention(gm: GraphModule) -> list[Site]:
    """Rewrite every attention site of ``gm`` in place; one Site per site found, logged."""
    sites = rewrite_sdpa(gm)
    for site in sites:
        log.info("%s %s", "rewrote" if site.rewritten else "left", site)
    return sites


__all__ = ["rewrite_attention", "Site"]
