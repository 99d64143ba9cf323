"""A pool of ``torch.distributed`` ranks on this machine: start ``world``
processes once, run many jobs on them, shut them down.

Starting a rank costs a Python process and an ``import torch`` (about a
second of CPU each, more on a busy machine), so a test session or a
conformance run starts one pool per world size and sends it every job::

    with TorchDistPool(4) as pool:            # 4 gloo ranks, 127.0.0.1
        outs = pool.run(job, (q, k, v))       # job(q, k, v) on every rank
        # outs[r] is rank r's return value: tensors come back as numpy

A job is a picklable function (defined at module level in an importable
module: pytest's default import mode makes a test module one) and picklable
arguments (numpy arrays, numbers, strings); every rank calls
``fn(*args, **kwargs)`` inside an initialised default process group
(``dist.get_rank()``, ``dist.get_world_size()``), and what it returns comes
back with every ``torch.Tensor`` turned into a numpy array (bfloat16 as
float32, which numpy lacks). An exception on a rank comes back as the same
exception type and message (its remote traceback chained as the cause);
:meth:`TorchDistPool.run` raises the lowest rank's, or returns them in
place with ``return_exceptions=True``. As with any ``multiprocessing``
start method but fork, a script that starts a pool needs the
``if __name__ == "__main__":`` guard.

**Hangs fail, they do not hang.** A job that does not finish on every rank
within ``timeout`` seconds (a collective some rank never joined) raises
``TimeoutError`` naming the ranks that did not answer, and the pool kills
its processes; the next job starts a fresh pool (with the forkserver, in a
fraction of a second). The process group's own timeout is the same, so a
rank stuck in a collective gives up too rather than linger. A rank that dies
(a crash, a kill) is noticed at once. After a job in which a rank raised a ``torch.distributed`` error the group
may be out of step (a send nobody received), so the pool restarts too.

Ranks are started with ``torch.multiprocessing`` (the ``"forkserver"``
method where the platform has it: the server imports torch once and forks
each rank from it: 8 ranks start in about 1.6 s on two busy cores, against
about 17 s with ``"spawn"``, which is used otherwise or when asked), each with the parent's ``sys.path`` (so a source checkout's
packages are the ones imported) and ``torch.set_num_threads(threads)``. The
ranks meet through a ``TCPStore`` the parent holds on ``127.0.0.1`` and a
port the system picks (no free-port race); gloo talks over the loopback
interface. For NCCL on GPUs pass ``backend="nccl"``: rank ``r`` then uses
``cuda:r`` (the job moves its tensors there).
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import sys
import time
import traceback
import weakref

__all__ = ["TorchDistPool", "RankError"]


class RankError(RuntimeError):
    """A rank's exception that could not be re-created here (``type: message``
    and the remote traceback)."""


class _RemoteTraceback(Exception):
    def __init__(self, text):
        super().__init__(text)
        self.text = text

    def __str__(self):
        return self.text


class TorchDistPool:
    """``world`` ranks of one ``torch.distributed`` process group, started once.

    Args:
      world: the number of ranks (a positive int).
      backend: ``"gloo"`` (CPU, the default) or ``"nccl"``.
      timeout: seconds a job may take on every rank (and the process group's
        timeout); past it the job raises ``TimeoutError`` and the pool restarts.
      start_timeout: seconds the ranks may take to start and meet.
      start_method: ``"forkserver"`` or ``"spawn"``; None: forkserver where
        available, else spawn.
      preload: modules the forkserver imports once before forking ranks
        (``"torch"`` always; add the packages the jobs import).
      threads: ``torch.set_num_threads`` in each rank (1: ``world`` ranks
        share the cores without oversubscribing them).

    Attributes:
      start_seconds: wall time of the last start (ranks started and met).
      starts: how many times the pool has started (1 + restarts).
    """

    def __init__(self, world, *, backend="gloo", timeout=60.0, start_timeout=180.0, start_method=None,
                 preload=(), threads=1):
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            raise ValueError(f"world: expected a positive int, got {world!r}")
        self.world, self.backend, self.timeout = world, backend, float(timeout)
        self.start_timeout, self.threads = float(start_timeout), int(threads)
        if start_method is None:
            import multiprocessing

            start_method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        self.start_method = start_method
        self.preload = ("torch", "torch.distributed", __name__, *preload)
        self.start_seconds, self.starts = None, 0
        self._state = None  # (processes, job queues, result queue, store) while running
        self._job = 0
        self._finalizer = None

    # ---- lifecycle

    def start(self):
        """Start the ranks (if not running) and wait until they have met; returns self."""
        if self._state is not None:
            return self
        import torch.distributed as dist
        import torch.multiprocessing as mp

        t0 = time.perf_counter()
        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(list(self.preload))
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=self.start_timeout))
        results = ctx.Queue()
        jobs = [ctx.Queue() for _ in range(self.world)]
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
        if self.backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
            loopback = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
            if loopback:
                env["GLOO_SOCKET_IFNAME"] = loopback[0]  # every rank is on this machine
        config = dict(world=self.world, backend=self.backend, timeout=self.timeout, threads=self.threads,
                      sys_path=list(sys.path), env=env, parent=os.getpid())
        procs = []
        for rank in range(self.world):
            p = ctx.Process(target=_worker, args=(rank, config, jobs[rank], results),
                            name=f"torch_dist rank {rank}", daemon=True)
            p.start()
            procs.append(p)
        self._state = (procs, jobs, results, store)
        self._stop = {"kill": False}  # read by the finalizer: kill at once instead of asking
        self._finalizer = weakref.finalize(self, _shutdown, procs, jobs, results, self._stop)
        try:
            self._collect("ready", self.start_timeout, "start")
        except BaseException:
            self.close(kill=True)
            raise
        self.start_seconds = time.perf_counter() - t0
        self.starts += 1
        return self

    def close(self, *, kill=False):
        """Stop the ranks (destroying their process group; ``kill``: at once, for
        ranks stuck in a job); the pool can start again."""
        if self._state is None:
            return
        self._state = None
        self._stop["kill"] = kill
        self._finalizer()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    @property
    def running(self) -> bool:
        return self._state is not None

    # ---- jobs

    def run(self, fn, args=(), kwargs=None, *, timeout=None, return_exceptions=False):
        """``fn(*args, **kwargs)`` on every rank; returns the ranks' results in rank order.

        Args:
          fn: a picklable function (module level, importable by the ranks).
          args, kwargs: picklable arguments, the same for every rank (a job
            picks its part with ``dist.get_rank()``).
          timeout: seconds for this job (default: the pool's).
          return_exceptions: put each failed rank's exception in its place
            instead of raising the lowest rank's.

        Raises:
          the lowest failing rank's exception (same type and message, with
          a note naming the rank); ``TimeoutError`` when some rank did not
          answer in time, ``RankError`` when a rank died.
        """
        payload = pickle.dumps((fn, tuple(args), dict(kwargs or {})))  # unpicklable: fails here
        self.start()
        procs, jobs, results, _ = self._state
        self._job += 1
        for q in jobs:
            q.put((self._job, payload))
        outcomes = self._collect(self._job, self.timeout if timeout is None else float(timeout), "job")
        values, broken = [], False
        for rank, (ok, value, dist_error) in enumerate(outcomes):
            broken = broken or dist_error
            if not ok:
                value = _rebuild(value, rank, self.world)
            values.append(value)
        if broken:
            self.close()  # a send or receive may be left unmatched: start afresh next time
        if not return_exceptions:
            for value in values:
                if isinstance(value, BaseException):
                    raise value
        return values

    def _collect(self, job, timeout, what):
        """Wait for every rank's answer to ``job``; kill the pool on a timeout or a death."""
        procs, _, results, _ = self._state
        deadline = time.monotonic() + timeout
        got = {}
        while len(got) < self.world:
            try:
                rank, job_id, outcome = results.get(timeout=0.05)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in got]
                if dead:
                    codes = ", ".join(f"rank {r} exit code {procs[r].exitcode}" for r in dead)
                    self.close(kill=True)
                    raise RankError(f"torch_dist: {codes} during the {what} ({self.world} ranks); "
                                    f"the pool restarts on the next job")
                if time.monotonic() > deadline:
                    missing = [r for r in range(self.world) if r not in got]
                    self.close(kill=True)
                    raise TimeoutError(f"torch_dist: ranks {missing} of {self.world} did not finish the "
                                       f"{what} within {timeout:g} s (a collective some rank never "
                                       f"joined?); the pool was stopped and restarts on the next job")
                continue
            if job_id == job:
                got[rank] = outcome
        return [got[r] for r in range(self.world)]


