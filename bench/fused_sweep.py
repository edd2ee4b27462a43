"""Launch-configuration sweep of the fused decode LoRA kernel (kernels/lora_fused.py).

    python -m bench.fused_sweep [--json bench/results/fused_sweep.json] [--workers N]
        [--ranks 8 16] [--batches 256] [--blocks 256 512] [--parts 0 2] [--stages 3] [--warps 4]
    TRITON_INTERPRET=1 python -m bench.fused_sweep --tiny     # CPU: the plumbing, no speeds

For (rank, batch) in {16, 64} x {128, 256, 512}, distinct adapters, one Llama-2-7B layer's seven
projections as bench/kernels.py runs them (its four calls, pool set-up, byte count and CUDA-graph
timing), every point of a grid of fused launches: weight block (shrink_k = expand_n), parts
(fused_config's choice, or fixed for every call), pipeline stages, warps; 16-token tiles. Points
that give every call the same launch as an earlier point are timed once.

Each point's outputs are checked once against the default point's (fused_config's launch for one
slice, default_point),
and the default's against the float64 reference (kernels/lora_ref.py): a point that computes
something else is reported as wrong and never ranked.

Triton compiles about a thousand kernels here (each point once per call, rank and tile-scan
width); worker processes compile them first, in parallel, into Triton's on-disk cache, and the
sweep loads them from there.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import itertools
import json
import logging
import multiprocessing
import os
import pathlib
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from typing import NamedTuple

import torch

from bench import kernels as bk
from kernels import lora, lora_paths, lora_ref
from kernels.lora_layout import DOWN, GATE, UP, K, O, Q, V
from kernels.lora_ref import LoraTokens, make_lora_tokens

log = logging.getLogger("bench.fused_sweep")

# "Same values": the kernel tests' bfloat16 bounds (tests/kernels/sizes.py) on each call's output,
# norm = ||out - ref|| / ||ref|| and peak = max|out - ref| / max|ref|. Correct launches can differ
# only by roundings of h and y (about 2^-8 in norm at most; on the H200 the grid's launches agreed
# bit for bit); a launch that drops one 32-column block of a 4096-wide output is 0.09 off in norm.
TOL_NORM, TOL_PEAK = 2e-2, 6e-2
TOP = 5
RETIMES = 3  # more timings of the default and the first pass's fastest points


class Geometry(NamedTuple):
    """What bench/kernels.py's helpers read from its module globals."""

    device: torch.device
    pool_w: int
    dims: dict[int, tuple[int, int]]
    calls: tuple


