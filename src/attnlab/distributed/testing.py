"""Context-parallel code tested on one machine: W gloo ranks on loopback, inside a pytest test.

:func:`run_ranks` starts ``world`` processes, each in a gloo process group on a free port of
127.0.0.1, runs ``fn(rank, world, *args)`` in each and returns their results, by rank. It never
skips: a rank that raises, dies or hangs fails the call with :class:`RanksFailed`, which names the
rank and, for a hang, the collective it was in (each rank records the collective it is inside,
``torch.distributed``'s and ``torch.distributed.nn.functional``'s, in shared memory the parent
reads when the time is up). attnlab's own context-parallel tests use it::

    from attnlab.distributed.testing import run_ranks

    def shard_and_attend(rank, world, q, k, v):       # module level: the ranks import it
        local = [shard_sequence(t, rank, world) for t in (q, k, v)]
        return ulysses_attention(*local, is_causal=True)

    outs = run_ranks(shard_and_attend, world=4, args=(q, k, v), timeout=60)

Ranks are forks of a fork server that imported torch once (about 0.1 s a rank, not 3 s), one
thread each. ``fn`` and its arguments travel by pickle, so ``fn`` is a module-level function.
"""

from __future__ import annotations

import ctypes
import functools
import multiprocessing as mp
import pickle
import queue as queue_mod
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional

__all__ = ["run_ranks", "RanksFailed", "COLLECTIVES"]

# the collectives a rank's progress is recorded in (torch.distributed's, and the autograd-aware ones)
# (not isend/irecv: torch's P2POp checks them by identity; a hang on their requests is in request.wait())
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single", "broadcast",
               "barrier", "reduce_scatter", "reduce_scatter_tensor", "send", "recv", "batch_isend_irecv", "gather",
               "scatter", "reduce")
_NAME_BYTES = 64


class RanksFailed(AssertionError):
    """A rank raised, died without a result, or did not finish in time: the message says which and
    where. An ``AssertionError``, so pytest reports it as the test's failure (never a skip)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trace(where: "ctypes.Array") -> None:
    """Record, in ``where`` (shared memory), the collective this rank is inside; '' between them."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as dist_fn

    def wrap(module, name):
        inner = getattr(module, name, None)
        if inner is None or getattr(inner, "attnlab_traced", False):
            return

        @functools.wraps(inner)
        def traced(*args, **kwargs):
            outer = where.value
            where.value = f"{module.__name__.split('.')[-1]}.{name}".encode()[:_NAME_BYTES - 1]
            try:
                return inner(*args, **kwargs)
            finally:
                where.value = outer

        traced.attnlab_traced = True
        setattr(module, name, traced)

    for name in COLLECTIVES:
        wrap(dist, name)
        wrap(dist_fn, name)


def _rank(fn: Callable, rank: int, world: int, port: int, args: tuple, kwargs: dict, timeout: float,
          results, where) -> None:
    """One rank: join the group, run ``fn``, report ``(rank, "ok", value)`` or ``(rank, "error", text)``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    _trace(where)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
        value = fn(rank, world, *args, **kwargs)
        # by value (pickle's bytes), not torch's shared-memory handles, which die with this process
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 (a test's failure, whatever it is, is reported by rank)
        results.put((rank, "error", traceback.format_exc()[-4000:]))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 (a peer already gone)
            pass


def run_ranks(fn: Callable, world: int = 2, *, args: tuple = (), kwargs: Optional[dict] = None,
              timeout: float = 60.0) -> list[Any]:
    """``[fn(0, world, *args, **kwargs), ..., fn(world - 1, ...)]``, each run in its own gloo rank.

    Args:
        fn: a module-level function ``fn(rank, world, *args, **kwargs)``; its return value comes back
            by pickle (tensors are fine).
        world: how many ranks.
        args: passed to every rank (by pickle: each gets its own copy).
        kwargs: as ``args``.
        timeout: seconds of wall clock for the whole run (a backstop against a hang; the ranks'
            gloo timeout is the same).

    Raises:
        RanksFailed: a rank raised (its traceback), exited without a result (its exit code), or
            had not finished when ``timeout`` ran out (the collective each unfinished rank was in).
    """
    if world < 1:
        raise ValueError(f"run_ranks: world must be at least 1, got {world}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "attnlab.distributed"])
    results = ctx.Queue()
    where = [ctx.Array(ctypes.c_char, _NAME_BYTES, lock=False) for _ in range(world)]
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(fn, r, world, port, args, kwargs or {}, timeout, results, where[r]),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    done: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.2)
                done[rank] = (status, value)
                if status != "ok":  # the others wait on it in vain: a short grace, then what they were in
                    deadline = min(deadline, time.monotonic() + 2.0)
            except queue_mod.Empty:
                for r, p in enumerate(procs):
                    if r not in done and p.exitcode is not None:
                        try:  # its result may be in the pipe still
                            rank, status, value = results.get(timeout=0.5)
                            done[rank] = (status, value)
                        except queue_mod.Empty:
                            done[r] = ("died", p.exitcode)
                            deadline = min(deadline, time.monotonic() + 2.0)
    finally:
        hung = {r: where[r].value.decode(errors="replace") for r in range(world) if r not in done}
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    problems = []  # the likely cause first: a rank that died, then one that raised, then the ones left waiting
    for want in ("died", "error", "hung"):
        for r in range(world):
            status, value = done.get(r, ("hung", None))
            if status != want:
                continue
            if status == "died":
                problems.append(f"rank {r} exited with code {value} without a result")
            elif status == "error":
                problems.append(f"rank {r} raised:\n{value}")
            else:
                inside = hung.get(r) or "no collective call (its own code, or waiting on a request)"
                problems.append(f"rank {r} did not finish in {timeout:g} s: it was in {inside}")
    if problems:
        raise RanksFailed(f"run_ranks({getattr(fn, '__name__', fn)}, world={world}): " + "\n".join(problems))
    return [pickle.loads(done[r][1]) for r in range(world)]
