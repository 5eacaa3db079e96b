"""Run a test body on ``world`` real CPU processes joined in a gloo group.

``run_distributed(fn, world, *args)`` spawns the processes, calls ``fn(rank, world, *args)`` in
each, and re-raises a failure of any rank in the parent with that rank's traceback. A hang
fails too: collectives time out after ``timeout`` seconds, and the whole run is killed after
the same time, so put many cases in one call to pay the start-up once. ``run_ranks`` runs the
same way but returns how each rank fared instead, for tests where some ranks are meant to fail.
``run_on_gpus(fn, *args)`` is ``run_distributed`` with one process per visible GPU, joined in an
NCCL group, rank r on cuda:r.

gloo ranks fork from a forkserver that has imported torch and attn_compile once: a spawned
rank spends seconds importing them (12 s for two ranks, 27 s for four, on a 2-core machine),
a forked one a fraction of a second. The server imports modules and runs nothing, so each rank
still starts from a clean process. NCCL ranks are spawned, so no CUDA state can be inherited.
"""
import datetime
import json
import multiprocessing
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = 120.0
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo",
                                        "torch._inductor.compile_fx", "attn_compile", "dist_harness", "oracle"])


def _start_method(backend):
    return "spawn" if backend == "nccl" else "forkserver"


def _join(rank, world, store_path, timeout, backend="gloo"):
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # several ranks share few cores: more threads only contend (10-100x slower)
    dist.init_process_group(backend, init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout),
                            **({"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}))


def _entry(rank, world, store_path, timeout, backend, fn, args):
    _join(rank, world, store_path, timeout, backend)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world: int, *args, timeout: float = TIMEOUT, backend: str = "gloo") -> None:
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_entry, args=(world, os.path.join(tmp, "store"), timeout, backend, fn, args),
                                     nprocs=world, join=False, start_method=_start_method(backend))
        deadline = time.monotonic() + timeout
        while not context.join(timeout=max(deadline - time.monotonic(), 0.0)):
            if time.monotonic() >= deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{fn.__name__} did not finish on {world} processes within {timeout:.0f} s")


def run_on_gpus(fn, *args, timeout: float = TIMEOUT) -> None:
    """run_distributed with one process per visible GPU, in an NCCL group, rank r on cuda:r."""
    world = torch.cuda.device_count()
    if world == 0:
        raise RuntimeError(f"run_on_gpus({fn.__name__}) needs a CUDA device; none is visible")
    run_distributed(fn, world, *args, timeout=timeout, backend="nccl")


def _reporting_entry(rank, world, store_path, timeout, backend, report_dir, fn, args):
    _join(rank, world, store_path, timeout, backend)
    start = time.monotonic()
    try:
        fn(rank, world, *args)
        error = None
    except Exception as e:  # noqa: BLE001  (what failed is the report)
        error = f"{type(e).__name__}: {e}"
    report = {"error": error, "seconds": time.monotonic() - start}
    with open(os.path.join(report_dir, f"rank_{rank}.json"), "w") as f:
        json.dump(report, f)
    os._exit(0)  # no destroy_process_group: with a peer gone it could block


def run_ranks(fn, world: int, *args, timeout: float = TIMEOUT, backend: str = "gloo") -> list:
    """Like run_distributed, but reports each rank instead of raising: a list, by rank, of
    ``{"error": "Type: message" or None, "seconds": how long fn ran}``, or
    ``{"exitcode": ...}`` for a rank that wrote no report (it exited, or hung until killed).
    Collectives time out after ``timeout`` seconds; ranks still running ``timeout + 60`` seconds
    after the start (start-up included) are killed."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.get_context(_start_method(backend))
        processes = [context.Process(target=_reporting_entry,
                                   args=(rank, world, os.path.join(tmp, "store"), timeout, backend, tmp, fn, args))
                     for rank in range(world)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout + 60.0
        for process in processes:
            process.join(max(deadline - time.monotonic(), 0.0))
            if process.is_alive():
                process.kill()
                process.join()
        reports = []
        for rank, process in enumerate(processes):
            path = os.path.join(tmp, f"rank_{rank}.json")
            if os.path.exists(path):
                with open(path) as f:
                    reports.append(json.load(f))
            else:
                reports.append({"exitcode": process.exitcode})
        return reports

