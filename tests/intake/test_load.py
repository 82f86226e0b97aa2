"""Real-weight loading through transformers: computed buffers that the loader leaves unset are repaired."""

from __future__ import annotations

import shutil
import subprocess
import sys

import torch

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