def _rebuild(blob, rank, world):
    """The rank's exception from ``(pickled exception or None, type name, message, traceback)``."""
    pickled, kind, message, text = blob
    exc = None
    if pickled is not None:
        try:
            exc = pickle.loads(pickled)
        except Exception:  # noqa: BLE001 - a type this process cannot import
            exc = None
    if not isinstance(exc, BaseException):
        exc = RankError(f"{kind}: {message}")
    exc.__cause__ = _RemoteTraceback(text)
    exc.add_note(f"(raised on rank {rank} of {world})")
    return exc


def _shutdown(procs, jobs, results, stop):
    """Ask every rank to stop, then kill the ones that do not (all of them at once
    with ``stop["kill"]``)."""
    for q in jobs:
        try:
            q.put(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + (0.0 if stop["kill"] else 5.0)
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)
    for q in (*jobs, results):
        # not q.close(): measured, closing these queues inside a worker of a
        # ProcessPoolExecutor (the conformance command's --jobs) closed that worker's
        # connection to its progress queue (a Manager proxy: "'NoneType' object cannot be
        # interpreted as an integer" on its next put); they close when collected
        q.cancel_join_thread()


# --------------------------------------------------------------------------
# the rank


def _worker(rank, config, jobs, results):
    """One rank: join the group, then run jobs until told to stop (or the parent is gone)."""
    sys.path[:] = config["sys_path"] + [p for p in sys.path if p not in config["sys_path"]]
    os.environ.update(config["env"])
    import torch
    import torch.distributed as dist

    torch.set_num_threads(config["threads"])
    timeout = datetime.timedelta(seconds=config["timeout"])
    store = dist.TCPStore("127.0.0.1", int(config["env"]["MASTER_PORT"]), is_master=False, timeout=timeout)
    if config["backend"] == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(config["backend"], store=store, rank=rank, world_size=config["world"],
                            timeout=timeout)
    results.put((rank, "ready", None))
    try:
        while True:
            try:
                job = jobs.get(timeout=1.0)
            except queue.Empty:
                if not _alive(config["parent"]):
                    return  # orphaned: nobody will ever send a job
                continue
            if job is None:
                return
            job_id, payload = job
            results.put((rank, job_id, _run(payload)))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - leaving anyway
            pass


def _alive(pid):
    """Whether process ``pid`` (the pool's owner, not our parent: the forkserver
    forks the ranks) still exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _run(payload):
    """``(ok, value, dist_error)``: the job's result with tensors as numpy, or its exception."""
    import torch.distributed as dist

    try:
        fn, args, kwargs = pickle.loads(payload)
        value = _to_numpy(fn(*args, **kwargs))
        pickle.dumps(value)  # fail here, not in the queue's feeder thread
        return True, value, False
    except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
        try:
            pickled = pickle.dumps(exc)
        except Exception:  # noqa: BLE001
            pickled = None
        text = "".join(traceback.format_exception(exc))
        dist_error = isinstance(exc, getattr(dist, "DistError", ())) or "gloo" in str(exc).lower()
        return False, (pickled, type(exc).__name__, str(exc), text), dist_error


def _to_numpy(tree):
    """Every tensor in nested lists/tuples/dicts as a numpy array (detached, on the CPU)."""
    import torch

    if isinstance(tree, torch.Tensor):
        t = tree.detach().cpu()
        return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
    if isinstance(tree, dict):
        return {k: _to_numpy(v) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a named tuple
        return type(tree)(*(_to_numpy(v) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_numpy(v) for v in tree)
    return tree
