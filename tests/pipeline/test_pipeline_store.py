"""The run directory's building blocks: atomic writes, the source fingerprint, the stage key."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from pipeline_helpers import EXAMPLE, adapt_run, load

from adapt.app.pipeline.store import source_fingerprint, stage_key
from adapt.core.jsonio import atomic_write_text


def test_atomic_write_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    target = tmp_path / "report.json"
    atomic_write_text(target, "old")

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temporary file left behind


def test_atomic_write_is_readable_like_any_user_file(tmp_path):
    target = atomic_write_text(tmp_path / "report.md", "x")
    assert target.stat().st_mode & 0o044 == 0o044 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_fingerprint_tracks_config_weights_and_code_but_not_hidden_files(tmp_path):
    src = shutil.copytree(EXAMPLE, tmp_path / "m")
    base = source_fingerprint(src)
    (src / ".cache").mkdir()
    (src / ".cache" / "note.json").write_text("{}")
    assert source_fingerprint(src) == base

    (src / "modeling_extra.py").write_text("# remote code\n")
    with_code = source_fingerprint(src)
    assert with_code != base

    weights = src / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert source_fingerprint(src) != with_code

    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (src / "config.json").write_text(json.dumps(config))
    assert len({base, with_code, source_fingerprint(src)}) == 3


def test_stage_key_depends_on_every_input():
    args = ("alignment", {"dtype": "bf16"}, "fp", ["up"], "0.1.0")
    key = stage_key(*args)
    assert key == stage_key(*args)
    for i, changed in enumerate(("soak", {"dtype": "fp32"}, "fp2", ["up2"], "0.2.0")):
        assert stage_key(*args[:i], changed, *args[i + 1 :]) != key


def test_torch_globals_a_stage_changes_are_restored():
    """What the soak leaves behind (deterministic mode, a one-rank process group) must not reach the next stage."""
    import torch
    import torch.distributed as dist

    from adapt.app.pipeline.runner import TorchGlobals

    if dist.is_initialized():  # left by an earlier test in this process (soak joins a one-rank group)
        dist.destroy_process_group()
    before = (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads())
    saved = TorchGlobals.capture()
    torch.use_deterministic_algorithms(not before[0])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    saved.restore()
    assert (torch.are_deterministic_algorithms_enabled(), torch.get_num_threads()) == before
    assert not dist.is_initialized()


def test_a_run_directory_inside_the_checkpoint_is_not_part_of_its_fingerprint(tmp_path):
    src = shutil.copytree(EXAMPLE, tmp_path / "m")
    assert adapt_run(src, src / "adapt-runs" / "m", "--stages", "intake") == 0
    assert adapt_run(src, src / "adapt-runs" / "m", "--stages", "intake") == 0
    assert load(src / "adapt-runs" / "m")["stages"][0]["cached"] is True
