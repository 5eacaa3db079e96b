"""Which keys a query may see, from global positions alone.

Query i (global position) sees key j when ``i - left <= j <= i + right``; ``-1`` leaves a
side unbounded. ``is_causal`` (SDPA's top-left alignment, ``j <= i``) is the window's right
edge at 0. Every kernel and every context-parallel step decides masking through this file.
"""
import enum

import torch

UNBOUNDED = -1


class Visibility(enum.Enum):
    NONE = "none"  # no query sees any key: skip the block
    FULL = "full"  # every query sees every key: no mask needed
    PARTIAL = "partial"


def mask_bytes(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask or bool document ids as their uint8 bytes (a view; the kernels read no bool
    tensor), any other ids as they are."""
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def effective_window(is_causal: bool, window: tuple[int, int]) -> tuple[int, int]:
    left, right = window
    if is_causal:
        right = 0 if right == UNBOUNDED else min(right, 0)
    return left, right


def classify(q_start: int, q_len: int, k_start: int, k_len: int, left: int, right: int) -> Visibility:
    """Visibility of the block of queries [q_start, q_start+q_len) against keys [k_start, k_start+k_len)."""
    q_last, k_last = q_start + q_len - 1, k_start + k_len - 1
    if q_len == 0 or k_len == 0:
        return Visibility.NONE
    if (right != UNBOUNDED and k_start > q_last + right) or (left != UNBOUNDED and k_last < q_start - left):
        return Visibility.NONE
    if (right == UNBOUNDED or k_last <= q_start + right) and (left == UNBOUNDED or k_start >= q_last - left):
        return Visibility.FULL
    return Visibility.PARTIAL


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """Boolean (len(q_pos), len(k_pos)) matrix: True where the query sees the key."""
    diff = k_pos[None, :] - q_pos[:, None]
    ok = torch.ones_like(diff, dtype=torch.bool)
    if right != UNBOUNDED:
        ok &= diff <= right
    if left != UNBOUNDED:
        ok &= diff >= -left
    return ok
