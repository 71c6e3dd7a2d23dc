"""Bad model folders fail with a specific exception that names the file or tensor."""

import json

import numpy as np
import pytest
from model_utils import numpy_backend, save_tiny_hf_model

from refserve.models.loader import (
    ModelLoadError,
    UnsupportedModelError,
    load_config,
    load_model,
    read_safetensors,
)


def test_nonexistent_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope", numpy_backend())


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path, numpy_backend())


def test_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2' is not supported"):
        load_config(tmp_path)


def test_truncated_safetensors(tmp_path):
    folder, _ = save_tiny_hf_model(tmp_path)
    f = folder / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(folder, numpy_backend())
    f.write_bytes(data[:5])
    with pytest.raises(ModelLoadError, match="too short"):
        read_safetensors(f)


def test_missing_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    folder, _ = save_tiny_hf_model(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing tensor.*layers\.1\.mlp\.up_proj"):
        load_model(folder, numpy_backend())


def test_misshaped_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file

    folder, _ = save_tiny_hf_model(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = np.ones(7, dtype=np.float32)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'model.norm.weight' has shape \(7,\), "
                                             r"expected \(48,\)"):
        load_model(folder, numpy_backend())


def test_sharded_checkpoint_and_bf16(tmp_path):
    """An index with two shards loads, and bfloat16 weights are read exactly."""
    import torch

    folder, hf = save_tiny_hf_model(tmp_path)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    sharded = tmp_path / "sharded"
    assert (sharded / "model.safetensors.index.json").is_file()
    model = load_model(sharded, numpy_backend())
    expect = hf.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(model.embed_tokens, expect)
    del folder


def test_rope_theta_from_rope_parameters(tmp_path):
    cfg = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 32,
           "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_config(tmp_path).rope_theta == 500000.0
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="yarn"):
        load_config(tmp_path)
