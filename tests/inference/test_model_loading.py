"""config.json reading, rope variants, weight loading and its errors, EngineConfig checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.inference.engine.api import GenerationRequest
from services.inference.engine.config import EngineConfig
from services.inference.engine.core import EngineCore
from services.inference.engine.errors import InvalidRequest, ModelLoadError
from services.inference.engine.pool_sizing import context_window
from services.inference.engine.sampling_params import SamplingParams
from services.inference.models.config import ModelConfig, RopeConfig
from services.inference.models.llama import rope_inv_freq
from services.inference.models.loader import load_model
from services.inference.models.shard import Shard
from tests.inference.engine_harness import make_core, run

CPU = torch.device("cpu")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0},
        {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)  # fmt: skip
def test_rope_frequencies_match_transformers(params):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_parameters=dict(params))
    want = LlamaRotaryEmbedding(hf_cfg).inv_freq
    ours = ModelConfig.from_dict(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_attention_heads": 4,
         "intermediate_size": 512, "num_hidden_layers": 1, "vocab_size": 16,
         "rope_parameters": params}
    )  # fmt: skip
    assert torch.equal(rope_inv_freq(ours.rope, 64), want)


def test_rope_keys_old_and_new_layouts():
    base = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "intermediate_size": 128, "num_hidden_layers": 1, "vocab_size": 16,
        "max_position_embeddings": 4096,
    }  # fmt: skip
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    old = ModelConfig.from_dict(
        {**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}}
    )
    new = ModelConfig.from_dict(
        {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}
    )
    want = RopeConfig("llama3", 5e5, 8.0, 1.0, 4.0, original_max_position_embeddings=4096)
    assert old.rope == new.rope == want
    assert ModelConfig.from_dict(base).rope == RopeConfig("default", 10000.0)
    with pytest.raises(ModelLoadError, match="rope type 'yarn' is not supported"):
        ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ModelLoadError, match="llama3 rope scaling needs 'low_freq_factor'"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_architecture_and_activation_checks():
    cfg = {
        "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
        "num_hidden_layers": 1, "vocab_size": 16,
    }  # fmt: skip
    with pytest.raises(ModelLoadError, match="architecture 'GPT2LMHeadModel' is not supported"):
        ModelConfig.from_dict({**cfg, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ModelLoadError, match="architecture None"):
        ModelConfig.from_dict(cfg)
    with pytest.raises(ModelLoadError, match="hidden_act 'gelu'"):
        ModelConfig.from_dict({**cfg, "architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"})
    with pytest.raises(ModelLoadError, match="'vocab_size' is missing"):
        ModelConfig.from_dict(
            {k: v for k, v in cfg.items() if k != "vocab_size"}
            | {"architectures": ["LlamaForCausalLM"]}  # fmt: skip
        )


def test_model_families(tiny_models):
    qwen = ModelConfig.from_model_dir(tiny_models.model("tiny-qwen2"))
    assert qwen.qkv_bias and not qwen.o_bias and qwen.tie_word_embeddings
    assert qwen.sliding_window is None  # use_sliding_window is false
    llama = ModelConfig.from_model_dir(tiny_models.model("tiny-llama"))
    assert llama.num_kv_heads < llama.num_heads and not llama.qkv_bias
    assert llama.rope.rope_type == "llama3"
    mistral = ModelConfig.from_model_dir(tiny_models.model("tiny-mistral"))
    assert mistral.architecture == "MistralForCausalLM"
    model = load_model(tiny_models.model("tiny-qwen2"), CPU, torch.float32, 64)
    assert model.lm_head is model.embed_tokens  # tied
    assert model.layers[0].attn.bqkv.shape == (qwen.q_dim + 2 * qwen.kv_dim,)


def test_weights_are_memory_mapped(tiny_models):
    """Weights used as they are stay views of the mapped file: no host copy of them."""
    model_dir = tiny_models.model("tiny-llama")
    model = load_model(model_dir, CPU, torch.float32, 64)
    target = str((model_dir / "model.safetensors").resolve())
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == target:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi))
    assert ranges, "model.safetensors is not mapped"
    for t in (model.layers[0].attn.wo, model.layers[1].mlp.w_down, model.embed_tokens):
        assert any(lo <= t.data_ptr() < hi for lo, hi in ranges)


def test_missing_files_and_tensors(tiny_models, tmp_path):
    src = tiny_models.model("tiny-llama")
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        load_model(tmp_path, CPU, torch.float32, 64)

    no_weights = _copy(src, tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="neither model.safetensors nor"):
        load_model(no_weights, CPU, torch.float32, 64)

    sharded = _copy(tiny_models.model("tiny-llama", shards=2), tmp_path / "sharded")
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"{shard.name} is missing"):
        load_model(sharded, CPU, torch.float32, 64)

    partial = _copy(src, tmp_path / "partial")
    tensors = load_file(partial / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.norm.weight"] = torch.ones(7)
    save_file(tensors, partial / "model.safetensors")
    with pytest.raises(ModelLoadError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        load_model(partial, CPU, torch.float32, 64)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(160, 64)
    save_file(tensors, partial / "model.safetensors")
    with pytest.raises(
        ModelLoadError, match=r"'model.norm.weight' has shape \(7,\), expected \(64,\)"
    ):
        load_model(partial, CPU, torch.float32, 64)

    no_tokenizer = _copy(src, tmp_path / "no_tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        EngineCore(EngineConfig(model_dir=no_tokenizer, device="cpu", num_pages=8))

    alien = _copy(src, tmp_path / "alien")
    _edit_config(alien, architectures=["FalconForCausalLM"])
    with pytest.raises(ModelLoadError, match="'FalconForCausalLM' is not supported"):
        load_model(alien, CPU, torch.float32, 64)


def _config_only(tiny_models, tmp_path) -> Path:
    """tiny-llama's directory without its weights: config and tokenizer."""
    out = _copy(tiny_models.model("tiny-llama"), tmp_path / "config_only")
    (out / "model.safetensors").unlink()
    return out


