"""What adapters can keep of the base model's throughput when they take pool pages from the KV
cache: a throughput bound that counts the pages the running batch's adapters hold, not only
their bytes.

bench/step_compare.py's bound adds each LoRA step's adapter bytes, at the copy bandwidth, to the
base model's steps, as if the LoRA run took the same steps. It does not: in S-LoRA's unified
pool the running batch's adapters hold pages that the KV cache then lacks, so a LoRA run's
fullest steps hold fewer context tokens and it takes more steps (S2 with 1000 adapters on the
H200: 966 steps against the base model's 914, 181k context tokens at its fullest against 220k).
This bound counts both:

- The engine's own scheduler, page pool and step loop run bench/serving.py's trace on the tiny
  generated model, as bench/admission.py runs it: the serving run's pool (its pages from its
  JSON), as many sequences as the service derives from that pool (512 on the H200, 288 on an
  H100), 2048 tokens a step, the decode reserve on, adapter affinity's bound the engine's
  default (twice those sequences) or --adapter-affinity.
- Each of the n adapters is a tiny-model adapter that takes as many pool pages as the Llama-7B
  adapter it stands for (a rank on the tiny model's projections whose slot table fills the same
  number of 16-token pages: checked for every rank of the workload before the trace), and each
  request's adapter is drawn as bench/serving.py draws it.
- A step's time is the base model's step cost fitted to the serving run's base-model steps
  (bench/admission.py's StepModel), plus the Llama-7B bytes of its distinct adapters at the copy
  bandwidth the serving run measured: LoRA kernels that cost exactly their bytes.
- The base model's trace runs the same way. The ratio of the two modeled throughputs is the
  bound, for LoRA kernels that run in turn with the base model's (as the engine's do). Two more
  runs of the LoRA trace bound what overlapping could reach: with the bytes of steps with
  prefill hidden (those steps' GEMMs are compute-bound; decode steps are memory-bound, so their
  adapters' bytes add whatever runs beside them), and with every step's bytes free, which
  leaves the pool pages' share alone. A fourth adds to each step's bytes the activations its
  tokens' LoRA calls read and write (bench/step_compare.py activation_bytes_per_token): the
  bound for LoRA kernels that run apart from the base model's GEMMs, as the engine's do.

Figures are modeled, not measured; the modeled LoRA run's steps and fullest step compare with
the serving run's (printed beside them).

    python bench/capacity_bound.py --serving bench/results/serving_s2_share_n1000.json \
        --workload S2 --adapters 1000
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.admission import PAGE_SIZE, STEP_TOKENS, fit_to, fullest_step, simulate  # noqa: E402
from bench.bench_models import SHAPES  # noqa: E402
from bench.provenance import write_result  # noqa: E402
from bench.serving import WORKLOADS, make_trace, parse_run, with_adapters  # noqa: E402
from bench.step_compare import activation_bytes_per_token  # noqa: E402
from kernels.lora_layout import MODULES, plan_adapter  # noqa: E402
from services.inference.engine.api import AdapterKey  # noqa: E402
from services.inference.engine.config import AFFINITY_BATCHES  # noqa: E402
from services.inference.engine.page_pool import pages_needed  # noqa: E402
from services.inference.engine.pool_sizing import cuda_max_num_seqs  # noqa: E402
from services.inference.tiny_model import make_model  # noqa: E402
from store.base_model import BaseModelShape  # noqa: E402
from store.synthetic import AdapterFiles, synthetic_adapter  # noqa: E402

TINY = "tiny-llama"


def adapter_pages(base: BaseModelShape, rank: int, modules: tuple[str, ...]) -> int:
    """Pool pages of an adapter of ``rank`` on ``modules`` of ``base`` (host_adapter.plan_for's
    slot table: pool width kv_heads x head_dim)."""
    width = base.num_kv_heads * base.head_dim
    dims = {m: tuple(base.module_dims(name)) for m, name in enumerate(MODULES)}
    ranks = {MODULES.index(name): rank for name in modules}
    return pages_needed(plan_adapter(ranks, dims, width).num_slots, PAGE_SIZE)


def adapter_bytes(base: BaseModelShape, rank: int, modules: tuple[str, ...], dtype_bytes=2) -> int:
    """An adapter's weights: A (rank x d_in) and B (d_out x rank) of each module, every layer."""
    return (
        sum(rank * sum(base.module_dims(name)) * dtype_bytes for name in modules) * base.num_layers
    )


