"""Tensor parallelism: rank 0's end of the group (engine/tp_worker.py is the other ranks' loop).

Rank 0 is the engine as with one process: scheduler, sampler, adapter manager and step loop. It
starts ranks 1..N-1 as worker processes (``python -m services.inference.engine.tp_worker``) that
meet it through a TCP store on a free loopback port and load their own shard of the weights
(models/shard.py). Two process groups join them: the control group (gloo, host tensors) carries
rank 0's commands, and the compute group (NCCL on CUDA, the same gloo group on the CPU) the
all-reduces of the forward pass and the step's sampled inputs.

At start, rank 0 sends its layout (ready: every worker builds the same pool, index and batch),
then the digest of the CUDA graphs it will capture (agree_graphs: every worker compares its own
list), and then every rank captures them, in the same order (on CUDA).

Every command starts with one broadcast of a fixed header ([HEADER] int64: the command and its
arguments), then its payload:

- STEP: the step's counts, LoRA path and CUDA graph in the header, then what the step wrote of
  the StepBatch's host tensors, packed in one buffer (one broadcast: StepBatch.wire); then in
  the forward (or the graph's replay: every rank captured the same graphs, collectives
  included, in the same order), on the compute group, the tokens the previous step sampled
  (StepBatch.prev_tokens) and the two all-reduces of each layer.
- LOAD: the adapter's description (pickled HostAdapter, less its bytes), its slot table, then
  the adapter file's bytes, or, where they lie in the engine's host arena (a memfd every worker
  maps: arena.SharedArena), their offset, and each worker's word once it has read them; each worker
  writes its shard into the same slots and index row as rank 0 (the plan of the sharded shapes
  is the same on every rank, so rank 0 allocates for all).
- CLEAR: an index row given back (eviction, removal): its ranks zeroed as on rank 0.
- CHECK: rank 0's LoRA index, pool geometry and graph replays; each worker compares its own
  (integrity).
- STOP: the workers exit.

Rank 0's allocator decides every page, slot and row; workers only follow, so the pools stay in
step. Commands go out on the engine's step thread only: a row cleared from another thread is
queued and sent before the next command. A worker that dies makes rank 0's next collective
fail (or is found dead before it; on CUDA, a thread that watches the workers aborts the NCCL
group, whose kernels would otherwise wait for the dead rank for good): the step fails, and the
engine stops as when its own process dies.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import zlib
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from kernels import LoraIndex
from services.inference.arena import SharedArena
from services.inference.engine.config import EngineConfig
from services.inference.engine.errors import ModelLoadError
from services.inference.engine.host_adapter import HostAdapter
from services.inference.engine.model_runner import NO_GRAPH

log = logging.getLogger(__name__)

HEADER = 12  # int64 fields of a command header
STEP, LOAD, CLEAR, CHECK, STOP = range(1, 6)
# A collective that has not completed by then fails (a hung peer). Workers wait for commands
# without a limit: the engine may be idle for hours.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
IDLE_TIMEOUT = timedelta(days=365)
_REPO = Path(__file__).resolve().parents[3]


def cpu_threads(size: int) -> int:
    """Threads of each rank's CPU kernels: the cores shared out. More would spin against each
    other (two ranks of two threads each on two cores: a tiny model's decode step 76 ms,
    against 12-15 with one thread each; bench/tp_decode.py)."""
    return max(1, (os.cpu_count() or 1) // size)


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process ended: the engine cannot step any more."""


class WorkerLayout(NamedTuple):
    """What rank 0 decided and every worker needs to build the same pool, index and batch."""

    num_pages: int
    max_num_seqs: int
    max_loras: int
    slot_capacity: int
    max_len: int


class Group:
    """One rank's end of the control and compute groups."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.ctl = dist.ProcessGroupGloo(
            dist.PrefixStore("ctl", store), rank, size, COLLECTIVE_TIMEOUT
        )
        if device.type == "cuda":
            self.compute = dist.ProcessGroupNCCL(
                dist.PrefixStore("compute", store), rank, size, dist.ProcessGroupNCCL.Options()
            )
        else:
            self.compute = self.ctl

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum ``x`` (on this rank's device) over the ranks, in place: the model's hook."""
        self.compute.allreduce([x]).wait()

    def broadcast(self, x: torch.Tensor) -> None:
        """Rank 0's ``x`` (on this rank's device) into every rank's."""
        self.compute.broadcast(x, 0).wait()

    def header(self, fields: list[int] | None = None, idle: bool = False) -> list[int]:
        """Send (rank 0, ``fields``) or receive a command header; ``idle``: wait without limit."""
        h = torch.zeros(HEADER, dtype=torch.int64)
        if fields is not None:
            h[: len(fields)] = torch.tensor(fields, dtype=torch.int64)
        if idle:
            self.ctl.broadcast(h, 0, IDLE_TIMEOUT).wait()
        else:
            self.ctl.broadcast(h, 0).wait()
        return h.tolist()

    def host(self, x: torch.Tensor) -> None:
        """Broadcast a host tensor from rank 0 on the control group."""
        self.ctl.broadcast(x, 0).wait()

    def flags(self, mine: int) -> list[int]:
        """Every rank's ``mine`` (0 = fine), one all-reduce."""
        f = torch.zeros(self.size, dtype=torch.int64)
        f[self.rank] = mine
        self.ctl.allreduce([f]).wait()
        return f.tolist()


