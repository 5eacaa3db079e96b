"""A kernel as dispatch.py sees it: a name for ``explain`` and the ranking, ``supports(problem)``,
and the forward and backward it runs. A module's kernel functions stay plain functions; this names
them once (``aten.py`` writes its kernels as classes of the same four attributes)."""
from typing import Callable, NamedTuple


class Kernel(NamedTuple):
    name: str
    supports: Callable
    forward: Callable
    backward: Callable
