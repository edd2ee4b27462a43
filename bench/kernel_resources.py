"""Registers, shared memory and programs per SM of the LoRA kernels' decode launches.

    python -m bench.kernel_resources [--json bench/results/kernel_resources.json]
    python -m bench.kernel_resources --delta [--json bench/results/kernel_resources_delta.json]
    python -m bench.kernel_resources --pairs [--json bench/results/kernel_resources_pairs.json]
    python -m bench.kernel_resources --pdl [--json bench/results/kernel_resources_pdl.json]

No GPU needed: each launch is compiled for sm_90 (H100/H200) on the host with Triton's own
toolchain, and the registers are read from the cubin with the cuobjdump Triton ships. The
figures behind kernels/lora.py's _NARROW table: for each rank-row class it lists, the default
launch fused_config picks and the smaller blocks it switches to when a call's programs overflow
one wave of the default launch, for each of the Llama-2-7B layer's four calls (q/k/v, o,
gate/up, down: the geometry changes the compiled code). A test
(tests/kernels/test_kernel_resources.py) checks the table against what this Triton version
compiles: the default launch's count for every call, and for the smaller blocks the least
count among the calls whose decode programs can reach the window on 132 SMs. Then the
two-launch shrink and expand of each call at the engine's decode step (512 tokens, max_rank
128), with the stack a thread spills to: the test checks that the expand's register cap
(kernels/lora.py _EXPAND_MAX_REGISTERS) keeps the programs an SM without spilling the q/k/v
call. With ``--delta``, instead, the fused launches of the steps that take the addend
(LoraContext.addend), in place against writing the delta; with ``--pairs``, a decode step's
launches on one-token tiles without and with the two-token body (LoraLaunch.gemv_pair); with
``--pdl``, those launches plain and as programmatic dependent launches (kernels/tiles.py
lora_pdl_launch), with the gates their PTX holds.

A program count per SM is the least of what registers (64K a multiprocessor, allocated per warp
in steps of 256), shared memory (228 KB, 1 KB of it reserved per program), warps (64) and
programs (32) allow. The launches are compiled with the argument specializations a real launch
gets (strides divisible by 16, one part).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench.kernels import CALL_NAMES, CALLS, POOL_W, fused_config_default, table
from kernels import lora
from kernels.lora_fused import lora_fused_kernel
from kernels.lora_layout import chunks
from kernels.lora_paths import FUSED_MAX_TOKENS
from kernels.tiles import dot_f32

TARGET = GPUTarget("cuda", 90, 32)
REGISTERS_PER_SM = 65536
SHARED_PER_SM = 233472  # 228 KB
SHARED_RESERVED = 1024  # per program
MAX_WARPS, MAX_PROGRAMS = 64, 32
W = POOL_W  # the pool width the launches are derived for
SMS = 132  # H100 / H200 SXM
# Integer arguments of a call at batch 256 (the pool's and the index's strides; x's and y's
# come from the call).
INTS = dict(
    stride_half=W * 1 << 16,
    stride_slot=W,
    stride_table=48,
    stride_idx=7,
    stride_scale=7,
    PARTS=1,
)
POINTERS = dict.fromkeys(
    ("table_ptr", "ranks_ptr", "a_off_ptr", "b_off_ptr", "tiles_ptr", "mods_ptr"), "*i32"
) | {"scales_ptr": "*fp32", "h_ptr": "*fp32"}  # the others (x, y, the pool) are bf16


class Resources(NamedTuple):
    registers: int  # per thread
    shared: int  # bytes per program
    warps: int
    stack: int = 0  # bytes of stack a thread (spilled registers)
    gates: int = 0  # griddepcontrol.wait instructions in the PTX (launch_gate under PDL)

    @property
    def programs_per_sm(self) -> int:
        regs = -(-self.registers // 8) * 8  # 256 a warp
        by_regs = REGISTERS_PER_SM // (regs * 32 * self.warps)
        by_shared = SHARED_PER_SM // (self.shared + SHARED_RESERVED)
        return min(by_regs, by_shared, MAX_WARPS // self.warps, MAX_PROGRAMS)


def compile_resources(kernel, constexprs: dict, ints: dict, options: dict) -> Resources:
    """Compile ``kernel`` for sm_90 with these constexprs and integer arguments (the others are
    pointers: bf16 unless POINTERS or ``fp32`` says otherwise); read its resource usage."""
    constexprs = dict(constexprs)
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif ints.get(name) == 1:  # launches specialize an argument equal to 1 as a constant
            signature[name] = "constexpr"
            constexprs[name] = 1
        elif name.endswith("_ptr"):
            signature[name] = POINTERS.get(name, "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(
        ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=options
    )
    registers, stack = _usage(compiled.asm["cubin"])
    gates = compiled.asm["ptx"].count("griddepcontrol.wait")
    return Resources(registers, compiled.metadata.shared, options["num_warps"], stack, gates)


def fused_resources(
    launch: lora.LoraLaunch, call, delta: bool = False, pdl: bool = False
) -> Resources:
    """Compile the fused kernel for one launch of one call (sm_90); read its resource usage.
    ``delta``: the launch that writes the delta (lora_apply's delta) rather than adding it;
    ``pdl``: a programmatic dependent launch (kernels/tiles.py lora_pdl_launch)."""
    mods, d_in, widths = call
    gemv_rows = launch.gemv_r or launch.shrink_r
    constexprs = dict(
        D_IN=d_in, W=W, IN_CHUNKS=chunks(d_in, W), **lora._slice_args(mods, widths),
        BLOCK_M=launch.block_m, BLOCK_K=launch.shrink_k, BLOCK_N=launch.expand_n,
        BLOCK_R=launch.shrink_r, DOT_F32=dot_f32(torch.bfloat16), MASKED=True,
        PART_N=max(launch.expand_n, lora._gemv_blocks(launch, gemv_rows))
        if launch.gemv_max else launch.expand_n,
        GEMV_MAX=launch.gemv_max, GEMV_K=launch.gemv_k, GEMV_N=launch.gemv_n,
        GEMV_R=gemv_rows, GEMV_NARROW_R=launch.gemv_narrow,
        GEMV_HOIST=lora.gemv_hoists(launch, d_in, W, widths), GEMV_PAIR=launch.gemv_pair,
        DELTA=delta, PDL=pdl,
    )  # fmt: skip
    ints = dict(INTS, stride_xt=d_in, stride_yt=sum(widths), MAX_RANK=launch.shrink_r)
    options = dict(num_warps=launch.shrink_warps, num_stages=launch.stages, launch_pdl=pdl)
    return compile_resources(lora_fused_kernel, constexprs, ints, options)


def two_launch_resources(call, tokens: int = FUSED_MAX_TOKENS, max_rank: int = 128) -> dict:
    """The shrink's and the expand's resources for one call as launch_config sets it (a decode
    step of ``tokens`` in an engine of ``max_rank``), compiled with the launchers' options."""
    mods, d_in, widths = call
    cfg = lora.launch_config(tokens, d_in, W, max_rank, len(mods))
    stride_ht = len(mods) * max_rank
    ints = dict(INTS, stride_xt=d_in, stride_yt=sum(widths), stride_hk=tokens * stride_ht,
                stride_ht=stride_ht, stride_hs=max_rank, NUM_TILES=tokens + 2,
                MAX_RANK=max_rank)  # fmt: skip
    common = dict(BLOCK_M=cfg.block_m, DOT_F32=dot_f32(torch.bfloat16), PDL=True,
                  SPLIT_K=cfg.split_k, MASKED=True)  # fmt: skip
    shrink = compile_resources(
        lora._lora_shrink_kernel,
        dict(common, D_IN=d_in, W=W, IN_CHUNKS=chunks(d_in, W), **lora._slice_args(mods),
             K_PER=-(-d_in // cfg.split_k), RANK_SPLIT=cfg.rank_split, BLOCK_K=cfg.shrink_k,
             BLOCK_R=cfg.shrink_r,
             ALIGNED=W % cfg.shrink_k == 0),
        ints,
        dict(num_warps=cfg.shrink_warps, num_stages=cfg.stages),
    )  # fmt: skip
    blocks = [-(-w // cfg.expand_n) for w in widths] + [0, 0]
    expand = compile_resources(
        lora._lora_expand_kernel,
        dict(common, W=W, **lora._slice_args(mods, widths), NB0=blocks[0], NB1=blocks[1],
             BLOCK_N=cfg.expand_n, BLOCK_R=cfg.expand_r, ALIGNED=W % cfg.expand_n == 0),
        ints,
        dict(num_warps=cfg.expand_warps, num_stages=1, maxnreg=lora._EXPAND_MAX_REGISTERS),
    )  # fmt: skip
    return {"shrink": shrink, "expand": expand}


def _usage(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) a thread, from the cubin."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    found = re.findall(r"REG:(\d+) STACK:(\d+)", out)
    if not found:
        raise RuntimeError(f"no register count in cuobjdump's output:\n{out}")
    return int(found[-1][0]), int(found[-1][1])


def launches(rows: int) -> dict[str, lora.LoraLaunch]:
    """The default decode launch fused_config picks at these rank rows, and its smaller blocks."""
    default = fused_config_default(rows)
    return {"default": default, "smaller": default._replace(**lora._NARROW[rows].fields())}


def max_programs(call) -> int:
    """A call's most programs in decode (one-token tiles, one part at 512 tokens)."""
    return FUSED_MAX_TOKENS * len(call[0])


def measure() -> list[dict]:
    rows = []
    for rank_rows, narrow in sorted(lora._NARROW.items()):
        for name, launch in launches(rank_rows).items():
            for call_name, call in zip(CALL_NAMES, CALLS, strict=True):
                res = fused_resources(launch, call)
                rows.append(
                    dict(
                        rank_rows=rank_rows,
                        launch=name,
                        call=call_name,
                        block_k=launch.shrink_k,
                        block_n=launch.expand_n,
                        warps=launch.shrink_warps,
                        registers=res.registers,
                        shared_bytes=res.shared,
                        programs_per_sm=res.programs_per_sm,
                        # can its programs overflow one wave of the default launch?
                        reaches_window=max_programs(call) > narrow.wide_per_sm * SMS,
                        table=narrow.wide_per_sm if name == "default" else narrow.per_sm,
                    )
                )
    return rows


def measure_two_launch() -> list[dict]:
    rows = []
    for call_name, call in zip(CALL_NAMES, CALLS, strict=True):
        for kernel, res in two_launch_resources(call).items():
            rows.append(dict(call=call_name, kernel=kernel, registers=res.registers,
                             stack_bytes=res.stack, shared_bytes=res.shared,
                             programs_per_sm=res.programs_per_sm))  # fmt: skip
    return rows


# --delta: the steps that take the addend (services/inference/engine/model_runner.py
# ADDEND_MODES from ADDEND_MIN_TOKENS): (step, tokens, rank rows, GEMV body) as the engine sizes
# their calls; and the NARROW launch without its GEMV body (bench/lora_engine_calls.py --apart
# times it)
DELTA_STEPS = (
    ("ONE_TOKEN decode", 256, 8, True),
    ("ONE_TOKEN decode", 512, 8, True),
    ("NARROW mixed", 2048, 16, True),
    ("NARROW mixed, no GEMV body", 2048, 16, False),
    ("WIDE_FUSED mixed", 2048, 64, True),
)


def measure_delta() -> list[dict]:
    """Each addend step's q/k/v and o launches, in place against writing the delta."""
    rows = []
    for step, tokens, rank_rows, gemv in DELTA_STEPS:
        for call_name, call in zip(CALL_NAMES[:2], CALLS[:2], strict=True):
            mods, d_in, widths = call
            launch = lora.fused_config(tokens, W, rank_rows, len(mods), max(widths), d_in=d_in)
            if not gemv:
                launch = launch._replace(gemv_max=0)
            for delta in (False, True):
                res = fused_resources(launch, call, delta)
                rows.append(dict(step=step, tokens=tokens, rank_rows=rank_rows, call=call_name,
                                 delta=delta, registers=res.registers, stack_bytes=res.stack,
                                 shared_bytes=res.shared, warps=res.warps,
                                 programs_per_sm=res.programs_per_sm))  # fmt: skip
    return rows


def measure_one_token(vary: str) -> list[dict]:
    """A decode step's q/k/v and o launches on one-token tiles (8 rank rows, the GEMV body's
    loads hoisted: lora_paths.one_token_step_fuses), in place and writing the delta, by
    ``vary``: "pairs", without and with the two-token body (LoraLaunch.gemv_pair); "pdl", as
    plain and as programmatic dependent launches (the pair body as lora_paths says)."""
    rows = []
    for on in (False, True):
        for call_name, call in zip(CALL_NAMES[:2], CALLS[:2], strict=True):
            mods, d_in, widths = call
            launch = lora.fused_config(256, W, 8, len(mods), max(widths), d_in=d_in)
            if vary == "pairs":
                launch = launch._replace(gemv_pair=on)
            pdl = on and vary == "pdl"
            for delta in (False, True):
                res = fused_resources(launch, call, delta, pdl)
                rows.append(dict(pairs=launch.gemv_pair, pdl=pdl, call=call_name, delta=delta,
                                 hoisted=lora.gemv_hoists(launch, d_in, W, widths),
                                 gates=res.gates, registers=res.registers,
                                 stack_bytes=res.stack, shared_bytes=res.shared,
                                 warps=res.warps, programs_per_sm=res.programs_per_sm))  # fmt: skip
    return rows


def write_json(path: str, body: dict) -> None:
    """The rows at ``path``, with this run's command, Triton version and target."""
    command = "python -m bench.kernel_resources " + " ".join(sys.argv[1:])
    doc = {"command": command, "triton": triton.__version__, "target": "sm_90"}
    with open(path, "w") as f:
        json.dump(doc | body, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument(
        "--delta",
        action="store_true",
        help="instead: the addend steps' launches, in place against the delta",
    )
    ap.add_argument(
        "--pairs",
        action="store_true",
        help="instead: a decode step's one-token launches without and with two-token tiles",
    )
    ap.add_argument(
        "--pdl",
        action="store_true",
        help="instead: a decode step's one-token launches, plain and as dependent launches",
    )
    args = ap.parse_args()
    if args.delta or args.pairs or args.pdl:
        if args.delta:
            rows = measure_delta()
        else:
            rows = measure_one_token("pairs" if args.pairs else "pdl")
        print(table(rows, list(rows[0])))
        if args.json:
            write_json(args.json, {"rows": rows})
        return
    rows = measure()
    print(table(rows, list(rows[0])))
    two = measure_two_launch()
    print(table(two, list(two[0])))
    if args.json:
        write_json(args.json, {"rows": rows, "two_launch": two})


if __name__ == "__main__":
    main()
