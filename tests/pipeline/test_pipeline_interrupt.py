"""Ctrl-C and SIGTERM at awkward moments, and two runs on one directory."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
from pipeline_helpers import EXAMPLE, adapt_run, load, statuses

from adapt.app.pipeline.store import RunLock

SOAK = ("--stages", "operators,soak", "--soak-steps", "4", "--ckpt-every", "2")


def _signal_inside_checkpoint_write(monkeypatch, signum: int) -> list[int]:
    """Send ``signum`` to this process while DCP writes the second item of the first checkpoint."""
    import torch.distributed.checkpoint.filesystem as fs

    real, calls = fs._write_item, []

    def write_then_signal(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signum)
        return out

    monkeypatch.setattr(fs, "_write_item", write_then_signal)
    return calls


@pytest.fixture
def interactive_sigint():
    """Ctrl-C as a terminal delivers it: Python's default handler.  A suite started as a background job inherits
    SIGINT ignored (POSIX shells do that to background commands), and then a sent SIGINT would never arrive."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _md_row(markdown: str, name: str) -> str:
    """The Markdown summary table's row of stage ``name``."""
    return next(line for line in markdown.splitlines() if re.match(rf"^\|\s*\**{name}\**\s*\|", line))


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_inside_a_checkpoint_write(tmp_path, monkeypatch, capsys, interactive_sigint, signum, code):
    out = tmp_path / "run"
    calls = _signal_inside_checkpoint_write(monkeypatch, signum)
    assert adapt_run(EXAMPLE, out, *SOAK) == code
    assert len(calls) >= 2  # the signal did land inside the write
    err = capsys.readouterr().err
    assert "Traceback" not in err and "CheckpointException" not in err
    assert err.strip().splitlines()[-1].startswith("adapt: error:")

    report = load(out)
    assert report["status"] == "interrupted"
    assert statuses(report)["soak"] == "interrupted" and statuses(report)["operators"] == "passed"
    markdown, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    for name, status in statuses(report).items():  # every report file tells the same story
        assert f"| {status} |" in _md_row(markdown, name), (name, status)
    assert "interrupted" in html.lower() and (out / "junit.xml").is_file()

    ckpts = next((out / "artifacts" / "soak").glob("checkpoints-*"))
    assert not list(ckpts.glob("step-*")) and not (ckpts / "latest").exists()  # the partial step never counts

    monkeypatch.undo()
    assert adapt_run(EXAMPLE, out, *SOAK) == 0
    soak = next(s for s in load(out)["stages"] if s["name"] == "soak")
    assert soak["result"]["resumed_from"] is None and soak["result"]["checkpoints"] == [2, 4]
    assert not list(ckpts.glob(".partial-*"))
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000002", "step-00000004"]


def test_sigterm_while_reports_are_written_leaves_them_whole(tmp_path, monkeypatch):
    """A signal during the report write is held until every file is written, then exits 143."""
    from reports import writer

    real, sent = writer.write_reports, []

    def write_with_signal(report, out_dir, formats=("json", "md", "html", "junit")):
        if not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGTERM)  # held: arrives while the reports are being written
        return real(report, out_dir, formats=formats)

    monkeypatch.setattr("reports.write_reports", write_with_signal)
    out = tmp_path / "run"
    assert adapt_run(EXAMPLE, out, "--stages", "intake") == 143
    report = json.loads((out / "report.json").read_text())
    assert statuses(report)["intake"] == "passed"
    assert (out / "report.md").is_file() and (out / "report.html").is_file() and (out / "junit.xml").is_file()


def test_a_second_run_on_the_same_directory_refuses(tmp_path, capsys):
    out = tmp_path / "run"
    with RunLock(out):  # as if another process were running there
        assert adapt_run(EXAMPLE, out, "--stages", "intake") == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and re.search(
            rf"--out {re.escape(str(out))}: another adapt run \(pid {os.getpid()}\)", err[0]
        )
        assert not (out / "stages").exists()
    assert adapt_run(EXAMPLE, out, "--stages", "intake") == 0  # released: the next run proceeds


def test_the_lock_is_released_when_its_holder_dies(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from adapt.app.pipeline.store import RunLock; lock = RunLock({str(out)!r}); lock.acquire(); print(1, flush=True); input()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert holder.stdout.readline().strip() == "1"
    from adapt.core.errors import BadInput

    with pytest.raises(BadInput, match="another adapt run"):
        RunLock(out).acquire()
    holder.kill()
    holder.wait()
    lock = RunLock(out)
    lock.acquire()  # no stale lock after a SIGKILL
    lock.release()
