"""How often a plan of tiles computes each (query, key) pair: the check every tile planner test
makes (each visible pair exactly once, nothing else)."""
import torch

from attn_compile.kernels.visibility import effective_window, visible


def covered(tiles, q_index, k_index, size):
    """(size, size) counts by the global index of each buffer row (``q_index``, ``k_index``);
    masked tiles see the pairs their offsets make visible, as the kernels do."""
    count = torch.zeros(size, size, dtype=torch.long)
    for tile in tiles:
        q, k = q_index[tile.q_rows], k_index[tile.k_rows]
        seen = torch.ones(len(q), len(k), dtype=torch.bool)
        if tile.masking:
            mask = tile.masking
            seen = visible(torch.arange(len(q)) + mask["q_offset"], torch.arange(len(k)) + mask["k_offset"],
                           *effective_window(mask["is_causal"], mask["window"]))
        count[q[:, None], k[None, :]] += seen.long()
    return count
