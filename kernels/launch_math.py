"""Integer arithmetic for the host side of the Triton launches: grids, tile widths, buckets.
Triton's own ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions, whose calls
from Python cost 2.2 us each on a CI host (about 5 us on the H200 machines' hosts, where a Triton
attention call made some ten of them); these cost 0.05 us."""


def cdiv(a: int, b: int) -> int:
    """a / b rounded up, for a >= 0 and b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def scan_block(n: int) -> int:
    """Positions per step of a kernel whose one program scans a batch row of ``n``: its steps run one
    after another, so they are few and wide."""
    return min(8192, next_power_of_2(max(n, 1)))