def test_random_weights_need_no_checkpoint(tiny_models, tmp_path):
    """load_format="random": every weight drawn from a seed of its name, the same on every
    load; norms' scales 1, projections at the scale of their input width; the engine serves
    from them, the same tokens each time."""
    model_dir = _config_only(tiny_models, tmp_path)
    with pytest.raises(ModelLoadError, match="neither model.safetensors"):
        load_model(model_dir, CPU, torch.float32, 64)
    with pytest.raises(ValueError, match="load_format must be one of"):
        load_model(model_dir, CPU, torch.float32, 64, load_format="zip")
    a = load_model(model_dir, CPU, torch.float32, 64, load_format="random")
    b = load_model(model_dir, CPU, torch.float32, 64, load_format="random")
    for x, y in ((a.layers[1].attn.wqkv, b.layers[1].attn.wqkv), (a.lm_head, b.lm_head)):
        assert torch.equal(x, y)
    assert not torch.equal(a.layers[0].mlp.w_down, a.layers[1].mlp.w_down)  # seeds by name
    assert torch.equal(a.layers[0].input_layernorm.weight, torch.ones(64))
    w_down = a.layers[0].mlp.w_down  # [hidden, intermediate]
    assert abs(float(w_down.std()) * w_down.shape[1] ** 0.5 - 1) < 0.05
    tokens = []
    for _ in range(2):
        core = make_core(model_dir, load_format="random")
        request = GenerationRequest(
            request_id="r",
            prompt_token_ids=list(range(3, 40)),
            sampling=SamplingParams(max_new_tokens=6, ignore_eos=True),
        )
        tokens.append(run(core, {0: [request]})["r"].token_ids)
    assert len(tokens[0]) == 6 and tokens[0] == tokens[1]


