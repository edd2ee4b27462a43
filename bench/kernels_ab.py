"""The kernels of an earlier commit against the current ones, side by side in one run (CUDA).

The baseline's kernels/ package is taken from git (``git show REV:kernels/...``) into a
temporary package ``kernels_base`` with its imports pointed at itself, so both versions run in
one process on the same inputs. Two families, as the engine calls them:

- attention: bench/attention_mixed.py's mixed-step scenarios, one paged_attention call each
  (the current one with the prefill tile table the engine passes, the baseline as it was);
- lora: one layer's four LoRA calls (q/k/v, o, gate/up, down) of rank-8 adapters on q/k/v/o
  only (S1), with the engine's max_rank 128 and 514 segments, in CUDA graphs, per layer: the
  baseline, the current kernels without the step's module mask and with it; and S1's two
  attention calls alone.

Each case also checks that both versions give the same output.

    python bench/kernels_ab.py --baseline 6f86cd2 --out bench/results/kernels_ab.json
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402

from bench.provenance import write_result  # noqa: E402

LORA_CASES = ("512x5", "512x100", "512x1000", "mixed2048x1000")
LAYERS = 4


def baseline_package(rev: str, into: Path) -> str:
    """kernels/ at ``rev`` as the package ``kernels_base`` under ``into``; returns its name."""
    pkg = into / "kernels_base"
    pkg.mkdir(parents=True)
    files = subprocess.run(["git", "ls-tree", "--name-only", rev, "kernels/"], cwd=REPO,
                           check=True, capture_output=True, text=True).stdout.split()  # fmt: skip
    for path in files:
        if not path.endswith(".py"):
            continue
        text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout  # fmt: skip
        text = re.sub(r"\bfrom kernels(\.| import)", r"from kernels_base\1", text)
        (pkg / Path(path).name).write_text(text)
    sys.path.insert(0, str(into))
    return "kernels_base"


def us(fn) -> float:
    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def attention_ab(base) -> dict:
    from bench.attention_mixed import SCENARIOS, build
    from kernels import attention

    rows = {}
    for name, (decode, prefills, pad) in SCENARIOS.items():
        args, tiles, _ = build(decode, prefills, pad)
        out, out_base = torch.empty_like(args[0]), torch.empty_like(args[0])
        new = us(lambda: attention.paged_attention(*args, out=out, prefill_tiles=tiles))  # noqa: B023
        old = us(lambda: base.attention.paged_attention(*args, out=out_base))  # noqa: B023
        real = int(args[4][-1])
        diff = (out[:real].float() - out_base[:real].float()).abs().max().item()
        rows[name] = {"baseline_us": round(old, 1), "current_us": round(new, 1),
                      "max_abs_diff": diff}  # fmt: skip
        print(f"attention {name:<50} baseline {old:7.1f} current {new:7.1f} us "
              f"({new / old:.2f}x), max diff {diff:.1e}", flush=True)  # fmt: skip
    return rows


def lora_rows(name: str, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """Each token's adapter row, sorted as the scheduler sorts a step, and the adapter count."""
    if name.startswith("mixed"):
        # 2048 tokens: six prompts' chunks (1670 tokens) on six adapters, 378 decodes on their own
        pre = [a for a, n in enumerate((300, 250, 280, 300, 270, 270)) for _ in range(n)]
        return torch.tensor(sorted(pre + list(range(6, 6 + 378))), dtype=torch.int32), 1000
    t, n = map(int, name.split("x"))
    return torch.randint(0, n, (t,), generator=gen).sort().values.int(), n


def lora_ab(base) -> dict:
    from bench import kernels as kb
    from kernels import lora
    from kernels.lora_layout import DOWN, GATE, UP, K, O, Q, V
    from kernels.lora_ref import make_lora_tokens

    calls = [((Q, K, V), 4096, (4096,) * 3), ((O,), 4096, (4096,)),
             ((GATE, UP), 4096, (11008, 11008)), ((DOWN,), 11008, (4096,))]  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name in LORA_CASES:
        rows, n = lora_rows(name, gen)
        t = rows.numel()
        case = kb.build_lora(n, 8, LAYERS, rows)
        case.index.ranks[:, [GATE, UP, DOWN]] = 0  # S1: q/k/v/o only
        xs = [[torch.randn(t, d, dtype=kb.DT, device=kb.DEV) for _, d, _ in calls]
              for _ in range(LAYERS)]  # fmt: skip
        ys = [[torch.zeros(t, sum(w), dtype=kb.DT, device=kb.DEV) for _, _, w in calls]
              for _ in range(LAYERS)]  # fmt: skip
        ws = torch.empty(lora.workspace_size(t, 3, 128) * 16, device=kb.DEV)
        plain = make_lora_tokens(case.rows, capacity=514)
        masked = make_lora_tokens(case.rows, capacity=514, modules=(Q, K, V, O))

        def layer_us(impl, tokens, which, case=case, xs=xs, ys=ys, ws=ws) -> float:
            def fn() -> None:
                for layer in range(LAYERS):
                    for c in which:
                        m, _, w = calls[c]
                        impl.lora_apply(ys[layer][c], xs[layer][c], case.pool[layer],
                                        case.index, tokens, m, w, 128, workspace=ws)  # fmt: skip

            return kb.timed(fn, LAYERS, eager=False).graph_us

        row = {
            "baseline": layer_us(base.lora, plain, range(4)),
            "current_without_mask": layer_us(lora, plain, range(4)),
            "current": layer_us(lora, masked, range(4)),
            "baseline_qkv_o": layer_us(base.lora, plain, (0, 1)),
            "current_qkv_o": layer_us(lora, masked, (0, 1)),
        }
        y_base = torch.zeros(t, 12288, dtype=kb.DT, device=kb.DEV)
        y_new = y_base.clone()
        args = (case.pool[0], case.index)
        base.lora.lora_apply(y_base, xs[0][0], *args, plain, (Q, K, V), (4096,) * 3, 128,
                             workspace=ws)  # fmt: skip
        lora.lora_apply(y_new, xs[0][0], *args, masked, (Q, K, V), (4096,) * 3, 128, workspace=ws)
        row["max_abs_diff"] = (y_base.float() - y_new.float()).abs().max().item()
        row["adapters_used"] = int(torch.unique(rows).numel())
        out[name] = row
        print(f"lora {name:<16} " + ", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="git revision of the baseline kernels")
    parser.add_argument("--families", nargs="+", default=["attention", "lora"])
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/kernels_ab.json")
    args = parser.parse_args()
    from bench.adapter_load import machine

    with tempfile.TemporaryDirectory() as tmp:
        name = baseline_package(args.baseline, Path(tmp))
        base = argparse.Namespace(
            attention=importlib.import_module(f"{name}.attention"),
            lora=importlib.import_module(f"{name}.lora"),
        )
        results = {}
        if "attention" in args.families:
            results["attention"] = attention_ab(base)
        if "lora" in args.families:
            results["lora_us_per_layer"] = lora_ab(base)
    write_result(args.out, "kernels_ab.py", {
        "benchmark": "kernels of a baseline commit against the current ones, one run",
        "baseline": args.baseline, "machine": machine(), "results": results,
    }, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
