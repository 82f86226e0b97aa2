"""Zephyrine: renamed components (Leveller = RMSNorm, Gaze = GQA attention with rotary, Forge = SwiGLU)
and one operator no published model uses: the Quench gate, h * (1 + tanh(s) * asinh(h))."""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_zephyrine import ZephyrineConfig


class Leveller(nn.Module):
    def __init__(self, width, epsilon):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))
        self.epsilon = epsilon

    def forward(self, h):
        dtype = h.dtype
        h32 = h.to(torch.float32)
        h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + self.epsilon)
        return self.gain * h32.to(dtype)


class Quench(nn.Module):
    def __init__(self, width, scale):
        super().__init__()
        self.strength = nn.Parameter(torch.full((width,), float(scale)))

    def forward(self, h):
        return h * (1.0 + torch.tanh(self.strength) * torch.asinh(h))


def _spin(t, cos, sin):
    half = t.shape[-1] // 2
    rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
    return t * cos + rotated * sin


class Gaze(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_groups = cfg.n_groups
        self.span = cfg.width // cfg.n_heads
        self.ask = nn.Linear(cfg.width, cfg.n_heads * self.span, bias=False)
        self.match = nn.Linear(cfg.width, cfg.n_groups * self.span, bias=False)
        self.carry = nn.Linear(cfg.width, cfg.n_groups * self.span, bias=False)
        self.emit = nn.Linear(cfg.n_heads * self.span, cfg.width, bias=False)

    def forward(self, h, cos, sin):
        b, t, _ = h.shape
        q = self.ask(h).view(b, t, self.n_heads, self.span).transpose(1, 2)
        k = self.match(h).view(b, t, self.n_groups, self.span).transpose(1, 2)
        v = self.carry(h).view(b, t, self.n_groups, self.span).transpose(1, 2)
        q, k = _spin(q, cos, sin), _spin(k, cos, sin)
        rep = self.n_heads // self.n_groups
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.span)
        mask = torch.ones(t, t, dtype=torch.bool, device=h.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        out = torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v
        return self.emit(out.transpose(1, 2).reshape(b, t, -1))


class Forge(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        inner = cfg.width * cfg.expansion
        self.valve = nn.Linear(cfg.width, inner, bias=False)
        self.feed = nn.Linear(cfg.width, inner, bias=False)
        self.drain = nn.Linear(inner, cfg.width, bias=False)

    def forward(self, h):
        return self.drain(F.silu(self.valve(h)) * self.feed(h))


class Stratum(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.level_a = Leveller(cfg.width, cfg.epsilon)
        self.gaze = Gaze(cfg)
        self.quench = Quench(cfg.width, cfg.quench_scale)
        self.level_b = Leveller(cfg.width, cfg.epsilon)
        self.forge = Forge(cfg)

    def forward(self, h, cos, sin):
        h = h + self.quench(self.gaze(self.level_a(h), cos, sin))
        return h + self.forge(self.level_b(h))


class ZephyrinePreTrainedModel(PreTrainedModel):
    config_class = ZephyrineConfig
    base_model_prefix = "trunk"
    _no_split_modules = ["Stratum"]

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)


class ZephyrineTrunk(ZephyrinePreTrainedModel):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.lexicon = nn.Embedding(cfg.vocab_size, cfg.width)
        self.strata = nn.ModuleList([Stratum(cfg) for _ in range(cfg.depth)])
        self.level_out = Leveller(cfg.width, cfg.epsilon)
        self.span = cfg.width // cfg.n_heads
        self.post_init()

    def forward(self, input_ids):
        h = self.lexicon(input_ids)
        # Rotary frequencies are computed here rather than kept in a non-persistent buffer, which
        # transformers' meta-device loading would leave uninitialised.
        device = input_ids.device
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, self.span, 2, dtype=torch.float32, device=device) / self.span))
        pos = torch.arange(input_ids.shape[1], device=device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        for stratum in self.strata:
            h = stratum(h, cos, sin)
        return self.level_out(h)


class ZephyrineForCausalLM(ZephyrinePreTrainedModel, GenerationMixin):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.trunk = ZephyrineTrunk(cfg)
        self.readout = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.trunk.lexicon

    def get_output_embeddings(self):
        return self.readout

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.readout(self.trunk(input_ids))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)
