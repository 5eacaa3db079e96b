"""backend="attn_cp" resolves through the torch_dynamo_backends entry point in a fresh interpreter."""
import subprocess
import sys

SCRIPT = """
import sys
import torch
import torch.nn.functional as F
q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 12)
assert "attn_compile" not in sys.modules
fn = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                   backend="attn_cp", options={"inner": "eager"})
out = fn(q, k, v)
assert "attn_compile" in sys.modules
from torch.distributed.tensor import DTensor  # loading the backend gave SDPA's CPU kernel its DTensor rules
assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in \
    DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
print(tuple(out.shape), float((out - ref).abs().max()))
"""


def test_backend_from_a_fresh_interpreter():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    shape, diff = result.stdout.split(")")
    assert shape == "(1, 4, 8, 12" and float(diff) < 1e-5
