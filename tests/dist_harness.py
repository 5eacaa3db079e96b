"""Run a test body on ``world`` real CPU processes joined in a gloo group.

``run_distributed(fn, world, *args)`` spawns the processes, calls ``fn(rank, world, *args)`` in
each, and re-raises a failure of any rank in the parent with that rank's traceback. A hang
fails too: collectives time out after ``timeout`` seconds, and the whole run is killed after
the same time, so put many cases in one call to pay the start-up once.
"""
import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = 120.0


def _entry(rank, world, store_path, timeout, fn, args):
    torch.set_num_threads(1)  # several ranks share few cores: more threads only contend (10-100x slower)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world: int, *args, timeout: float = TIMEOUT) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_entry, args=(world, os.path.join(tmp, "store"), timeout, fn, args),
                                     nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
            if time.monotonic() >= deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{fn.__name__} did not finish on {world} processes within {timeout:.0f} s")
