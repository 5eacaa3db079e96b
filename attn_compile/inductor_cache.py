"""Inductor's caches and this package's ops. Inductor caches compiled graphs by their code, its
config and torch's version, not by how a custom op's fake function lays out results; code cached
with one version of attn_compile may assert other strides than another version's ops give. The
inner Inductor compile therefore runs with a no-op post-grad pass whose ``uuid`` (which Inductor
puts in its cache keys) is a hash of this package's source.
"""
import functools
import hashlib
from pathlib import Path

from torch._inductor.custom_graph_pass import CustomGraphPass


@functools.cache
def source_hash() -> str:
    """sha256 of every .py file of attn_compile, attn_compile.passes and attn_compile.kernels."""
    from . import kernels, passes

    digest = hashlib.sha256()
    for package in (Path(__file__).parent, Path(passes.__file__).parent, Path(kernels.__file__).parent):
        for path in sorted(package.rglob("*.py")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


class SourceStamp(CustomGraphPass):
    def __call__(self, graph) -> None:
        pass

    def uuid(self) -> str:
        return source_hash()


def config_patches() -> dict:
    """The stamp, unless the user has a post-grad pass of their own there (then left as it is)."""
    import torch._inductor.config as inductor_config

    if inductor_config.post_grad_custom_post_pass is not None:
        return {}
    return {"post_grad_custom_post_pass": SourceStamp()}
