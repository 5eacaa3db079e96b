"""torchtitan 0.3.0, installed once into a cache folder for the tests that run its Llama 3 debug model.

torchtitan's declared dependencies (datasets, wandb, tensorboard, torchdata, ...) serve its
trainer; building and running its models needs only these wheels, so they are installed with
``--no-deps`` (the torch already installed is never touched) into a folder of their own, which is
appended to ``sys.path``: packages already installed take precedence.
"""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from attn_compile.bench_models import TITAN_PACKAGES as PACKAGES

# torchtitan 0.3.0 imports torch.distributed APIs that torch 2.11 does not have
needs_its_torch = pytest.mark.skipif(torch.__version__ < "2.12", reason="torchtitan 0.3.0 needs torch >= 2.12")


def _cache_root() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "attn_compile")


def install() -> str:
    """The folder holding the packages, installed on the first call (a pip download); on sys.path."""
    site = os.path.join(_cache_root(), "torchtitan-0.3.0")
    if not os.path.exists(os.path.join(site, "installed")):
        os.makedirs(_cache_root(), exist_ok=True)
        staging = tempfile.mkdtemp(dir=_cache_root())
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", staging,
                        *PACKAGES], check=True)
        open(os.path.join(staging, "installed"), "w").close()
        try:
            os.rename(staging, site)
        except OSError:  # another process installed it first
            shutil.rmtree(staging, ignore_errors=True)
    add_to_path(site)
    return site


def add_to_path(site: str) -> None:
    if site not in sys.path:
        sys.path.append(site)
