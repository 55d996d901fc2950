"""Tensor-parallel worker processes: ranks 1..N-1 of a replica, driven by rank 0.

The driver (the engine's process) is rank 0: it schedules, samples and holds every request's
state, as in vLLM and nano-vllm. Each other rank is a process of its own (`spawn`ed, one per
device: `cuda:r`, or a share of the CPU cores), holding a ModelShard. Its control channel is a
pipe: per step the driver sends the step's batch (a few small arrays) and the logits slices it
will ask for, then runs its own share; the ranks meet in the model's collectives (NCCL on GPUs,
gloo on CPU, over loopback) and the logits are gathered on rank 0.

Failure is whole: a rank that dies (any exit, a kill), raises, or hangs past `tp_timeout_s`
fails the replica (on NCCL a collective left waiting on a dead peer may instead end in the
NCCL watchdog's abort of the process after the timeout: the same outcome, a restarted pod).
A monitor thread watches the workers' process sentinels; on the first exit
it kills the others (which breaks any collective the driver is in) and records a RankFailure,
which the engine raises and the server turns into a failed /health, so the pod restarts. No
rank outlives its driver: its pipe's end (or a collective's broken peer) ends it, and a
watchdog thread exits it once its parent is gone. (Not PR_SET_PDEATHSIG: that fires when the
*thread* that started the worker ends, and the server loads the engine on a thread of its own.)
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch

from kubeinfer.runtime.engine.config import EngineConfig
from kubeinfer.runtime.models.parallel import TensorParallelError, TPGroup

logger = logging.getLogger(__name__)

ORPHAN_CHECK_S = 1.0
"""How often a worker checks that its driver is still its parent."""


class RankFailure(RuntimeError):
    """A tensor-parallel rank died, hung or failed: the replica cannot go on (fatal)."""


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def threads_per_rank(size: int) -> int:
    """CPU threads for each of `size` ranks sharing the cores this process may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // size)


def check_devices(device: torch.device, size: int) -> None:
    """TensorParallelError when there are fewer GPUs than ranks (CPU ranks share the cores)."""
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if device.index not in (None, 0):
            raise TensorParallelError(
                f"tensor parallelism places rank r on cuda:r; the device must be cuda or "
                f"cuda:0, not {device}"
            )
        if count < size:
            raise TensorParallelError(
                f"tensor_parallel_size {size} needs {size} GPUs (a rank per GPU); this "
                f"machine has {count}"
            )
    elif device.type != "cpu":
        raise TensorParallelError(f"tensor parallelism runs on cuda or cpu, not {device.type}")


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


