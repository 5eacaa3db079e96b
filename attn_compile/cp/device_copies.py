"""Index tensors built on the host once per plan, copied to a device once, and kept for the next
calls in one small LRU.

A host-to-device copy of every row's index on every call costs more than the gather it serves, so
the copies are kept. They are not kept on the plans themselves: the plans' own caches outlive a
training run's batches (a new packing per batch), and copies kept with each would hold GPU memory
for every packing seen (24 bytes per token per sharding). The copies are built outside inference
mode, so that a first call under ``torch.inference_mode()`` (an evaluation) does not leave
inference tensors that a later differentiable call must save for its backward.
"""
from collections import OrderedDict
from typing import Callable

import torch

LIMIT = 128  # entries: a step's shardings and packed calls (segments, query rows), forward and backward, 8 ranks
_copies: OrderedDict = OrderedDict()


def on_device(owner, name: str, device, build: Callable[[], tuple]) -> tuple:
    """``build()``'s host tensors (a tuple; None entries stay None) on ``device``, built and copied on
    the first call for (owner, name, device) and reused while the entry stays among the last LIMIT."""
    key = (id(owner), name, torch.device(device))
    if key in _copies:
        _copies.move_to_end(key)
    else:
        with torch.inference_mode(False):
            copies = tuple(None if x is None else x.to(device) for x in build())
        _copies[key] = (owner, copies)  # the owner stays alive with its entry, so its id is not reused
        if len(_copies) > LIMIT:
            _copies.popitem(last=False)
    return _copies[key][1]
