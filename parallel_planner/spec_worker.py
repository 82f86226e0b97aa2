"""Describe a model (``ModelSpec``) in a process of its own, for ``adapt plan``'s cold start.

Planning itself is NumPy; only describing the model needs torch, transformers and the model's
modelling code (about three seconds of imports).  Doing that in a worker keeps the planning process
light, and the worker leaves with ``os._exit`` as soon as its JSON is written: the ~0.5 s an
interpreter spends tearing down torch and transformers buys nothing here (``multiprocessing``'s
forked workers leave the same way), and neither do cyclic garbage collections during the imports.  The structure probes run on tensors of a few hundred kB, where
intra-op threads only cost: on a busy machine OpenMP's spinning made them 50x slower.

Protocol: ``python -m parallel_planner.spec_worker`` reads ``{"source": ModelSource fields,
"seq_len": int}`` on stdin and writes ``{"spec": ...}`` or ``{"error": ..., "exit_code": ...}``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from adapt.core.errors import AdaptError, BadInput, CheckFailed
from adapt.core.inputs import config_error_line, is_config_validation_error
from adapt.core.source import ModelSource
from adapt.core.spec import ModelSpec


@contextlib.contextmanager
def one_intra_op_thread() -> Iterator[None]:
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def describe(src: ModelSource, seq_len: int | None) -> ModelSpec:
    """The spec intake builds, probed on one thread."""
    from adapt.model.intake import build_spec

    with one_intra_op_thread():
        return build_spec(src, seq_len=seq_len)


class WorkerSpec:
    """``describe`` running in a fresh interpreter: start it, do other work, then ``result()``."""

    def __init__(self, src: ModelSource, seq_len: int | None):
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        with self._process.stdin:  # type: ignore[union-attr]
            self._process.stdin.write(json.dumps({"source": asdict(src), "seq_len": seq_len}))  # type: ignore[union-attr]

    def result(self) -> ModelSpec:
        """The spec, or the worker's ``AdaptError`` raised again here."""
        output = self._process.stdout.read()  # type: ignore[union-attr]
        self._process.stdout.close()  # type: ignore[union-attr]
        self._process.wait()
        try:
            answer = json.loads(output)
        except json.JSONDecodeError:
            raise RuntimeError(f"the spec worker exited with code {self._process.returncode} and no answer") from None
        if "spec" in answer:
            return ModelSpec.from_dict(answer["spec"])
        errors = {BadInput.exit_code: BadInput, CheckFailed.exit_code: CheckFailed}
        raise errors.get(answer.get("exit_code"), RuntimeError)(answer["error"])

    def cancel(self) -> None:
        self._process.kill()
        self._process.wait()
        self._process.stdout.close()  # type: ignore[union-attr]


def describe_in_worker(src: ModelSource, seq_len: int | None) -> ModelSpec:
    return WorkerSpec(src, seq_len).result()


def _answer(request: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"spec": describe(ModelSource(**request["source"]), request["seq_len"]).to_dict()}
    except AdaptError as err:
        return {"error": str(err), "exit_code": err.exit_code}
    except Exception as err:  # noqa: BLE001 - reported to the parent, which turns it into one line
        if is_config_validation_error(err):  # transformers rejected a value of the user's config: bad input
            return {
                "error": f"config.json: transformers rejects it: {config_error_line(err)}",
                "exit_code": BadInput.exit_code,
            }
        if os.environ.get("ADAPT_DEBUG"):
            traceback.print_exc()
        return {"error": f"{type(err).__name__}: {err}", "exit_code": None}


def main() -> None:
    # A short-lived process that keeps what it allocates: cyclic collections while ~2,500 modules import
    # cost ~0.5 s of CPU and free nothing worth having before os._exit.
    gc.disable()
    sys.stdout.write(json.dumps(_answer(json.loads(sys.stdin.read()))))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