class TPWorkers:
    """The worker ranks of one driver; makes the driver rank 0 of the process group."""

    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig,
        dtype: str | torch.dtype,
        device: torch.device,
    ) -> None:
        import torch.distributed as dist

        size = config.tensor_parallel_size
        check_devices(device, size)
        if dist.is_initialized():
            raise TensorParallelError(
                "a tensor-parallel engine already runs in this process (torch.distributed is "
                "initialized): close it first"
            )
        self.size, self.device, self.timeout_s = size, device, config.tp_timeout_s
        self.fault: RankFailure | None = None
        self._closing = False
        self._threads_before = torch.get_num_threads()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        timeout = timedelta(seconds=self.timeout_s)
        self.store = dist.TCPStore(
            "127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.senders: list[_Sender] = []
        try:
            for rank in range(1, size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main,
                    args=(rank, size, self.store.port, str(model_dir), config, dtype, device)
                    + (child, os.getpid()),
                    name=f"kubeinfer-tp-rank-{rank}",
                    daemon=True,
                )
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
                self.senders.append(_Sender(parent, rank, self._send_failed))
            self._expect_all("hello")
            torch.set_num_threads(threads_per_rank(size))
            dist.init_process_group(
                backend_for(device), store=self.store, rank=0, world_size=size, timeout=timeout
            )
        except BaseException:
            self.close(polite=False)
            raise
        self.group = TPGroup(0, size, dist.group.WORLD)

    # start-up handshake

    def _expect_all(self, what: str) -> list[Any]:
        """Every worker's next message, which must be `(what, value...)`; a worker's error or
        exit, or a silence past the timeout, raises naming the rank."""
        values: list[Any] = []
        deadline = time.monotonic() + self.timeout_s
        for rank, (proc, conn) in enumerate(zip(self.procs, self.conns, strict=True), start=1):
            while not conn.poll(0.1):
                if not proc.is_alive():
                    raise RankFailure(
                        f"tensor-parallel rank {rank} exited (code {proc.exitcode}) while "
                        f"starting ({what})"
                    )
                if time.monotonic() > deadline:
                    raise RankFailure(
                        f"tensor-parallel rank {rank} sent no {what!r} in {self.timeout_s:g} s"
                    )
            try:
                msg = conn.recv()
            except EOFError:
                raise RankFailure(f"tensor-parallel rank {rank} closed its pipe") from None
            if msg[0] == "error":
                raise _rank_error(rank, msg[1], msg[2])
            if msg[0] != what:
                raise RankFailure(f"tensor-parallel rank {rank} sent {msg[0]!r}, not {what!r}")
            values.append(msg[1] if len(msg) > 1 else None)
        return values

    def wait_loaded(self) -> None:
        """Every worker has loaded its shard (or its load error is raised here)."""
        self._expect_all("loaded")

    def size_kv(self, own: Callable[[], int]) -> int:
        """The KV blocks every rank can hold: each measures its own (on CUDA with a warm-up
        step, all ranks at once), the smallest wins."""
        self.send(("size_kv",))
        mine = own()
        return min([mine, *self._expect_all("blocks")])

    def allocate_kv(self, num_blocks: int) -> None:
        """Every rank allocates its KV cache; then the monitor starts watching the workers (it
        reads their pipes once it sees one exit, so not during the handshakes above, whose
        reads see an exit themselves)."""
        self.send(("allocate", num_blocks))
        self._expect_all("ready")
        threading.Thread(target=self._watch, name="tp-monitor", daemon=True).start()

    # steps

    def send(self, msg: tuple[Any, ...]) -> None:
        """Queue `msg` for every worker. Each worker's pipe is written by a sender thread of
        its own, so that a hung worker with a full pipe never blocks the driver: the driver
        goes on into the step's first collective, which times out after tp_timeout_s."""
        self.check()
        for sender in self.senders:
            sender.queue.put(msg)

    def _send_failed(self, rank: int, error: BaseException) -> None:
        if self.fault is None and not self._closing:
            self.fault = RankFailure(f"tensor-parallel rank {rank} is gone (its pipe: {error})")

    def check(self, wait_s: float = 0.0) -> None:
        """Raise the recorded fault (a rank that exited). `wait_s`: after a failed collective,
        how long to give the monitor to notice a rank that died, so that the error names it."""
        deadline = time.monotonic() + wait_s
        while self.fault is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.fault is not None:
            raise self.fault

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        ready = wait(list(sentinels))
        if self._closing:
            return
        rank, proc = sentinels[ready[0]]  # type: ignore[index]
        proc.join(1)
        message = ""
        conn = self.conns[rank - 1]
        try:
            while conn.poll(0):
                msg = conn.recv()
                if msg[0] == "error":
                    message = f": {msg[1]}: {msg[2]}"
        except (OSError, EOFError):
            pass
        self.fault = RankFailure(
            f"tensor-parallel rank {rank} exited (code {proc.exitcode}){message}"
        )
        logger.error("%s; stopping the other ranks", self.fault)
        self._kill()

    # shutdown

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()

    def close(self, polite: bool = True) -> None:
        """Stop every worker (a polite "stop" unless a rank failed or `polite` is False, then
        a kill, within one deadline) and leave the process group."""
        import torch.distributed as dist

        if self._closing:
            return
        self._closing = True
        if polite and self.fault is None:
            for sender in self.senders:
                sender.queue.put(("stop",))
            deadline = time.monotonic() + 5.0
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for sender in self.senders:
            sender.queue.put(None)
        for conn in self.conns:
            conn.close()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group may not tear down cleanly
                logger.warning("tensor-parallel process group did not tear down", exc_info=True)
        torch.set_num_threads(self._threads_before)


class _Sender:
    """Writes one worker's pipe from a daemon thread, in queue order (None ends it)."""

    def __init__(
        self, conn: Connection, rank: int, on_error: Callable[[int, BaseException], None]
    ) -> None:
        self.queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self.conn, self.rank, self.on_error = conn, rank, on_error
        threading.Thread(target=self._run, name=f"tp-send-{rank}", daemon=True).start()

    def _run(self) -> None:
        while (msg := self.queue.get()) is not None:
            try:
                self.conn.send(msg)
            except (OSError, EOFError, ValueError) as e:  # ValueError: closed meanwhile
                self.on_error(self.rank, e)
                return


def _rank_error(rank: int, kind: str, text: str) -> Exception:
    """A worker's start-up error, raised in the driver as the same kind when it is ours."""
    from kubeinfer.runtime.errors import ModelLoadError

    message = f"tensor-parallel rank {rank}: {text}"
    if kind == "ModelLoadError":
        return ModelLoadError(message)
    if kind == "TensorParallelError":
        return TensorParallelError(message)
    return RankFailure(f"{message} ({kind})")


def _exit_when_orphaned(parent: int) -> None:
    """A daemon thread that exits the process once `parent` is no longer its parent."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="orphan-watch", daemon=True).start()


def _worker_main(
    rank: int,
    size: int,
    port: int,
    model_dir: str,
    config: EngineConfig,
    dtype: str | torch.dtype,
    device: torch.device,
    conn: Connection,
    parent: int,
) -> None:
    """A worker rank's life: join the group, load its shard, size and allocate its KV cache in
    step with the driver, then run each step the driver sends until "stop" (or its pipe's end)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when to stop
    _exit_when_orphaned(parent)
    import torch.distributed as dist

    from kubeinfer.runtime.engine.model_shard import ModelShard

    torch.set_num_threads(threads_per_rank(size))
    local = rank_device(device, rank)
    if local.type == "cuda":
        torch.cuda.set_device(local)
    code = 0
    try:
        conn.send(("hello",))
        timeout = timedelta(seconds=config.tp_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
        dist.init_process_group(
            backend_for(local), store=store, rank=rank, world_size=size, timeout=timeout
        )
        shard = ModelShard(
            model_dir, config, dtype, local, tp=TPGroup(rank, size, dist.group.WORLD)
        )
        conn.send(("loaded",))
        while True:
            msg = conn.recv()
            kind = msg[0]
            if kind == "step":
                shard.run_step(msg[1], msg[2])
            elif kind == "size_kv":
                conn.send(("blocks", shard.blocks_from_memory()))
            elif kind == "allocate":
                shard.allocate_kv(msg[1])
                conn.send(("ready",))
            elif kind == "stop":
                break
    except EOFError:  # the driver is gone
        code = 1
    except BaseException as e:  # noqa: BLE001 - reported, then this rank exits (fatal)
        code = 1
        logger.exception("tensor-parallel rank %d failed", rank)
        try:
            conn.send(("error", type(e).__name__, str(e).splitlines()[0][:500] if str(e) else ""))
        except (OSError, EOFError):
            pass
    finally:
        conn.close()
    os._exit(code)  # no atexit/process-group teardown that could wait on a dead peer