def _tiny_geometry(device: torch.device) -> Geometry:
    h, inter, w = 64, 96, 32  # every block of the tiny grid divides every width
    dims = {m: (h, h) for m in (Q, K, V, O)} | {GATE: (h, inter), UP: (h, inter), DOWN: (inter, h)}
    calls = (((Q, K, V), h, (h, h, h)), ((O,), h, (h,)), ((GATE, UP), h, (inter, inter)))
    return Geometry(device, w, dims, calls + (((DOWN,), inter, (h,)),))


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """The grid; parts None is fused_config's own choice (per call)."""

    ranks: tuple[int, ...] = (16, 64)
    batches: tuple[int, ...] = (128, 256, 512)
    blocks: tuple[int, ...] = (32, 64, 128, 256)
    parts: tuple[int | None, ...] = (None, 1, 2, 4, 8)
    stages: tuple[int, ...] = (2, 3, 4)
    warps: tuple[int, ...] = (2, 4, 8)
    block_m: int = 16
    tiny: bool = False  # small shapes (the CPU interpreter can run them)
    workers: int = 0  # compile processes before the sweep; 0: the sweep compiles as it goes

    def __post_init__(self):
        pow2 = {
            "blocks": self.blocks,
            "warps": self.warps,
            "block_m": (self.block_m,),
        }
        for name, vals in pow2.items():
            if not vals or any(v < 1 or v & (v - 1) for v in vals):
                raise ValueError(f"{name} must be powers of two, got {vals}")
        if min(self.blocks) < 16 or self.block_m < 16:
            raise ValueError("blocks and block_m must be >= 16 (tl.dot's smallest tile)")
        if not self.ranks or any(not 0 < r <= lora_paths.FUSED_MAX_RANK for r in self.ranks):
            raise ValueError(f"ranks must be in 1..{lora_paths.FUSED_MAX_RANK}, got {self.ranks}")
        if not self.batches or any(b < 1 for b in self.batches):
            raise ValueError(f"batches must be positive, got {self.batches}")
        if not self.parts or any(p is not None and p < 1 for p in self.parts):
            raise ValueError(f"parts must be positive or None, got {self.parts}")
        if not self.stages or any(s < 1 for s in self.stages):
            raise ValueError(f"stages must be positive, got {self.stages}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")

    @property
    def geometry(self) -> Geometry:
        if not self.tiny:
            return Geometry(torch.device("cuda"), bk.POOL_W, bk.DIMS, bk.CALLS)
        return _tiny_geometry(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


# The default point (block 32 at these widths) and two others; under the interpreter every run
# of one layer takes a second or two.
TINY = SweepConfig(
    ranks=(8, 16), batches=(3,), blocks=(16,), parts=(None, 2), stages=(2,), warps=(4,), tiny=True
)


class SweepPoint(NamedTuple):
    block: int  # shrink_k, and expand_n unless block_n says otherwise
    parts: int | None  # None: fused_config's choice for each call
    stages: int
    warps: int
    block_n: int | None = None  # expand_n when it differs (fused_config's smaller sm_90 blocks)

    def changes(self, block_m: int) -> dict:
        """bench/kernels.py's form: changes to each call's fused_config."""
        out = dict(path="fused", block_m=block_m, shrink_k=self.block,
                   expand_n=self.block_n or self.block)  # fmt: skip
        out.update(stages=self.stages, shrink_warps=self.warps)
        return out if self.parts is None else out | {"parts": self.parts}


class Status(enum.Enum):
    OK = "ok"
    WRONG = "wrong"  # outputs differ from the default's (or the default's from the reference)
    FAILED = "failed"  # did not compile or launch (e.g. out of shared memory)


@dataclasses.dataclass
class PointResult:
    point: SweepPoint
    parts_per_call: tuple[int, ...]
    status: Status
    runs: list[float] = dataclasses.field(default_factory=list)  # per-layer µs of each timing
    share: float | None = None  # of the copy bandwidth, at graph_us
    norm_err: float | None = None  # worst call's, against the default's outputs
    peak_err: float | None = None
    message: str = ""

    @property
    def graph_us(self) -> float | None:
        return round(statistics.median(self.runs), 2) if self.runs else None

    def row(self) -> dict:
        return dict(
            self.point._asdict(),
            parts_per_call=list(self.parts_per_call),
            status=self.status.value,
            graph_us=self.graph_us,
            runs=self.runs,
            share=self.share,
            norm_err=self.norm_err,
            peak_err=self.peak_err,
            message=self.message,
        )


def default_point(cfg: SweepConfig, rank: int, batch: int) -> SweepPoint:
    """fused_config's blocks, stages and warps for a one-slice call of the batch, given to
    every call (its parts per call). On sm_90 fused_config picks smaller blocks for calls whose
    programs fit one wave of them only (kernels/lora.py _NARROW); this point takes the
    one-slice call's choice for all four (at rank 64, batch 512: the smaller blocks for q/k/v
    and gate/up too, which fused_config gives the default blocks)."""
    g = cfg.geometry
    d = lora.fused_config(batch, g.pool_w, rank, 1, g.dims[Q][1], d_in=g.dims[Q][0])
    block_n = None if d.expand_n == d.shrink_k else d.expand_n
    return SweepPoint(d.shrink_k, None, d.stages, d.shrink_warps, block_n)


def grid(cfg: SweepConfig, rank: int, batch: int) -> list[SweepPoint]:
    """The default point first, then the grid (which may hold it again: launches dedupe it)."""
    axes = itertools.product(cfg.blocks, cfg.parts, cfg.stages, cfg.warps)
    return [default_point(cfg, rank, batch)] + [SweepPoint(*a) for a in axes]


def launches(cfg: SweepConfig, point: SweepPoint, rank: int, batch: int) -> list[lora.LoraLaunch]:
    """Each call's LoraLaunch, as bench/kernels.py's lora_layer_fns derives it."""
    ch = point.changes(cfg.block_m)
    return [bk._call_config(batch, d, rank, m, w, ch) for m, d, w in cfg.geometry.calls]


@contextlib.contextmanager
def bench_geometry(g: Geometry):
    """bench/kernels.py's helpers read the device, pool width and module dims from its module
    globals (the Llama-2-7B layer on CUDA); --tiny points them at small CPU shapes meanwhile."""
    saved = (bk.DEV, bk.POOL_W, bk.DIMS)
    bk.DEV, bk.POOL_W, bk.DIMS = g.device, g.pool_w, g.dims
    try:
        yield
    finally:
        bk.DEV, bk.POOL_W, bk.DIMS = saved


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(norm, peak) relative errors; infinite where out holds NaN."""
    if torch.isnan(out).any():
        return float("inf"), float("inf")
    diff = (out.double() - ref.double()).abs()
    norm = diff.norm() / ref.double().norm().clamp_min(1e-30)
    return float(norm), float(diff.max() / ref.double().abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------- compiling ahead


class CompileTask(NamedTuple):
    rank: int
    batch: int
    block: int
    stages: int
    warps: int
    block_m: int
    block_n: int | None = None


def compile_tasks(cfg: SweepConfig) -> list[CompileTask]:
    """One task per kernel family the sweep will launch. A kernel does not depend on the batch
    (its tiles come from a host-built table), so the first batch's case compiles for all."""
    out = set()
    for rank, batch in itertools.product(cfg.ranks, cfg.batches):
        for p in grid(cfg, rank, batch):
            out.add(CompileTask(rank, cfg.batches[0], p.block, p.stages, p.warps, cfg.block_m,
                                p.block_n))  # fmt: skip
    # by case first: a worker mostly reuses the case it built last
    return sorted(out, key=lambda t: t._replace(block_n=t.block_n or 0))


_WORKER_CASE: dict[tuple[int, int], bk.LoraCase] = {}


def compile_one(task: CompileTask) -> str:
    """Runs a task's kernels once (filling Triton's cache); returns an error message or ""."""
    key = (task.rank, task.batch)
    if key not in _WORKER_CASE:
        _WORKER_CASE.clear()
        # Kernels specialize on shapes, strides and constexprs, not on the adapter count: 8
        # adapters alternating over `batch` tokens compile what `batch` distinct ones do.
        rows = torch.arange(task.batch, dtype=torch.int32) % 8
        _WORKER_CASE[key] = bk.build_lora(8, task.rank, 1, rows)
    case = _WORKER_CASE[key]
    # Triton specializes an int argument equal to 1 (PARTS): compile both variants.
    for parts in (1, 2):
        point = SweepPoint(task.block, parts, task.stages, task.warps, task.block_n)
        changes = point.changes(task.block_m)
        try:
            run, _ = bk.lora_layer_fns(case, task.rank, 1, changes)
            run()
            torch.cuda.synchronize()
        except Exception as e:  # reported; the sweep meets the same error and records it
            return f"{task}: {type(e).__name__}: {e}"
    return ""


def compile_ahead(cfg: SweepConfig) -> None:
    tasks = compile_tasks(cfg)
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    with ProcessPoolExecutor(cfg.workers, mp_context=ctx) as pool:
        failed = [m for m in pool.map(compile_one, tasks) if m]
    log.info("compiled %d kernel families in %.0f s", len(tasks), time.perf_counter() - t0)
    for m in failed:
        log.warning("compile: %s", m)


# ---------------------------------------------------------------- the sweep


class Case(NamedTuple):
    """One (rank, batch) case: bench/kernels.py's pool and a fixed input for the checks."""

    rank: int
    batch: int
    layers: int
    nbytes: int
    setup: bk.LoraCase
    tokens: LoraTokens
    xs: list[torch.Tensor]


def build_case(g: Geometry, rank: int, batch: int) -> Case:
    rows, n = bk.popularity("distinct", batch, torch.Generator())
    nbytes = bk.lora_bytes(rows, rank, batch, g.calls)
    layers = bk.layers_for(nbytes) if g.device.type == "cuda" else 1
    lc = bk.build_lora(n, rank, layers, rows)
    tokens = make_lora_tokens(lc.rows, capacity=batch + 2)  # as lora_layer_fns: segments + 2
    xs = [torch.randn(batch, d, dtype=bk.DT, device=g.device) for _, d, _ in g.calls]
    return Case(rank, batch, layers, nbytes, lc, tokens, xs)


def outputs(g: Geometry, case: Case, cfgs: list[lora.LoraLaunch]) -> list[torch.Tensor]:
    """Each call's output from zeros, layer 0, one launch each."""
    ys = []
    for (mods, _, widths), x, c in zip(g.calls, case.xs, cfgs, strict=True):
        y = torch.zeros(case.batch, sum(widths), dtype=bk.DT, device=g.device)
        pool, index = case.setup.pool[0], case.setup.index
        lora.lora_apply(y, x, pool, index, case.tokens, mods, widths, case.rank, config=c)
        ys.append(y)
    return ys


def reference_errors(g: Geometry, case: Case, ys: list[torch.Tensor]) -> tuple[float, float]:
    """Worst call's (norm, peak) error of ys against the float64 reference."""
    worst = (0.0, 0.0)
    for (mods, _, widths), x, y in zip(g.calls, case.xs, ys, strict=True):
        ref = torch.zeros(case.batch, sum(widths), dtype=torch.float64, device=g.device)
        idx = case.setup.index
        lora_ref.lora_apply(
            ref, x.double(), case.setup.pool[0], idx, case.tokens, mods, widths, case.rank
        )
        worst = tuple(max(a, b) for a, b in zip(worst, errors(y, ref), strict=True))
    return worst


def sweep_case(cfg: SweepConfig, rank: int, batch: int, copy_bw: float) -> dict:
    g = cfg.geometry
    case = build_case(g, rank, batch)
    points = grid(cfg, rank, batch)
    ref_ys = outputs(g, case, launches(cfg, points[0], rank, batch))
    ref_err = reference_errors(g, case, ref_ys)
    ref_ok = ref_err[0] <= TOL_NORM and ref_err[1] <= TOL_PEAK
    if not ref_ok:  # then every point is wrong: none is ranked
        log.error("rank %d batch %d: the default is off the reference %s", rank, batch, ref_err)

    results: list[PointResult] = []
    seen = set()
    for p in points:
        cfgs = launches(cfg, p, rank, batch)
        if tuple(cfgs) in seen:
            continue
        seen.add(tuple(cfgs))
        res = PointResult(p, tuple(c.parts for c in cfgs), Status.OK)
        try:
            errs = [errors(y, r) for y, r in zip(outputs(g, case, cfgs), ref_ys, strict=True)]
            res.norm_err, res.peak_err = (max(e[i] for e in errs) for i in (0, 1))
            if not (ref_ok and res.norm_err <= TOL_NORM and res.peak_err <= TOL_PEAK):
                res.status = Status.WRONG
            else:
                res.runs.append(time_us(case, p.changes(cfg.block_m), g.calls))
        except Exception as e:  # one point's failure (shared memory, say) must not end the run
            res.status, res.message = Status.FAILED, f"{type(e).__name__}: {e}"[:300]
        results.append(res)
    # Few replays a point: the default and the first pass's fastest are timed again, so the
    # ranking that is reported rests on a median of several runs.
    ok = sorted((r for r in results if r.status is Status.OK), key=lambda r: r.graph_us)
    retimes = RETIMES if g.device.type == "cuda" else 0
    for r in {id(r): r for r in [results[0], *ok[:TOP]] if r.status is Status.OK}.values():
        r.runs += [time_us(case, r.point.changes(cfg.block_m), g.calls) for _ in range(retimes)]
    ok.sort(key=lambda r: r.graph_us)
    for r in results:
        if r.graph_us is not None:
            r.share = round(case.nbytes / (r.graph_us * 1e-6) / copy_bw, 3)
    return dict(
        rank=rank,
        batch=batch,
        layers=case.layers,
        mbytes=round(case.nbytes / 1e6, 2),
        default_vs_reference=dict(norm=ref_err[0], peak=ref_err[1], ok=ref_ok),
        default=results[0].row(),
        best=ok[0].row() if ok else None,
        top=[r.row() for r in ok[:TOP]],
        counts={s.value: sum(r.status is s for r in results) for s in Status},
        points=[r.row() for r in results],
    )


def time_us(case: Case, changes: dict, calls) -> float:
    """Per-layer µs: bench/kernels.py's graph timing on CUDA; one eager run elsewhere (the
    interpreter's wall time, which says nothing of speed)."""
    run, _ = bk.lora_layer_fns(case.setup, case.rank, case.layers, changes, calls)
    if case.setup.pool.is_cuda:
        return bk.timed(run, case.layers, eager=False).graph_us
    t0 = time.perf_counter()
    run()
    return round((time.perf_counter() - t0) * 1e6 / case.layers, 2)


def host_copy_bandwidth() -> float:
    """A CPU stand-in for bench/kernels.py's copy_bandwidth (bytes read + written per second)."""
    src = torch.ones(1 << 24, dtype=torch.uint8)
    dst = torch.empty_like(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    return 2 * src.numel() / max(time.perf_counter() - t0, 1e-9)


def run_sweep(cfg: SweepConfig, json_path: str | None) -> dict:
    """The whole sweep; the JSON is rewritten after each case, so a cut-short run keeps its
    finished cases."""
    t0 = time.perf_counter()
    g = cfg.geometry
    with bench_geometry(g):
        cuda = g.device.type == "cuda"
        result = dict(
            device=torch.cuda.get_device_name(g.device) if cuda else "cpu (Triton interpreter)",
            torch=torch.__version__,
            timing="cuda_graph" if cuda else "interpreter_wall_clock",
            grid=dataclasses.asdict(cfg),
            tolerance=dict(norm=TOL_NORM, peak=TOL_PEAK),
            cases=[],
        )
        if cuda and cfg.workers and not cfg.tiny:  # workers build the real geometry only
            compile_ahead(cfg)
        copy_bw = bk.copy_bandwidth() if cuda else host_copy_bandwidth()
        result["copy_bandwidth_tbps"] = round(copy_bw / 1e12, 3)
        for rank, batch in itertools.product(cfg.ranks, cfg.batches):
            result["cases"].append(sweep_case(cfg, rank, batch, copy_bw))
            result["wall_s"] = round(time.perf_counter() - t0, 1)
            log.info("rank %d batch %d done at %.0f s", rank, batch, result["wall_s"])
            if json_path:
                pathlib.Path(json_path).parent.mkdir(parents=True, exist_ok=True)
                pathlib.Path(json_path).write_text(json.dumps(result, indent=1))
    return result


COLS = ["block", "parts", "parts_per_call", "stages", "warps", "graph_us", "share", "norm_err"]


def report(result: dict) -> str:
    lines = [
        f"{result['device']}: copy bandwidth {result['copy_bandwidth_tbps']} TB/s, "
        f"{result['timing']}, {result['wall_s']} s"
    ]
    for c in result["cases"]:
        d, b, n = c["default"], c["best"], c["counts"]
        lines.append(
            f"\nrank {c['rank']} batch {c['batch']} ({c['mbytes']} MB, {c['layers']} layers; "
            f"{n['ok']} ok, {n['wrong']} wrong, {n['failed']} failed; default vs reference "
            f"{'ok' if c['default_vs_reference']['ok'] else 'WRONG'})"
        )
        lines.append(f"  default: {_describe(d)}")
        if b:
            lines.append(f"  best:    {_describe(b)}")
        if c["top"]:
            lines.append(bk.table(c["top"], COLS))
    return "\n".join(lines)


def _describe(r: dict) -> str:
    return (
        f"{r['graph_us']} us, share {r['share']} ({r['status']}; block {r['block']}, parts "
        f"{r['parts_per_call']}, stages {r['stages']}, warps {r['warps']})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="bench/results/fused_sweep.json", help="results file")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and grid (CPU interpreter)")
    ap.add_argument(
        "--workers",
        type=int,
        default=min(16, os.cpu_count() or 1),
        help="processes compiling ahead (CUDA); 0: compile during the sweep",
    )
    for name in ("ranks", "batches", "blocks", "stages", "warps"):
        ap.add_argument(f"--{name}", type=int, nargs="+", help=f"the grid's {name} (a subset)")
    ap.add_argument("--parts", type=int, nargs="+", help="the grid's parts; 0: fused_config's")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.tiny and not torch.cuda.is_available():
        ap.error("the sweep needs a CUDA device; --tiny runs on the CPU (TRITON_INTERPRET=1)")
    if args.tiny and not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--tiny without a CUDA device needs TRITON_INTERPRET=1")
        # Triton 3.6's interpreter needs the kernel tests' workaround for run-time loop bounds.
        from tests.kernels.conftest import _fix_interpreter_loop_bounds

        _fix_interpreter_loop_bounds()
    cfg = TINY if args.tiny else SweepConfig()
    grid = {k: tuple(getattr(args, k)) for k in ("ranks", "batches", "blocks", "stages", "warps")
            if getattr(args, k)}  # fmt: skip
    if args.parts:
        grid["parts"] = tuple(p or None for p in args.parts)
    cfg = dataclasses.replace(cfg, workers=args.workers, **grid)
    print(report(run_sweep(cfg, args.json)))


if __name__ == "__main__":
    main()
