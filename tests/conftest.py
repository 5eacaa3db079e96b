import os
import shutil
import tempfile

# A fresh Inductor cache for every test session, removed when it ends: a cache left by an older
# checkout of the ops could hand back compiled code that calls them with an outdated schema.
INDUCTOR_CACHE = tempfile.mkdtemp(prefix="attn_compile_inductor_")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = INDUCTOR_CACHE

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before anything
# (attn_compile.kernels, torch._dynamo.testing) imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_unconfigure(config):
    shutil.rmtree(INDUCTOR_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def matmul_precision():
    """``torch.set_float32_matmul_precision`` for the test; the precision before it comes back after."""
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


@pytest.fixture
def without_fa4(monkeypatch):
    """The dispatch as on a machine without flash-attn-4, for tests of the other kernels' choices
    on a GPU where FA4 is installed and would take those calls."""
    from attn_compile.kernels import fa4

    monkeypatch.setattr(fa4, "interface", lambda: None)


@pytest.fixture
def inner_graphs(monkeypatch):
    """The graphs the attn_cp backend hands to its inner compiler, i.e. after the rewrite."""
    import attn_compile.backend as backend

    graphs = []
    inner = backend._inner_compile

    def recording(gm, example_inputs, *args):
        graphs.append(gm)
        return inner(gm, example_inputs, *args)

    monkeypatch.setattr(backend, "_inner_compile", recording)
    torch._dynamo.reset()
    return graphs
