"""Process groups for tensor parallelism: join one started by torchrun, or start the workers.

A model sharded over ``N`` ranks runs in ``N`` processes, one per GPU (or per CPU group, over
gloo), each holding its shard and running the same scheduler on the same inputs. Two ways to
get those processes, both ending in :func:`tensor_parallel`:

- ``torchrun --nproc-per-node N -m speculum generate ...``: torchrun starts them; each joins
  the group through the ``env://`` variables torchrun sets, and only rank 0 prints.
- ``speculum generate --tp N`` (and ``speculum.generate(..., tp=N)``): the command starts them
  itself (:func:`launch`), as vLLM's and SGLang's ``--tensor-parallel-size`` / ``--tp`` do, and
  hands back rank 0's result; the calling process prints it.

NCCL is the backend on CUDA (process ``LOCAL_RANK`` uses GPU ``LOCAL_RANK``), gloo on the CPU.
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from speculum.state.parallel import SINGLE, TensorParallel

T = TypeVar("T")

__all__ = ["finish", "is_leader", "launch", "launched", "tensor_parallel"]


def launched() -> bool:
    """Whether this process is one of a group's workers (started by torchrun or
    :func:`launch`): the ``env://`` variables are set."""
    return "WORLD_SIZE" in os.environ


def is_leader() -> bool:
    """Whether this process talks to the user: rank 0 of a group, or a process outside one."""
    return int(os.environ.get("RANK", "0")) == 0


def tensor_parallel(size: int, device: str = "cpu") -> TensorParallel:
    """This process's place in the tensor-parallel group of ``size`` ranks over all processes,
    initialising the default process group when needed (NCCL for ``device`` ``cuda``, gloo
    otherwise); :data:`SINGLE` for ``size == 1``.

    Raises ``RuntimeError`` when no worker processes were started for ``size > 1`` or a CUDA
    rank has no GPU of its own, and ``ValueError`` when the group has another size.
    """
    if size < 1:
        raise ValueError(f"tp={size}: the tensor-parallel size must be at least 1")
    if size == 1:
        return SINGLE
    if not dist.is_initialized():
        if not launched():
            raise RuntimeError(
                f"tp={size} needs {size} processes: run under torchrun --nproc-per-node {size}, "
                "or let speculum start them (speculum generate --tp, speculum.generate(tp=...))"
            )
        _check_world(int(os.environ["WORLD_SIZE"]), size)
        cuda = device.startswith("cuda")
        if cuda:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            if local >= torch.cuda.device_count():
                raise RuntimeError(
                    f"tensor-parallel rank {local} needs GPU {local}, but this host has "
                    f"{torch.cuda.device_count()}: run at most that many ranks per host"
                )
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
        atexit.register(finish)  # the group lives as long as the process that needed it
    _check_world(dist.get_world_size(), size)
    # group=None names the default group without holding it: a Python reference to the group
    # object would outlive finish()'s destroy_process_group, and gloo's C++ group destroyed
    # later, during interpreter shutdown, aborts the process ("terminate called without an
    # active exception") about half the time.
    return TensorParallel(rank=dist.get_rank(), size=size)


def _check_world(world: int, size: int) -> None:
    if world != size:
        raise ValueError(
            f"tp={size} in a group of {world} processes: speculum shards the model over all of "
            f"them, so start {size} processes (torchrun --nproc-per-node {size}) or pass "
            f"--tp {world}"
        )


def finish() -> None:
    """Leave the default process group, if this process is in one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def launch(fn: Callable[[], T], size: int) -> T:
    """Run ``fn()`` in ``size`` fresh worker processes that form one group (set up as torchrun
    would, on this host), and return rank 0's result.

    ``fn`` must be picklable (a module-level function or a ``functools.partial`` of one). An
    exception raised on any rank is raised here (the first one to arrive); the other workers
    are then stopped. Each worker runs ``cpu_count // size`` CPU threads.
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    workers = [
        context.Process(target=_worker, args=(fn, rank, size, port, results))
        for rank in range(size)
    ]
    for worker in workers:
        worker.start()
    try:
        value = _leader_result(workers, results)
        for worker in workers:
            worker.join()
        return value
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
                worker.join()


def _leader_result(workers: list[Any], results: Any) -> Any:
    """Rank 0's result, or the first error a worker reports (raised)."""
    while True:
        try:
            rank, failed, value = results.get(timeout=0.5)
        except queue.Empty:
            # A worker that exited without reporting: killed, or rank 0 lost its result.
            dead = [
                (r, w.exitcode)
                for r, w in enumerate(workers)
                if w.exitcode is not None and (w.exitcode != 0 or r == 0)
            ]
            if dead and results.empty():
                rank, code = dead[0]
                raise RuntimeError(
                    f"tensor-parallel worker {rank} exited with status {code} before rank 0 "
                    "returned a result"
                ) from None
            continue
        if failed:
            raise value
        if rank == 0:
            return value


def _worker(fn: Callable[[], Any], rank: int, size: int, port: int, results: Any) -> None:
    """One rank: the ``env://`` variables torchrun would set, then ``fn()``; rank 0 reports its
    result and any rank its exception."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(size),
    )
    # torchrun gives each worker one thread; splitting the cores is as safe and less slow.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    try:
        value = fn()
        if rank == 0:
            results.put((rank, False, value))
    except BaseException as error:  # every failure goes to the caller, whatever its type
        results.put((rank, True, _transportable(error)))
    finally:
        finish()


def _transportable(error: BaseException) -> BaseException:
    """``error`` itself when it survives pickling, else a ``RuntimeError`` with its traceback."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        return RuntimeError(f"a tensor-parallel worker failed:\n{text}")


def _free_port() -> int:
    """A TCP port free on this host right now, for the group's rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
