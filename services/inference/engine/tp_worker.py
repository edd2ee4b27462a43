"""A tensor-parallel worker: ranks 1..N-1 of an engine (engine/tensor_parallel.py is rank 0's end).

``python -m services.inference.engine.tp_worker RANK SIZE PORT [ARENA_FD ARENA_BYTES]``: meets
rank 0 through the TCP store on PORT, reads the EngineConfig there, loads its shard of the
weights, builds its pool, LoRA index and step batch with rank 0's layout, maps the engine's host
arena if given (LOADs may name their bytes there), agrees with rank 0 on the CUDA graphs to
capture and captures them (on CUDA), then follows rank 0's commands until STOP. It has no
scheduler, sampler or allocator: every page, slot and row is rank 0's choice. It exits when its
parent (the engine) does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from services.inference.arena import map_shared
from services.inference.engine.adapter_copy import to_device, warm_up, write_adapter, write_row
from services.inference.engine.adapter_manager import new_lora_index
from services.inference.engine.config import EngineConfig
from services.inference.engine.model_runner import GraphKey, ModelRunner, StepLora
from services.inference.engine.page_pool import PagePool
from services.inference.engine.pool_sizing import context_window
from services.inference.engine.tensor_parallel import (
    CHECK,
    CLEAR,
    LOAD,
    STEP,
    STOP,
    Group,
    WorkerLayout,
    cpu_threads,
    graphs_digest,
    index_tensors,
    send_bytes,
)  # fmt: skip
from services.inference.models.config import ModelConfig
from services.inference.models.loader import load_model
from services.inference.models.shard import Shard, shard_model_config

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, group: Group, arena: torch.Tensor | None) -> None:
        """``arena``: the engine's host arena mapped here (where LOADs may name their bytes)."""
        self.config, self.group, self.arena = config, group, arena
        self.shard = Shard(group.rank, group.size)
        self.device, self.dtype = group.device, config.torch_dtype
        self.model_config = ModelConfig.from_model_dir(config.model_dir)
        max_len = context_window(self.model_config, config.max_model_len)
        self.model = load_model(
            config.model_dir, self.device, self.dtype, max_len, self.model_config, self.shard,
            config.load_format,
        )  # fmt: skip
        self.model.join_group(group.all_reduce)

    def build(self, layout: WorkerLayout) -> None:
        mc = shard_model_config(self.model_config, self.shard.size)
        self.pool = PagePool(
            mc.num_layers, mc.kv_dim, layout.num_pages, self.config.page_size, self.dtype,
            self.device,
        )  # fmt: skip
        self.index = new_lora_index(layout.max_loras, layout.slot_capacity, self.device)
        warm_up(self.pool.tensor, self.index.slot_table[0])
        self.runner = ModelRunner(
            self.model, self.pool, self.index, self.config.max_lora_rank, layout.max_num_seqs,
            self.config.max_num_batched_tokens, layout.max_len, layout.max_loras,
            [0] * layout.max_loras, lora_side_stream=self.config.lora_side_stream,
            lora_addend=self.config.lora_addend,
        )  # fmt: skip
        self.runner.tp = self.group
        self.max_num_seqs = layout.max_num_seqs
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def capture(self) -> bool:
        """Rank 0's CUDA graphs, captured in step with it (their collectives meet its), once
        both sides agree on the list (TensorParallel.agree_graphs); False if they do not."""
        sizes = self.config.graph_sizes(self.max_num_seqs)
        theirs = self.group.header()[0]
        same = graphs_digest(self.runner.graph_keys(*sizes)) == theirs
        self.group.flags(0 if same else 1)
        if not same:
            log.error("rank %d would capture other CUDA graphs than rank 0", self.group.rank)
            return False
        if self.config.cuda_graphs and self.device.type == "cuda":
            self.runner.capture_graphs(*sizes)
        return True

    @torch.inference_mode()
    def loop(self) -> None:
        g = self.group
        while True:
            cmd, *args = g.header(idle=True)
            if cmd == STEP:
                batch = self.runner.batch
                batch.wait_staging()
                g.host(batch.wire(args[1]))  # the step's sequences: counts[1]
                batch.adopt((*args[:4], bool(args[4])))
                step, key = StepLora.decode(args[5], args[6]), GraphKey.decode(args[7:11])
                self.runner.forward_adopted(step, key)
            elif cmd == LOAD:
                self._load(*args[:5])
            elif cmd == CLEAR:
                self.index.ranks[args[0]].zero_()
            elif cmd == CHECK:
                g.flags(0 if self._in_step(*args[:3]) else 1)
            elif cmd == STOP:
                return
            else:
                raise RuntimeError(f"unknown tensor-parallel command {cmd}")

    def _load(self, row: int, num_slots: int, meta_len: int, raw_len: int, offset: int) -> None:
        """Write this rank's shard of an adapter; its bytes come over the group, or lie in the
        shared arena at ``offset`` (>= 0): then rank 0 waits for this rank's word that they
        were read, since the block may be reused after."""
        g = self.group
        meta = torch.empty(meta_len, dtype=torch.uint8)
        g.host(meta)
        slots = torch.empty(num_slots, dtype=torch.int64)
        g.host(slots)
        if offset < 0:
            raw = torch.empty(raw_len, dtype=torch.uint8)
            g.host(raw)
        else:
            raw = self.arena[offset : offset + raw_len]
        host = pickle.loads(meta.numpy().tobytes())
        host = dataclasses.replace(host, raw=raw, shard=self.shard)
        write_row(self.index, row, host, slots)
        table = self.index.slot_table[row, :num_slots]  # the slots, on the device
        device = self.pool.tensor.device
        if offset >= 0 and device.type == "cuda":
            # The block is read on a stream of its own, so that the word to rank 0 waits for
            # this copy only, not for the step this rank's GPU may still be computing.
            with torch.cuda.stream(self._copy_stream):
                staged = to_device(raw, device)
            self._copy_stream.synchronize()
            staged.record_stream(torch.cuda.current_stream(device))  # the write below reads it
        else:
            staged = to_device(raw, device)
        if offset >= 0:
            g.flags(0)  # the block is read (on the CPU, copied already)
        write_adapter(self.pool.tensor, host, table, staged)

    def _in_step(self, num_pages: int, page_size: int, graph_steps: int) -> bool:
        """Whether this rank's LoRA index, pool geometry and graph replays equal rank 0's (sent
        now)."""
        mine = index_tensors(self.index)
        theirs = [torch.empty_like(t) for t in mine]
        for t in theirs:
            self.group.host(t)
        same = all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
        pool = (self.pool.num_pages, self.pool.page_size) == (num_pages, page_size)
        graphs = self.runner.graph_steps == graph_steps
        if not (same and pool and graphs):
            log.error("rank %d is out of step: index equal %s, pool equal %s, graph replays "
                      "%d against rank 0's %d", self.group.rank, same, pool,
                      self.runner.graph_steps, graph_steps)  # fmt: skip
        return same and pool and graphs