def stand_in_rank(tiny: BaseModelShape, pages: int, modules: tuple[str, ...]) -> int:
    """The tiny model's largest rank whose adapter takes ``pages`` pool pages, as the real one
    does (the largest, so that the stand-ins' ranks keep the real ones' proportions)."""
    found = None
    for rank in range(1, 4097):
        got = adapter_pages(tiny, rank, modules)
        if got > pages:
            break
        if got == pages:
            found = rank
    if found is None:
        raise ValueError(f"no rank of the tiny model's adapter takes exactly {pages} pages")
    return found


def same_headers(files: dict[int, AdapterFiles]) -> dict[int, AdapterFiles]:
    """The files with their safetensors headers padded with spaces (as the format allows) to
    one length, so that each file's bytes are its weights' plus the same header."""
    longest = max(int.from_bytes(f.safetensors[:8], "little") for f in files.values())
    out = {}
    for key, f in files.items():
        size = int.from_bytes(f.safetensors[:8], "little")
        header = f.safetensors[8 : 8 + size] + b" " * (longest - size)
        body = f.safetensors[8 + size :]
        out[key] = f._replace(safetensors=longest.to_bytes(8, "little") + header + body)
    return out


# Which steps pay their adapters' bytes at the copy bandwidth: every step (LoRA kernels that
# run in turn with the base model's, as the engine's do), decode steps only (the bytes of steps
# with prefill hidden under their compute-bound GEMMs: what overlapping them could reach at
# best), or none (the pool pages alone); or every step its adapters' bytes and its tokens'
# activations that the LoRA calls read and write (bench/step_compare.py
# activation_bytes_per_token: what LoRA kernels apart from the base model's GEMMs move).
BYTES_IN = ("every step", "decode steps", "no step", "with activations")


