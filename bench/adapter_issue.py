"""Host time of starting adapter copies on the step thread: begin_load (pages, index row) and
issue (the copy queued on the side stream), per adapter, for a burst of adapters wanted at once.

A burst is what the engine meets when many queued requests' adapters sit in host memory but
not in the pool (every request of a saturating trace arrives at once, the pool emptied of KV):
the scheduler begins a load for each in queue order and the step thread issues them all while
the step computes. Their host time passes on the step thread; past a step's slack the GPU idles.

Two file layouts: "regular" (each module's matrices at equal distances, layer after layer, as
store/synthetic.py writes them) and "sorted" (tensors in name order, as safetensors' own writer
lays a PEFT file out: layers.10 before layers.2), whose layers are not at equal distances.
Two write paths, side by side: "kernel" (kernels/adapter_write.py, the CUDA path) and "torch"
(adapter_copy.write_adapter_torch, the CPU path, forced here on the device). A first issue
builds the adapter's pieces table (HostAdapter.pieces), as an adapter's first load does.

    python bench/adapter_issue.py                      # CUDA, Llama-7B shape, S1 adapters
    python bench/adapter_issue.py --device cpu --shape tiny --adapters 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.bench_models import SHAPES  # noqa: E402
from bench.provenance import write_result  # noqa: E402
from services.inference.engine import adapter_copy  # noqa: E402
from services.inference.engine.adapter_manager import AdapterManager  # noqa: E402
from services.inference.engine.host_adapter import build_host_adapter  # noqa: E402
from services.inference.engine.page_pool import PagePool  # noqa: E402
from services.inference.engine.pool_sizing import slot_capacity  # noqa: E402
from store.synthetic import (  # noqa: E402
    lora_config_json,
    lora_tensors,
    safetensors_bytes,
)

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
PAGE = 16


def adapter_file(base, rank: int, layout: str) -> tuple[bytes, bytes]:
    tensors = dict(lora_tensors(base, rank, MODULES, "BF16", seed=rank))
    if layout == "sorted":
        tensors = dict(sorted(tensors.items()))
    return lora_config_json(rank, 2.0 * rank, MODULES), safetensors_bytes(tensors)


def torch_path(pool, host, slots, src) -> None:
    adapter_copy.write_adapter_torch(pool, host, slots.long(), src)


def burst(args, base, layout: str, path: str, device: torch.device) -> dict:
    config, weights = adapter_file(base, args.rank, layout)
    width = base.hidden_size
    cap = slot_capacity(base, args.rank, width, PAGE)
    pages = (cap // PAGE) * (args.adapters + 1)
    pool = PagePool(base.num_layers, width, pages, PAGE, torch.bfloat16, device)
    manager = AdapterManager(pool, args.adapters, cap)
    pin = device.type == "cuda"
    hosts = [
        build_host_adapter(i, config, weights, base, width, args.rank, pin)
        for i in range(args.adapters)
    ]
    for h in hosts:
        manager.add(h)
    if device.type == "cuda":
        torch.cuda.synchronize()
    begin, issue = [], []
    t0 = time.perf_counter()
    for h in hosts:
        s = time.perf_counter()
        manager.begin_load(h.key)
        begin.append(time.perf_counter() - s)
    kernel_path = adapter_copy.write_adapter
    if path == "torch":
        adapter_copy.write_adapter = torch_path
    try:
        for ticket in list(manager._unissued):
            s = time.perf_counter()
            manager.copier.issue(ticket)
            issue.append(time.perf_counter() - s)
    finally:
        adapter_copy.write_adapter = kernel_path
    manager._unissued.clear()
    host_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
    done_s = time.perf_counter() - t0
    manager.poll_loads()
    copies = list(manager.copy_seconds)
    return {
        "layout": layout,
        "path": path,
        "adapters": args.adapters,
        "mb_each": round(len(weights) / 1e6, 1),
        "begin_ms_p50": round(1e3 * statistics.median(begin), 3),
        "issue_ms_p50": round(1e3 * statistics.median(issue), 3),
        "host_ms_per_adapter": round(1e3 * host_s / args.adapters, 3),
        "burst_host_ms": round(1e3 * host_s, 1),
        "burst_done_ms": round(1e3 * done_s, 1),
        "copy_ms_p50": round(1e3 * statistics.median(copies), 3) if copies else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--adapters", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--layouts", nargs="+", default=["regular", "sorted"])
    parser.add_argument("--paths", nargs="+", default=["kernel", "torch"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/adapter_issue.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    base = SHAPES[args.shape].base()
    rows = []
    for _ in range(args.repeats):
        for layout in args.layouts:
            for path in args.paths:
                rows.append(burst(args, base, layout, path, device))
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    write_result(args.out, "adapter_issue.py", {"device": name, "shape": args.shape,
                                                 "rank": args.rank, "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