def test_random_weights_shard_as_the_full_model_splits(tiny_models, tmp_path):
    """A tensor-parallel rank's random weights are its slice of the unsharded model's."""
    model_dir = _config_only(tiny_models, tmp_path)
    cfg = ModelConfig.from_model_dir(model_dir)
    full = load_model(model_dir, CPU, torch.float32, 64, load_format="random")
    rank = load_model(model_dir, CPU, torch.float32, 64, shard=Shard(1, 2), load_format="random")
    q, kv, i = cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
    w = full.layers[1].attn.wqkv  # [q + 2 kv, hidden]: q, k, v
    want = torch.cat([w[q // 2 : q], w[q + kv // 2 : q + kv], w[q + kv + kv // 2 :]])
    assert torch.equal(rank.layers[1].attn.wqkv, want)
    assert torch.equal(rank.layers[1].attn.wo, full.layers[1].attn.wo[:, q // 2 :])
    assert torch.equal(rank.layers[0].mlp.w_down, full.layers[0].mlp.w_down[:, i // 2 :])
    assert torch.equal(rank.embed_tokens, full.embed_tokens)


def test_engine_config_validation(tiny_models):
    with pytest.raises(ValueError, match="device must be cpu, cuda or auto"):
        EngineConfig(model_dir="m", device="tpu")
    with pytest.raises(ValueError, match="page_size must be a positive integer"):
        EngineConfig(model_dir="m", page_size=0)
    with pytest.raises(ValueError, match="num_pages must be a positive integer or None"):
        EngineConfig(model_dir="m", num_pages=-3)
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(model_dir="m", dtype="int8")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(model_dir="m", max_num_seqs=64, max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="load_format must be one of"):
        EngineConfig(model_dir="m", load_format="npz")
    cfg = EngineConfig(model_dir="m", device="cpu")
    assert cfg.torch_dtype is torch.float32
    with pytest.raises(AttributeError):
        cfg.page_size = 8  # frozen
    mc = ModelConfig.from_model_dir(tiny_models.model("tiny-llama"))
    assert context_window(mc, None) == mc.max_position_embeddings
    assert context_window(mc, 100) == 100
    with pytest.raises(ValueError, match="exceeds what the model attends over"):
        context_window(mc, mc.max_position_embeddings + 1)


def test_prompt_tokens_beyond_the_models_vocabulary(tiny_models, tmp_path):
    """A tokenizer larger than the model's embedding table: the prompt is refused by name."""
    model_dir = shutil.copytree(tiny_models.model("tiny-llama"), tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the demo's: 1024 ids, not 512
        shutil.copy(tiny_models.model("demo") / name, model_dir / name)
    core = EngineCore(EngineConfig(model_dir=model_dir, device="cpu", num_pages=64))
    prompt = "The harbour was quiet before dawn."
    big = [t for t in core.tokenizer.encode(prompt) if t >= 512]
    assert big, "the demo tokenizer should have merges beyond the tiny model's vocabulary"
    with pytest.raises(InvalidRequest, match=rf"is {big[0]}, outside the vocabulary \[0, 512\)"):
        core.prepare(GenerationRequest("r", prompt=prompt))


def test_limits_follow_the_pool_and_device():
    """Unset limits are derived: on CUDA from the pool's tokens (400 per sequence, 16 to 512,
    a multiple of 16), on the CPU 64 sequences; 16 waiting requests per running slot, at least
    1024, unless max_waiting or max_queue says otherwise."""
    from services.inference.engine.pool_sizing import cuda_max_num_seqs, engine_limits

    def limits(cfg, num_pages, device):  # sequences and queue; the LoRA rows have their tests
        return engine_limits(cfg, num_pages, device, page_nbytes=2**20, slot_capacity=64)[:2]

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    cfg = EngineConfig(model_dir="m")
    assert limits(cfg, 100_000 // 16, cuda) == (240, 240 * 17)
    assert limits(cfg, 100, cuda) == (16, 16 + 1024)
    assert limits(cfg, 10**7, cuda)[0] == 512
    assert limits(cfg, 10**7, cpu) == (64, 64 * 17)
    assert limits(EngineConfig(model_dir="m", max_waiting=10), 1, cpu)[1] == 74
    given = EngineConfig(model_dir="m", max_num_seqs=8, max_queue=9, max_waiting=100)
    assert limits(given, 10**7, cuda) == (8, 9)
    small = EngineConfig(model_dir="m", max_num_batched_tokens=32)
    assert limits(small, 10**7, cuda)[0] == 32
    # the rule on its own (bench/capacity_bound.py models a pool's service by it): the H100
    # service's 7284 pages of 16 tokens give 288, the H200's 14,568 the cap of 512
    assert cuda_max_num_seqs(7284, 16, 2048) == 288 == limits(cfg, 7284, cuda)[0]
    assert cuda_max_num_seqs(14_568, 16, 2048) == 512
    assert cuda_max_num_seqs(14_568, 16, 100) == 100