class Bound:
    """The trace on the tiny model with stand-ins for ``real``'s adapters of ``workload``."""

    def __init__(self, model_dir: Path, real: BaseModelShape, workload: str,
                 cost: Callable[[dict], float], copy_bw: float, pool_pages: int, run: str,
                 alpha: float = 1.0, affinity: int | None = None,
                 max_num_seqs: int | None = None) -> None:  # fmt: skip
        self.model_dir, self.cost, self.copy_bw = model_dir, cost, copy_bw
        self.affinity = affinity  # the engine's adapter_affinity (None: its default)
        self.pool_pages, self.trace_run, self.alpha = pool_pages, run, alpha
        # the running batch's bound; None: the service's default for this pool (an H100's
        # 7284 pages: 288)
        self.max_num_seqs = max_num_seqs or cuda_max_num_seqs(pool_pages, PAGE_SIZE, STEP_TOKENS)
        self.ranks, self.modules = WORKLOADS[workload]
        self.token_bytes = activation_bytes_per_token(real, self.modules)
        tiny = BaseModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
        # the real rank -> (its pool pages, its weights' bytes, the stand-in's rank on the tiny
        # model, which takes as many pages)
        self.stand_in = {}
        for r in self.ranks:
            pages = adapter_pages(real, r, self.modules)
            self.stand_in[r] = (pages, adapter_bytes(real, r, self.modules),
                                stand_in_rank(tiny, pages, self.modules))  # fmt: skip
        self.files = same_headers({
            r: synthetic_adapter(tiny, rank=t, alpha=2.0 * t, modules=self.modules, seed=r)
            for r, (_, _, t) in self.stand_in.items()
        })  # fmt: skip
        # A step record counts its adapters' bytes on the tiny model (HostAdapter.nbytes: the
        # file's, header included). Their weights are a fixed multiple of the real ones' when
        # the stand-ins' ranks keep the real ones' proportions (every adapter of a workload has
        # the same modules); the headers, padded to one length, come off by the step's count.
        scales = {r: b / adapter_bytes(tiny, t, self.modules)
                  for r, (_, b, t) in self.stand_in.items()}  # fmt: skip
        self.scale = scales[self.ranks[0]]
        if max(scales.values()) - min(scales.values()) > 1e-9 * self.scale:
            raise ValueError(f"the stand-ins' bytes do not scale alike: {scales}")
        headers = {len(f.safetensors) - adapter_bytes(tiny, self.stand_in[r][2], self.modules)
                   for r, f in self.files.items()}  # fmt: skip
        if len(headers) != 1:
            raise ValueError(f"the stand-ins' headers differ in length: {headers}")
        self.header = headers.pop()

    def real_bytes(self, record: dict) -> float:
        """The real adapters' weight bytes of a step record of the stand-ins."""
        return (record["adapter_bytes"] - record["adapters"] * self.header) * self.scale

    def run(self, n: int, bytes_in: str = "every step") -> dict:
        """The trace with n adapters (0: the base model), each step at the base model's cost
        plus its adapters' real bytes at the copy bandwidth in ``bytes_in`` (BYTES_IN)."""
        if bytes_in not in BYTES_IN:
            raise ValueError(f"bytes_in must be one of {BYTES_IN}, got {bytes_in!r}")

        def setup(core) -> None:
            for i in range(n):
                r = self.ranks[i % len(self.ranks)]
                f = self.files[r]
                host = core.add_adapter(AdapterKey(f"a{i}", 1), f.config_json, f.safetensors)
                if core.adapters.pages_of(host) != self.stand_in[r][0]:
                    raise AssertionError(f"rank {r}'s stand-in takes other pages")
                if host.nbytes != len(f.safetensors):
                    raise AssertionError(f"rank {r}'s stand-in counts other bytes")

        def step_ms(record: dict) -> float:
            paid = bytes_in in ("every step", "with activations") or (
                bytes_in == "decode steps" and record["prefill_tokens"] == 0
            )
            extra = self.real_bytes(record) / self.copy_bw * 1e3 if paid else 0.0
            if bytes_in == "with activations" and record["adapters"]:
                extra += record["tokens"] * self.token_bytes / self.copy_bw * 1e3
            return self.cost(record) + extra

        # each request's adapter as bench/serving.py draws it (its trace, its seed 0)
        trace = make_trace(*parse_run(self.trace_run), seed=0)
        picks = [r.adapter for r in with_adapters(trace, n, self.alpha, 0)]
        return simulate(
            self.model_dir, self.trace_run, True, step_ms, self.pool_pages,
            adapter_of=lambda i: None if picks[i] is None else AdapterKey(f"a{picks[i]}", 1),
            setup=setup, compute=False, max_num_seqs=self.max_num_seqs,
            max_loras=self.pool_pages,  # the service's: a LoRA index row per page
            adapter_affinity=self.affinity,
        )  # fmt: skip

    def rows(self, ns: list[int]) -> tuple[dict, list[dict]]:
        """The base model's run, and for each n the LoRA runs with and without bytes."""
        base = self.run(0)
        print(f"base model: {base['modeled_output_tokens_per_s']:.0f} tok/s modeled, "
              f"{base['steps']} steps, fullest {base['kv_read_p90']} context tokens",
              flush=True)  # fmt: skip
        rows = []
        tps = base["modeled_output_tokens_per_s"]
        for n in ns:
            runs = {where: self.run(n, where) for where in BYTES_IN}
            lora = runs["every step"]
            rows.append({
                "adapters": n, "runs": runs,
                "bound": round(lora["modeled_output_tokens_per_s"] / tps, 4),
                "bound_hidden_in_prefill": round(
                    runs["decode steps"]["modeled_output_tokens_per_s"] / tps, 4),
                "pages_alone": round(runs["no step"]["modeled_output_tokens_per_s"] / tps, 4),
                "bound_with_activations": round(
                    runs["with activations"]["modeled_output_tokens_per_s"] / tps, 4),
            })  # fmt: skip
            r = rows[-1]
            print(f"n = {n}: bound {r['bound']:.3f} ({r['bound_hidden_in_prefill']:.3f} with "
                  f"the bytes hidden in steps with prefill, {r['bound_with_activations']:.3f} "
                  f"with the activations the LoRA calls move), the pages alone "
                  f"{r['pages_alone']:.3f}; {lora['steps']} steps, fullest "
                  f"{lora['kv_read_p90']} context tokens", flush=True)  # fmt: skip
        return base, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serving", type=Path, required=True,
                    help="a serving run with the base model's trace of requests all at once "
                         "(its step log beside it: NAME_steps.jsonl.gz)")  # fmt: skip
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="S1")
    ap.add_argument("--adapters", type=int, nargs="+", required=True, help="adapter counts n")
    ap.add_argument("--run", default="inf:1000", help="the trace (bench/serving.py's --runs)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama-7b")
    ap.add_argument("--alpha", type=float, default=1.0, help="popularity power law")
    ap.add_argument("--pool-pages", type=int, nargs="+", default=None,
                    help="the pool's pages (default: the serving run's); several: each in "
                    "turn, what a larger or smaller pool would allow")  # fmt: skip
    ap.add_argument("--adapter-affinity", type=int, default=None,
                    help="the engine's adapter affinity bound (default: the engine's, "
                    f"{AFFINITY_BATCHES} batches of the modeled sequences; 0: arrival "
                    "order)")  # fmt: skip
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the running batch's bound (default: the service's for each pool, "
                    "512 on the H200's, 288 on an H100's)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/capacity_bound.json")
    args = ap.parse_args()
    try:
        serving, runs, base_steps, cost = fit_to(args.serving)
    except ValueError as exc:
        ap.error(str(exc))
    copy_bw = serving["ceilings"]["copy_bytes_per_s"]
    served = max(r.get("device_memory", {}).get("pool_pages") or 0 for r in serving["results"])
    pools = args.pool_pages or [served]
    if not all(pools):
        ap.error(f"{args.serving} does not report the pool's pages (device_memory): --pool-pages")
    measured = {(r["run"], r["adapters"]): r for r in serving["results"] if r.get("pass", 1) == 1}
    real = {"base": {"steps": len(base_steps), "kv_read_p90": fullest_step(base_steps)["kv_read"]}}
    bases, rows = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "model", preset=TINY)
        for pool_pages in pools:
            bound = Bound(model_dir, SHAPES[args.shape].base(), args.workload, cost.ms, copy_bw,
                          pool_pages, args.run, args.alpha, args.adapter_affinity,
                          args.max_num_seqs)  # fmt: skip
            if not rows:
                print(f"{args.shape} adapters (rank: pool pages, MB; the stand-in's rank): "
                      + ", ".join(f"{r}: {p}, {b / 1e6:.1f}; {t}"
                                  for r, (p, b, t) in bound.stand_in.items()),
                      flush=True)  # fmt: skip
            print(f"a pool of {pool_pages} pages, {bound.max_num_seqs} sequences", flush=True)
            bases[pool_pages], pool_rows = bound.rows(args.adapters)
            for row in pool_rows:
                row["pool_pages"], row["max_num_seqs"] = pool_pages, bound.max_num_seqs
                got = measured.get((args.run, row["adapters"]))
                steps = runs.get((args.run, row["adapters"], 1))
                if got is not None and steps is not None and pool_pages == served:
                    row["measured"] = {"vs_base": got.get("vs_base"), "steps": len(steps),
                                       "kv_read_p90": fullest_step(steps)["kv_read"]}  # fmt: skip
            rows += pool_rows
    print(f"\n{'pages':>6} {'n':>5} {'bound':>6} {'hidden':>6} {'pages':>6} {'acts':>6} "
          f"{'measured':>8}  "
          f"steps (modeled, measured; base {real['base']['steps']} measured); fullest step's "
          f"context tokens (base {real['base']['kv_read_p90']} measured)")  # fmt: skip
    for row in rows:
        m, lora = row.get("measured") or {}, row["runs"]["every step"]
        base = bases[row["pool_pages"]]
        print(
            f"{row['pool_pages']:>6} {row['adapters']:>5} {row['bound']:>6.3f} "
            f"{row['bound_hidden_in_prefill']:>6.3f} {row['pages_alone']:>6.3f} "
            f"{row['bound_with_activations']:>6.3f} {m.get('vs_base') or float('nan'):>8.3f}  "
            f"{lora['steps']} (base {base['steps']}), "
            f"{m.get('steps', '-')}; {lora['kv_read_p90']} (base {base['kv_read_p90']}), "
            f"{m.get('kv_read_p90', '-')}"
        )
    print(
        "(bound: modeled LoRA / base throughput with the adapters' pages and bytes; hidden: "
        "with the bytes of steps with prefill hidden under their GEMMs; pages: with their "
        "pages only; acts: the bound with the activations its LoRA calls read and write)"
    )
    write_result(args.out, "capacity_bound.py", {
        "benchmark": "a throughput bound for n adapters that counts the pool pages the running "
        "batch's adapters take from the KV cache and their bytes at the copy bandwidth: the "
        "engine's scheduler on the CPU, step times modeled by a fit to the serving run's "
        "base-model steps (H200)",
        "serving_run": str(args.serving.relative_to(REPO)) if args.serving.is_relative_to(REPO)
        else str(args.serving),
        "workload": args.workload, "shape": args.shape, "run": args.run,
        "adapter_affinity": args.adapter_affinity,
        "served_pool_pages": served, "copy_bytes_per_s": copy_bw,
        "cost_model": {"decode": cost.decode, "mixed": cost.mixed},
        "base_by_pool_pages": bases, "measured": real, "rows": rows,
    })  # fmt: skip


if __name__ == "__main__":
    main()
