"""A failure on one rank of a context-parallel group, raised on every rank within moments.

A rank that raises inside a context-parallel op after the ranks' agreement (``checks.check_call``)
leaves the others waiting in collectives it will never join, and without more they wait for the
process group's timeout. So the failing rank records on the default process group's store which
rank failed, in which op, and its error (``attn_cp/failed/<global rank>``), and a rank whose wait
on a gloo group lasts longer than ``CHECK_EVERY_S`` looks there for a record of the other ranks of
that group. Finding one, it raises ``PeerFailed`` with that record, and records it as its own, so
that ranks waiting on it in other groups (a 2-D mesh) learn of it in turn.

The wait runs in a helper thread while the caller looks: a gloo wait cannot be interrupted (an
aborted gloo group leaves it waiting, and a wait given a timeout closes the connection). Waits on
gloo groups are the CPU's collectives and, on GPUs, the agreement on the groups' gloo twins. The
host does not wait for an NCCL collective: there a rank's GPU work waits for the failed rank, and
the rank raises at its next context-parallel call, whose agreement waits on the gloo twin.

The record stays: a group with a failed rank is failed, and every later wait on it that lasts
longer than CHECK_EVERY_S raises the same error.
"""
import contextlib
import threading
import time

import torch.distributed as dist

CHECK_EVERY_S = 0.1
QUICK_S = 2e-3  # how long a collective is watched for completion before a helper thread waits
_KEY = "attn_cp/failed/{}"
_MESSAGE_CHARS = 2000  # of the error, in the record (a compiler's can run to pages)


class PeerFailed(RuntimeError):
    """Another rank of the group failed inside a context-parallel op."""


def _store():
    return dist.distributed_c10d._get_default_store()


def _record(failure: str) -> None:
    """Records ``failure`` as this rank's, unless it has one."""
    key = _KEY.format(dist.get_rank())
    if not _store().check([key]):
        _store().set(key, failure)


def _failure_among(group):
    """The record of a failure of another rank of ``group``, or None."""
    store, me = _store(), dist.get_rank()
    for rank in dist.get_process_group_ranks(group):
        key = _KEY.format(rank)
        if rank != me and store.check([key]):
            return store.get(key).decode()
    return None


def _peer_failed(failure: str) -> PeerFailed:
    _record(failure)
    return PeerFailed(f"context-parallel attention failed on {failure}; this rank's collectives with it cannot "
                      f"complete")


@contextlib.contextmanager
def failing_together(op: str):
    """Records an error raised in the block as this rank's failure in ``op``, for the other ranks."""
    try:
        yield
    except PeerFailed:
        raise
    except Exception as error:
        _record(f"rank {dist.get_rank()} in {op}: {type(error).__name__}: {str(error)[:_MESSAGE_CHARS]}")
        raise


def wait(works, group) -> None:
    """Waits for ``works``, transfers or collectives on ``group``; on a gloo group, raises
    PeerFailed within about CHECK_EVERY_S of another rank of the group recording a failure. A
    helper thread waits, since a gloo wait cannot be interrupted."""
    if not works:
        return
    if dist.get_backend(group) != "gloo":  # the stream waits, not the host
        for work in works:
            work.wait()
        return
    done, errors = threading.Event(), []

    def wait_all():
        try:
            _finish(works, group)
        except Exception as error:  # noqa: BLE001  (raised below, in the caller's thread)
            errors.append(error)
        finally:
            done.set()

    threading.Thread(target=wait_all, name="attn_cp collective wait", daemon=True).start()
    while not done.wait(CHECK_EVERY_S):
        failure = _failure_among(group)
        if failure is not None:
            raise _peer_failed(failure)
    if errors:
        raise errors[0]


def wait_collective(work, group) -> None:
    """``wait([work], group)``, first watching for a moment whether the collective reports that
    it completed: most do within moments (the agreement's 16 bytes), and then need no helper
    thread, which costs more than their wait. Not every gloo collective reports it (a
    reduce-scatter does not), nor does a transfer."""
    if dist.get_backend(group) == "gloo":
        pause, quick = 1e-5, time.monotonic() + QUICK_S
        while not work.is_completed():
            if time.monotonic() > quick:
                return wait([work], group)
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
    _finish([work], group)


def _finish(works, group) -> None:
    """Waits for ``works``, raising a failed one's error, or PeerFailed where a rank of the group
    recorded a failure (a failed rank that exits closes its connections)."""
    try:
        for work in works:
            work.wait()
    except Exception as error:
        failure = _failure_among(group)
        if failure is not None:
            raise _peer_failed(failure) from error
        raise