def graphs_digest(keys: list) -> int:
    """A digest of a list of graph keys, the same in every process (TensorParallel.agree_graphs)."""
    return zlib.crc32(repr(keys).encode())


def send_bytes(group: Group, data: bytes | None) -> bytes:
    """Rank 0's ``data`` to every rank: its length in a header, then the bytes (the others
    wait without limit: rank 0 may take long to get there, loading its own shard)."""
    n = group.header([len(data)] if data is not None else None, idle=data is None)[0]
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None else None
    if buf is None:
        buf = torch.empty(n, dtype=torch.uint8)
    if n:
        group.host(buf)
    return buf.numpy().tobytes()


def index_tensors(index: LoraIndex) -> list[torch.Tensor]:
    """The index's tensors on the host, for comparing ranks' copies."""
    return [t.cpu() for t in index]


class TensorParallel:
    """Rank 0's end: starts the workers, sends them the engine's commands."""

    def __init__(self, config: EngineConfig, arena: SharedArena | None = None) -> None:
        """``arena``: where the engine's adapter bytes lie (the engine process's host arena),
        mapped by the workers too."""
        n = config.tensor_parallel_size
        self.size = n
        self._arena = arena
        self.shared_loads = self.sent_loads = 0  # LOADs whose bytes were named, or sent
        self._store = dist.TCPStore(
            "127.0.0.1", 0, n, True, timedelta(hours=1), wait_for_workers=False
        )  # port 0: a free one
        port = self._store.port
        self._store.set("config", pickle.dumps(config))
        # NVLink multicast (NCCL's NVLS) off unless the operator says otherwise, in this process
        # and the workers: a step's all-reduces are small (its activations), where it gains
        # little, and on a host whose GPUs others share, a program that uses it can put them
        # out of service.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), env.get("PYTHONPATH")]))
        self.workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "services.inference.engine.tp_worker",
                    str(rank),
                    str(n),
                    str(port),
                    *([] if arena is None else [str(arena.fd), str(arena.buffer.numel())]),
                ],
                env=env,
                pass_fds=() if arena is None else (arena.fd,),
            )  # fmt: skip
            for rank in range(1, n)
        ]
        self._lock = threading.Lock()
        self._cleared: list[int] = []  # rows cleared off the step thread, sent before the next
        self._closed = False
        self._threads = torch.get_num_threads()
        if config.torch_device.type == "cpu":  # the workers take as many (tp_worker.main)
            torch.set_num_threads(cpu_threads(n))
        try:
            self.group = Group(self._store, 0, n, config.torch_device)
        except BaseException:
            self._kill()
            raise
        if config.torch_device.type == "cuda":
            threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        log.info("tensor parallel: %d ranks (workers %s)", n, [p.pid for p in self.workers])

    def ready(self, layout: WorkerLayout) -> None:
        """Send the layout; once every worker has built its pool, return (ModelLoadError with
        the workers' reasons if one could not)."""
        self.check_alive()
        send_bytes(self.group, pickle.dumps(layout))
        failed = [r for r, f in enumerate(self.group.flags(0)) if f]
        if failed:
            reasons = [self._store.get(f"error{r}").decode() for r in failed]
            self._reap()  # the workers exit on their own after a failed start
            raise ModelLoadError(f"tensor-parallel workers {failed} could not start: {reasons}")

    def agree_graphs(self, keys: list) -> None:
        """Before any capture: every worker lists the graphs it would capture (ModelRunner.
        graph_keys, on any device) and compares them with rank 0's ``keys``, in order. Graphs
        that differ would pair one rank's captured collectives with another's and hang the
        start; this fails it with ModelLoadError instead."""
        self.group.header([graphs_digest(keys)])
        differ = [r for r, f in enumerate(self.group.flags(0)) if f]
        if differ:
            self._reap()  # the workers exit on their own after a failed start
            raise ModelLoadError(
                f"tensor-parallel ranks {differ} would capture other CUDA graphs than rank 0"
            )

    # --- commands (the step thread) ----------------------------------------------------------

    def _command(self, fields: list[int]) -> None:
        self.check_alive()
        with self._lock:
            cleared, self._cleared = self._cleared, []
        for row in cleared:
            self.group.header([CLEAR, row])
        self.group.header(fields)

    def send_step(self, batch, step, graph=None) -> None:
        """The filled StepBatch, its LoRA path (ModelRunner's StepLora) and the CUDA graph that
        runs it (ModelRunner's GraphKey; None: eager) to every worker; the forward pass (or
        the same graph's replay) follows on every rank."""
        key = NO_GRAPH if graph is None else graph.encode()
        self._command([STEP, *map(int, batch.counts), *step.encode(), *key])
        self.group.host(batch.wire(batch.num_seqs))

    def broadcast(self, x: torch.Tensor) -> None:
        """The step's sampled inputs from this rank to the workers (ModelRunner._forward)."""
        self.group.broadcast(x)

    def load(self, host: HostAdapter, row: int, slots: torch.Tensor) -> None:
        """Every worker writes its shard of ``host`` into ``slots`` and index ``row``. Bytes in
        the shared arena are named (their offset), and this returns once every worker has read
        them (the block may be reused after); others are sent whole."""
        meta = pickle.dumps(dataclasses.replace(host, raw=torch.empty(0, dtype=torch.uint8)))
        offset = self._arena_offset(host.raw)
        self._command([LOAD, row, slots.numel(), len(meta), host.raw.numel(), offset])
        self.group.host(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
        self.group.host(slots.to(torch.int64).contiguous())
        if offset < 0:
            raw = host.raw if host.raw.is_contiguous() else host.raw.contiguous()
            self.group.host(raw)
            self.sent_loads += 1
        else:
            self.group.flags(0)  # each worker's, once its copy has read the block
            self.shared_loads += 1

    def _arena_offset(self, raw: torch.Tensor) -> int:
        """Where ``raw`` lies in the shared arena, or -1 where it does not."""
        if self._arena is None or raw.device.type != "cpu" or not raw.is_contiguous():
            return -1
        offset = raw.data_ptr() - self._arena.buffer.data_ptr()
        inside = 0 <= offset and offset + raw.numel() <= self._arena.buffer.numel()
        return offset if inside else -1

    def clear_row(self, row: int) -> None:
        """An index row was given back (any thread): sent before the next command."""
        with self._lock:
            self._cleared.append(row)

    def check(self, index: LoraIndex, num_pages: int, page_size: int, graph_steps: int) -> None:
        """AssertionError unless every worker's LoRA index equals rank 0's, its pool has the
        same pages and slots (the KV pages and slots are the step's, sent to all) and it
        replayed as many CUDA graphs."""
        self._command([CHECK, num_pages, page_size, graph_steps])
        for t in index_tensors(index):
            self.group.host(t)
        bad = [r for r, f in enumerate(self.group.flags(0)) if f]
        if bad:
            raise AssertionError(f"tensor-parallel ranks {bad} are out of step with rank 0")

    def close(self) -> None:
        """Stop the workers (STOP if they can still hear it) and wait for them."""
        if self._closed:
            return
        if any(p.poll() is not None for p in self.workers):
            self._kill()  # the others are stuck in a collective with the one that is gone
            return
        self._end()
        try:
            self.group.header([STOP])
        except Exception:  # noqa: BLE001 (they are killed below if they do not exit)
            log.warning("tensor-parallel workers did not take STOP; killing them")
        self._reap()

    def failure(self, cause: BaseException) -> WorkerDied:
        """What a failed collective means: a worker that exited (waited for briefly, since its
        exit is what broke the connection), or the group itself."""
        for p in self.workers:
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                continue
        try:
            self.check_alive()
        except WorkerDied as died:
            return died
        return WorkerDied(f"the tensor-parallel group failed: {cause}")

    def _watch(self) -> None:
        """CUDA: a worker that exits leaves this rank's NCCL kernels waiting for it (a step's
        collectives, or a capture's warm-up) and the host's waits for the device with them, for
        good: a collective inside a CUDA graph has no timeout. So the compute group is aborted
        then: its kernels end, the next command finds the worker gone and the engine stops, as
        on the CPU, where gloo's connections fail by themselves."""
        while not self._closed:
            dead = self._dead()
            if dead:
                if not self._closed:
                    log.error("tensor-parallel workers exited (rank, exit code): %s; aborting "
                              "the NCCL group", dead)  # fmt: skip
                    try:
                        self.group.compute.abort()
                    except Exception:  # noqa: BLE001 (the engine still finds the worker gone)
                        log.exception("could not abort the NCCL group")
                return
            time.sleep(0.5)

    def _kill(self) -> None:
        self._end()
        for p in self.workers:
            if p.poll() is None:
                p.kill()
            p.wait()

    def _reap(self) -> None:
        self._end()
        for p in self.workers:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _end(self) -> None:
        """The group is over: this process's threads as they were."""
        if not self._closed:
            log.info("tensor parallel: %d adapter loads read by the workers from the shared "
                     "arena, %d sent to them", self.shared_loads, self.sent_loads)  # fmt: skip
        self._closed = True
        torch.set_num_threads(self._threads)

    def _dead(self) -> list[tuple[int, int]]:
        """(rank, exit code) of each worker that exited."""
        return [(r + 1, p.returncode) for r, p in enumerate(self.workers) if p.poll() is not None]

    def check_alive(self) -> None:
        """WorkerDied if a worker exited (the step loop asks each turn, idle or not)."""
        dead = self._dead()
        if dead:
            raise WorkerDied(f"tensor-parallel workers exited (rank, exit code): {dead}")
