"""A model whose own forward refuses a batch of token ids (a draft that rides on its lead model's states) is refused
at its first forward, in one line with the model's own reason, and the run stops there; a failure of adapt's own
trace is never taken for the model's refusal."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from pipeline_helpers import cli, load, statuses
from torch import nn

import operators.inventory as inventory
from adapt.core.errors import ModelCannotRun
from operators.inventory import trace_model

REASON = "a draft rides on its lead: pass lead_states"

CONFIG = """
from transformers import PretrainedConfig


class TandemConfig(PretrainedConfig):
    model_type = "tandem"

    def __init__(self, vocab_size=40, width=16, depth=2, **kwargs):
        self.vocab_size, self.width, self.depth = vocab_size, width, depth
        super().__init__(**kwargs)
"""

MODELING = f"""
import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_tandem import TandemConfig


class Stride(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.level = nn.LayerNorm(width)
        self.mix = nn.Linear(2 * width, 2 * width)
        self.fold = nn.Linear(2 * width, width)

    def forward(self, h, lead):
        return h + self.fold(torch.tanh(self.mix(torch.cat([self.level(h), lead], dim=-1))))


class TandemForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = TandemConfig

    def __init__(self, config):
        super().__init__(config)
        self.lookup = nn.Embedding(config.vocab_size, config.width)
        self.strides = nn.ModuleList([Stride(config.width) for _ in range(config.depth)])
        self.readout = nn.Linear(config.width, config.vocab_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.lookup

    def forward(self, input_ids=None, lead_states=None, labels=None, **kwargs):
        if lead_states is None:
            raise ValueError({REASON!r})
        h = self.lookup(input_ids)
        for stride in self.strides:
            h = stride(h, lead_states)
        return CausalLMOutput(logits=self.readout(h))
"""


class Draft(nn.Module):
    """The same contract as a plain module: token ids alone are refused by the model's own code."""

    def __init__(self, vocab: int = 40, width: int = 16):
        super().__init__()
        self.lookup = nn.Embedding(vocab, width)
        self.readout = nn.Linear(width, vocab)

    def get_input_embeddings(self):
        return self.lookup

    def forward(self, input_ids, lead_states=None):
        if lead_states is None:
            raise ValueError(f"{REASON}\n(see the lead model's docs)")
        return (self.readout(self.lookup(input_ids) + lead_states),)


class Plain(Draft):
    def forward(self, input_ids, lead_states=None):
        return (self.readout(self.lookup(input_ids)),)


def test_the_first_forward_refuses_a_model_that_needs_more_than_token_ids_with_its_own_reason():
    with pytest.raises(ModelCannotRun) as refused:
        trace_model(Draft())
    message = str(refused.value)
    assert message.startswith("the model cannot run from token ids alone") and REASON in message
    assert "\n" not in message and refused.value.exit_code == 2


def test_a_failure_of_the_trace_itself_is_never_the_models_refusal(monkeypatch):
    """The trace breaks (standing in for a bug in adapt) on a model that runs: adapt's own error comes out."""

    def broken(model, input_ids):
        raise RuntimeError("trace bookkeeping broke")

    monkeypatch.setattr(inventory, "model_loss", broken)
    with pytest.raises(RuntimeError, match="trace bookkeeping broke"):
        trace_model(Plain())


@pytest.fixture
def tandem(tmp_path):
    """A remote-code checkpoint of the draft model, loaded the way ``--trust-remote-code`` loads a user's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    ckpt = tmp_path / "tandem"
    ckpt.mkdir()
    (ckpt / "configuration_tandem.py").write_text(textwrap.dedent(CONFIG))
    (ckpt / "modeling_tandem.py").write_text(textwrap.dedent(MODELING))
    auto_map = {
        "AutoConfig": "configuration_tandem.TandemConfig",
        "AutoModelForCausalLM": "modeling_tandem.TandemForCausalLM",
    }
    config = {"model_type": "tandem", "architectures": ["TandemForCausalLM"], "auto_map": auto_map}
    (ckpt / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt, trust_remote_code=True),
                                             trust_remote_code=True, dtype=torch.float32)  # fmt: skip
    model.save_pretrained(ckpt)
    saved = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**saved, "auto_map": auto_map}))
    return ckpt


def test_the_run_stops_with_exit_2_at_the_stage_that_found_it(tandem, tmp_path, capsys):
    out = tmp_path / "run"
    code = cli("run", str(tandem), "--out", str(out), "--quiet", "--trust-remote-code")
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0]
    assert err[0].startswith("adapt: error: operators: the model cannot run from token ids alone") and REASON in err[0]
    got = statuses(load(out))
    assert got["intake"] == "passed" and got["operators"] == "error"
    later = [name for name in got if name not in ("intake", "operators")]
    assert later and {got[name] for name in later} == {"blocked"}