def _exit_with_parent() -> None:
    """The engine process is this worker's parent: when it is gone, so is the worker."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    rank, size, port = (int(a) for a in argv[:3])
    shared = [int(a) for a in argv[3:5]]  # the engine's host arena: its fd and size, if any
    # The engine process handles signals and stops this worker in order (STOP, or its exit).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s tp-worker-{rank} %(name)s %(levelname)s: %(message)s",
    )
    _exit_with_parent()
    store = dist.TCPStore("127.0.0.1", port, size, False, timedelta(hours=1))
    config: EngineConfig = pickle.loads(store.get("config"))
    device = config.torch_device
    if device.type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(cpu_threads(size))
    group = Group(store, rank, size, device)
    error, worker = None, None
    try:
        arena = map_shared(*shared, pin=device.type == "cuda") if shared else None
        worker = Worker(config, group, arena)
    except Exception as exc:  # noqa: BLE001 (reported to rank 0, which raises it)
        log.exception("could not load the shard")
        error = f"{type(exc).__name__}: {exc}"
    layout = pickle.loads(send_bytes(group, None))
    if error is None:
        try:
            worker.build(layout)
        except Exception as exc:  # noqa: BLE001 (reported to rank 0, which raises it)
            log.exception("could not build the pool")
            error = f"{type(exc).__name__}: {exc}"
    if error is not None:
        store.set(f"error{rank}", error)
    if any(group.flags(0 if error is None else 1)):
        return 1
    if not worker.capture():
        return 1
    worker.loop()
    return 0


if __name__ == "__main__":
    from services.inference.engine import tp_worker

    sys.exit(tp_worker.main(sys.argv[1:]))
