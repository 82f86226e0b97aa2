"""Real-weight loading through transformers: computed buffers that the loader leaves unset are repaired."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from adapt.core.errors import BadInput
from adapt.model.intake import load_model, resolve_source


def test_remote_code_non_persistent_buffer_is_computed_not_garbage(zoo, tmp_path):
    ckpt = tmp_path / "zephyrine_with_buffer"  # its own name: transformers caches remote modules by folder
    shutil.copytree(zoo("custom"), ckpt)
    modeling = ckpt / "modeling_zephyrine.py"
    source = modeling.read_text()
    anchor = "        self.span = cfg.width // cfg.n_heads\n"
    assert anchor in source
    modeling.write_text(
        source.replace(
            anchor, anchor + "        self.register_buffer('tone', torch.arange(6.0) * 0.5 + 1, persistent=False)\n"
        )
    )
    # A fresh interpreter: transformers caches remote-code classes per process.
    code = (
        "import sys, torch; from adapt.model.intake import load_model, resolve_source; notes = [];"
        "m = load_model(resolve_source(sys.argv[1], trust_remote_code=True), notes=notes);"
        "assert torch.equal(m.trunk.tone, torch.arange(6.0) * 0.5 + 1), m.trunk.tone;"
        "assert all('tone' in n for n in notes), notes; print('ok', notes)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(ckpt)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-2000:]


def test_persistent_buffers_keep_their_checkpoint_values(zoo, tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ds"
    shutil.copytree(zoo("deepseek_v3"), ckpt)
    state = load_file(ckpt / "model.safetensors")
    key = next(k for k in state if k.endswith("e_score_correction_bias"))
    state[key] = torch.linspace(-1, 1, state[key].numel())
    save_file(state, ckpt / "model.safetensors", metadata={"format": "pt"})
    model = load_model(resolve_source(str(ckpt)))
    assert torch.equal(dict(model.named_buffers())[key], state[key])


def test_a_model_larger_than_memory_is_refused_before_allocation(zoo, monkeypatch):
    import pytest

    import adapt.model.skeleton as skeleton
    from adapt.core.errors import BadInput

    src = resolve_source(str(zoo("llama")))
    need, _ = skeleton.parameter_bytes(src, torch.float32)
    assert need == 106816 * 4
    monkeypatch.setattr(skeleton, "available_memory", lambda device: need)  # 90% of this is not enough
    with pytest.raises(BadInput, match=r"needs 0\.0 GiB .* --streamed"):
        load_model(src)
    monkeypatch.setattr(skeleton, "available_memory", lambda device: 2 * need)
    assert sum(p.numel() for p in load_model(src).parameters()) == 106816


def _text_tower_checkpoint(path, architectures):
    """A multimodal model's text tower saved on its own: no Auto mapping lists its config class."""
    from transformers import Emu3ForCausalLM, Emu3TextConfig

    config = Emu3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = Emu3ForCausalLM(config)
    model.save_pretrained(path)
    config_path = path / "config.json"
    saved = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**saved, "architectures": architectures}))
    return model


def test_a_checkpoint_is_loaded_through_the_class_it_declares_when_no_auto_mapping_lists_its_config(tmp_path):
    saved = _text_tower_checkpoint(tmp_path, ["Emu3ForCausalLM"])
    loaded = load_model(resolve_source(str(tmp_path)), dtype=torch.float32, device="cpu")
    assert type(loaded).__name__ == "Emu3ForCausalLM"
    for name, tensor in saved.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_declared_class_of_another_config_is_not_taken_for_it(tmp_path):
    _text_tower_checkpoint(tmp_path, ["LlamaForCausalLM"])
    with pytest.raises(BadInput, match="no model class for Emu3TextConfig"):
        load_model(resolve_source(str(tmp_path)), dtype=torch.float32, device="cpu")


def _bf16_copy(zoo, tmp_path, family: str):
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / f"{family}_bf16"
    shutil.copytree(zoo(family), ckpt)
    state = {
        k: v.to(torch.bfloat16) if v.is_floating_point() else v
        for k, v in load_file(ckpt / "model.safetensors").items()
    }
    save_file(state, ckpt / "model.safetensors", metadata={"format": "pt"})
    return ckpt, state


def test_a_widening_load_onto_an_accelerator_stages_in_the_stored_dtype(zoo, tmp_path):
    from safetensors.torch import save_file

    from adapt.model.skeleton import staging_dtype

    ckpt, state = _bf16_copy(zoo, tmp_path, "llama")
    src = resolve_source(str(ckpt))
    assert staging_dtype(src, torch.float32, "cuda") == torch.bfloat16
    assert staging_dtype(src, torch.float32, "cpu") is None  # the host converts anyway
    assert staging_dtype(src, torch.bfloat16, "cuda") is None  # nothing to widen
    assert staging_dtype(src, torch.float16, "cuda") is None  # narrowing: not exact
    first = next(iter(state))
    state[first] = state[first].float()  # one fp32 tensor: mixed, load as asked
    save_file(state, ckpt / "model.safetensors", metadata={"format": "pt"})
    assert staging_dtype(resolve_source(str(ckpt)), torch.float32, "cuda") is None


def test_a_staged_load_gives_the_same_weights_and_buffers_as_a_direct_one(zoo, tmp_path, monkeypatch):
    import adapt.model.skeleton as skeleton

    ckpt, _ = _bf16_copy(zoo, tmp_path, "llama")
    src = resolve_source(str(ckpt))
    direct = load_model(src, dtype=torch.float32)
    monkeypatch.setattr(skeleton, "staging_dtype", lambda *args: torch.bfloat16)  # the accelerator path, on the CPU
    staged = load_model(src, dtype=torch.float32)
    want = {**dict(direct.named_parameters()), **dict(direct.named_buffers())}
    got = {**dict(staged.named_parameters()), **dict(staged.named_buffers())}
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_a_configured_attention_soft_cap_is_applied_by_the_loaded_model(zoo, tmp_path):
    """The loaded model computes the function its config declares, whatever attention transformers defaults to.

    transformers 5.17 serves Gemma-2 through SDPA, which has no score modification and drops the cap. Told by
    numerics: the same weights with a cap so tight that any attention applying it must change the logits.
    """
    tight = tmp_path / "gemma2_tight_cap"
    shutil.copytree(zoo("gemma2"), tight)
    config = json.loads((tight / "config.json").read_text())
    assert config["attn_logit_softcapping"]
    config["attn_logit_softcapping"] = 1e-3
    (tight / "config.json").write_text(json.dumps(config))
    ids = torch.randint(0, config["vocab_size"], (1, 8))
    logits = []
    for path in (zoo("gemma2"), tight):
        model = load_model(resolve_source(str(path)), dtype=torch.float64).eval()
        assert model.config._attn_implementation not in (None, "sdpa")
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    assert not torch.allclose(*logits)
