"""One attention site found in a graph, and what became of it."""
import dataclasses
import os
import re
from typing import Optional

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


@dataclasses.dataclass
class Site:
    node: str  # the graph node's name
    location: str  # module path and source line, where dynamo recorded them
    shapes: dict  # "q"/"k"/"v"/"attn_mask"/"key_padding_mask" -> shape (hinted ints under dynamic shapes)
    rewritten: bool
    reason: str = ""  # why the site was left as it was
    op: Optional[str] = None  # what it became
    kernel: Optional[str] = None  # the kernel the op dispatches to, for the traced shapes
    notes: list[str] = dataclasses.field(default_factory=list)  # what the refining passes did, or why not

    def __str__(self) -> str:
        shapes = " ".join(f"{name}{tuple(shape)}" for name, shape in self.shapes.items())
        outcome = f"-> {self.op} [{self.kernel}]" if self.rewritten else f"left as is: {self.reason}"
        notes = f" ({'; '.join(self.notes)})" if self.notes else ""
        return f"{self.location or self.node}: {shapes} {outcome}{notes}"


def _module_name(path: str) -> str:
    """Dynamo's source of a module ("L['self'].blocks.0", "G['blocks'].0") as ``named_modules()``
    names it: a local (the compiled module or an argument) is the model itself, so its name is
    dropped; a global module keeps its own name as the first part ("blocks.0")."""
    path = re.sub(r"^L\['[^']+'\]\.?", "", path)
    return re.sub(r"^G\['([^']+)'\]", r"\1", path)


def location_of(node) -> str:
    """'layers.0.attn @ model.py:42' from dynamo's node metadata (either part may be missing); the
    line is the innermost one outside torch (a varlen_attn call's, not the line in torch that
    calls the op)."""
    modules = node.meta.get("nn_module_stack") or {}
    module = ""
    if modules:
        module = _module_name(list(modules.values())[-1][0])
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    line = ""
    for entry in reversed(trace):
        entry = entry.strip()
        if entry.startswith("File ") and not entry[len("File "):].strip('"').startswith(_TORCH_DIR):
            path, _, rest = entry[len("File "):].partition(", line ")
            line = f"{path.strip(chr(34)).rsplit('/', 1)[-1]}:{rest.split(',')[0]}"
            break
    return " @ ".join(part for part in (module, line) if part)
