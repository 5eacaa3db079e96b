"""Traced tensor values of graph nodes, read without adding shape guards."""
from typing import NamedTuple

import torch
from torch.fx import Node


class TensorMeta(NamedTuple):
    """What kernel selection reads of a tensor, with sizes as plain ints."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device


def example_value(node: Node):
    return node.meta.get("example_value", node.meta.get("val"))


def _hint(size) -> int:
    return size if isinstance(size, int) else size.node.hint


def hinted_meta(t: torch.Tensor) -> TensorMeta:
    """Sizes are the values traced with (their hints), so reading them installs no guard."""
    return TensorMeta(tuple(_hint(s) for s in t.shape), t.dtype, t.device)
