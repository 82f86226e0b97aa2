"""The on-disk measurement cache: where it lives, what its keys hold, and that writes are whole."""

from __future__ import annotations

import json

from operators import timing_cache
from operators.timing_cache import DiskCache, make_key


def test_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("ADAPT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert timing_cache.cache_dir() == tmp_path / "xdg" / "adapt"
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path / "mine"))
    assert timing_cache.cache_dir() == tmp_path / "mine"


def test_entries_survive_merge_and_leave_no_temporary_files(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path))
    first, second = DiskCache("t"), DiskCache("t")
    first.put("a", 1.5)
    second.put("b", 2.5)  # another writer: the file is merged, not overwritten
    assert DiskCache("t").get("a") == 1.5 and DiskCache("t").get("b") == 2.5
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]
    (tmp_path / "t.json").write_text("{torn")
    assert DiskCache("t").get("a") is None  # an unreadable file is empty, not an error
    DiskCache("t").put("c", 3)
    assert json.loads((tmp_path / "t.json").read_text()) == {"c": 3}


def test_keys_change_with_shape_and_library_versions(monkeypatch):
    base = make_key("cpu", "rms_norm", {"width": 64}, "bfloat16")
    assert make_key("cpu", "rms_norm", {"width": 64}, "bfloat16") == base
    assert make_key("cpu", "rms_norm", {"width": 128}, "bfloat16") != base
    versions = dict(timing_cache.library_versions())
    monkeypatch.setattr(timing_cache, "library_versions", lambda: {**versions, "torch": "0.0-other"})
    assert make_key("cpu", "rms_norm", {"width": 64}, "bfloat16") != base


def test_source_digest_moves_when_a_kernel_file_changes(tmp_path):
    (tmp_path / "k.py").write_text("x = 1\n")
    before = timing_cache.source_digest(tmp_path)
    (tmp_path / "k.py").write_text("x = 2\n")
    assert timing_cache.source_digest(tmp_path) != before
