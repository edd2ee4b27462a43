"""bench/tp_decode.py: its bytes bound's adapter term, and the whole comparison on the CPU (the
tiny shape over two gloo ranks against one), as the GPU run will drive it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.bench_models import SHAPES
from bench.tp_decode import adapter_bytes

REPO = Path(__file__).resolve().parents[1]


def test_adapter_bytes_count_a_and_b_of_q_k_v_o():
    # Llama-7B, rank 8: q, k, v, o are 4096 x 4096, so A and B are 8 x 8192 each, every layer
    assert adapter_bytes(SHAPES["llama-7b"], 8, 1) == 32 * 4 * 8 * 8192 * 2
    # GQA: k and v are 8192 -> 1024 on the 70B shape
    seventy = SHAPES["llama-70b"]
    assert adapter_bytes(seventy, 16, 3) == 3 * 80 * 16 * (2 * 16384 + 2 * 9216) * 2


def test_two_ranks_against_one_on_the_cpu(tmp_path):
    out = tmp_path / "tp.json"
    command = [
        sys.executable, str(REPO / "bench" / "tp_decode.py"), "--shape", "tiny", "--device",
        "cpu", "--batches", "2", "3", "--context", "12", "--steps", "4", "--model-dir",
        str(tmp_path / "model"), "--out", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, cwd=REPO, timeout=600)
    result = json.loads(out.read_text())
    assert [(r["batch"], r["adapters"]) for r in result["rows"]] == [(2, 0), (2, 2), (3, 0), (3, 3)]
    for row in result["rows"]:
        for n in ("1", "2"):
            got = row["by_tp"][n]
            assert got["tpot_ms"] > 0 and len(got["gaps_ms"]) == 3  # 4 steps timed: 3 gaps
            assert (got["lora_path"] == "none") == (row["adapters"] == 0)
            assert 0 < got["share"] < 1  # a CPU step is far from the bytes bound
        assert row["ratio_2_1"] > 0
    assert result["command"].startswith("python bench/tp_decode.py --shape tiny")
