"""The generated models load and run in transformers, their adapters in peft, deterministically."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from services.inference import tiny_model
from services.inference.tiny_model import PRESETS, make_adapter, make_model
from tests.inference.models import PARITY_ADAPTERS, TinyModels

PROMPT = [0, 42, 71, 78, 358, 14, 223, 165, 254, 112, 163, 121]  # <s>Hello, 東京 in tiny-llama ids


def _hf(model_dir: Path) -> torch.nn.Module:
    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def _greedy(model: torch.nn.Module, n: int = 16) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens after PROMPT (EOS ignored) and the logits of every position."""
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(n):
            logits = model(ids).logits[0]  # [T, V]
            ids = torch.cat([ids, logits[-1].argmax().view(1, 1)], dim=1)
    return ids[0, len(PROMPT) :].tolist(), logits


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-mha", "demo"])
def test_preset_loads_in_transformers_with_spread_logits(tiny_models: TinyModels, preset: str):
    model = _hf(tiny_models.model(preset))
    p = PRESETS[preset]
    cfg = model.config
    assert type(model).__name__ == p.architecture
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (p.num_heads, p.num_kv_heads)
    assert cfg.tie_word_embeddings == p.tie_word_embeddings
    if p.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    if p.llama3_rope:
        assert cfg.rope_parameters["rope_type"] == "llama3"
    tokens, logits = _greedy(model)
    assert torch.isfinite(logits).all()
    # A clear spread: logits of a few units, and the greedy choice well ahead of the runner-up
    # for most positions (near-ties would make greedy parity with another engine flaky).
    assert 2.0 < logits.std().item() < 8.0
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median().item() > 0.3
    assert len(set(tokens)) > 1


def test_qwen2_has_qkv_bias_and_llama3_rope_changes_frequencies(tiny_models: TinyModels):
    qwen = _hf(tiny_models.model("tiny-qwen2"))
    attn = qwen.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    llama = _hf(tiny_models.model("tiny-llama"))
    inv_freq = llama.model.rotary_emb.inv_freq
    p = PRESETS["tiny-llama"]
    plain = 1.0 / p.rope_theta ** (torch.arange(0, p.head_dim, 2).float() / p.head_dim)
    assert not torch.allclose(inv_freq, plain)  # the scaling is in effect at this size


def test_sharded_model_equals_unsharded(tiny_models: TinyModels):
    one = tiny_models.model("tiny-qwen2")
    three = tiny_models.model("tiny-qwen2", shards=3)
    index = json.loads((three / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert files == {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    merged = {}
    for f in sorted(files):
        merged |= load_file(three / f)
    single = load_file(one / "model.safetensors")
    assert merged.keys() == single.keys() == index["weight_map"].keys()
    assert all(torch.equal(merged[k], single[k]) for k in single)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in single.values())
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.equal(_hf(one)(ids).logits, _hf(three)(ids).logits)


def test_deterministic_per_seed_and_fast(tmp_path: Path):
    start = time.perf_counter()
    a = make_model(tmp_path / "a", "tiny-llama", seed=1)
    elapsed = time.perf_counter() - start
    b = make_model(tmp_path / "b", "tiny-llama", seed=1)
    c = make_model(tmp_path / "c", "tiny-llama", seed=2)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert elapsed < 2.0
    x = make_adapter(a, tmp_path / "x", seed=5)
    y = make_adapter(b, tmp_path / "y", seed=5)
    z = make_adapter(a, tmp_path / "z", seed=6)
    read = lambda d: (d / "adapter_model.safetensors").read_bytes()  # noqa: E731
    assert read(x) == read(y) != read(z)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2"])
def test_parity_adapters_load_in_peft_and_change_outputs(tiny_models: TinyModels, preset: str):
    base = _hf(tiny_models.model(preset))
    base_tokens, _ = _greedy(base)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        base_logits = base(ids).logits
    for name, spec in PARITY_ADAPTERS.items():
        path = tiny_models.adapter(preset, name)
        peft_model = PeftModel.from_pretrained(_hf(tiny_models.model(preset)), path).eval()
        with torch.no_grad():
            logits = peft_model(ids).logits
        # On the same input: a visible change, while activations stay in range.
        rel = ((logits - base_logits).norm() / base_logits.norm()).item()
        assert 0.1 < rel < 1.5, (name, rel)
        assert logits.abs().max() < 50
        tokens, _ = _greedy(peft_model)
        assert sum(a != b for a, b in zip(tokens, base_tokens, strict=True)) >= 4, name
        layer = peft_model.base_model.model.model.layers[0]
        modules = {**vars(layer.self_attn)["_modules"], **vars(layer.mlp)["_modules"]}
        for m in spec.target_modules:
            lora = modules[m]
            r = dict(spec.rank_pattern).get(m, spec.rank)
            alpha = dict(spec.alpha_pattern).get(m, spec.lora_alpha)
            assert lora.r["default"] == r
            expected = alpha / (r**0.5 if spec.use_rslora else r)
            assert lora.scaling["default"] == pytest.approx(expected)


def test_adapter_tensor_layout(tiny_models: TinyModels, tmp_path: Path):
    model_dir = tiny_models.model("tiny-llama")
    out = make_adapter(
        model_dir,
        tmp_path / "a",
        rank=4,
        target_modules=("k_proj", "down_proj"),
        layers_to_transform=[1],
    )
    tensors = load_file(out / "adapter_model.safetensors")
    pre = "base_model.model.model.layers.1."
    assert tensors[pre + "self_attn.k_proj.lora_A.weight"].shape == (4, 64)
    assert tensors[pre + "self_attn.k_proj.lora_B.weight"].shape == (32, 4)  # 2 kv heads x 16
    assert tensors[pre + "mlp.down_proj.lora_A.weight"].shape == (4, 160)
    assert tensors[pre + "mlp.down_proj.lora_B.weight"].shape == (64, 4)
    assert len(tensors) == 4
    assert all(t.abs().max() > 0 for t in tensors.values())  # B is not zero
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["layers_to_transform"] == [1]


def test_bad_arguments_are_named(tmp_path: Path, tiny_models: TinyModels):
    with pytest.raises(ValueError, match="unknown preset"):
        make_model(tmp_path / "m", preset="gpt-2")
    with pytest.raises(ValueError, match="shards"):
        make_model(tmp_path / "m", shards=0)
    model_dir = tiny_models.model("tiny-llama")
    with pytest.raises(ValueError, match="target_modules"):
        make_adapter(model_dir, tmp_path / "a", target_modules=("lm_head",))
    with pytest.raises(ValueError, match="layers_to_transform"):
        make_adapter(model_dir, tmp_path / "a", layers_to_transform=[7])
    with pytest.raises(ValueError, match="rank"):
        make_adapter(model_dir, tmp_path / "a", rank=0)


def test_cli_writes_model_and_adapter(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    run = subprocess.run(
        [sys.executable, "-m", "services.inference.tiny_model", str(tmp_path / "m"),
         "--preset", "tiny-mistral", "--seed", "3"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert run.stdout.strip() == str(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "mistral"
    tiny_model._main(
        ["adapter", str(tmp_path / "a"), "--model", str(tmp_path / "m"), "--rank", "4",
         "--targets", "q_proj,o_proj", "--rslora"]
    )  # fmt: skip
    assert capsys.readouterr().out.strip() == str(tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["target_modules"], cfg["use_rslora"]) == (4, ["o_proj", "q_proj"], True)
