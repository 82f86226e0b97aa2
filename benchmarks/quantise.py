"""Store a saved checkpoint's weights quantised, the way Day-0 releases ship them.

- fp8 blocks (DeepSeek-V3, Qwen3-FP8): each 2-D weight of the blocks (not the embedding or the output head) becomes
  ``float8_e4m3fn`` codes with one float32 ``weight_scale_inv`` per 128 x 128 block (``quant_method: fp8``, which
  transformers' fine-grained fp8 quantizer reads);
- MXFP4 experts (gpt-oss): each expert bank becomes ``<name>_blocks``, two 4-bit e2m1 codes a byte, and
  ``<name>_scales``, one power-of-two exponent (e8m0) per 32 values along the input dimension
  (``quant_method: mxfp4``, transformers' MXFP4 layout).

``config.json`` gains the matching ``quantization_config``.  Used by the tests of quantised intake and loading, and
by ``run_device.py --fp8`` for a user's run on such a checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

BLOCK = 128
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
SCALE_SUFFIX = "weight_scale_inv"
MXFP4_GROUP = 32  # values sharing one exponent
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # code -> value
E8M0_BIAS = 127


def quantisable(name: str, tensor: torch.Tensor) -> bool:
    """A block's linear weight: what fp8 releases store quantised (embeddings and the head stay 16-bit)."""
    return tensor.dim() == 2 and name.endswith(".weight") and "embed" not in name and "lm_head" not in name


def fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 codes, one float32 scale per 128 x 128 block): each block scaled so its largest value is FP8_MAX."""
    rows, cols = weight.shape
    pad = torch.zeros(-(-rows // BLOCK) * BLOCK, -(-cols // BLOCK) * BLOCK, dtype=torch.float32)
    pad[:rows, :cols] = weight.float()
    blocks = pad.unflatten(0, (-1, BLOCK)).unflatten(2, (-1, BLOCK))  # [row blocks, 128, col blocks, 128]
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    codes = (blocks / scale[:, None, :, None]).flatten(2).flatten(0, 1)[:rows, :cols].to(torch.float8_e4m3fn)
    return codes, scale


def scale_name(weight_name: str) -> str:
    return weight_name.removesuffix("weight") + SCALE_SUFFIX


def expert_bank(name: str, tensor: torch.Tensor) -> bool:
    """An MoE layer's experts stored as one 3-D bank (gpt-oss: ``mlp.experts.gate_up_proj`` and ``down_proj``)."""
    return tensor.dim() == 3 and name.endswith(("experts.gate_up_proj", "experts.down_proj"))


def mxfp4_blocks(bank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes ``[E, out, in/32, 16]`` uint8, exponents ``[E, out, in/32]`` uint8) of a bank stored
    ``[E, in, out]``: each group of 32 inputs gets the smallest power of two that brings its largest value within
    e2m1's 6, and each value the nearest code."""
    weight = bank.double().transpose(1, 2)  # [E, out, in]: groups run along the input dimension
    groups = weight.unflatten(-1, (-1, MXFP4_GROUP))
    largest = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(largest / 6.0)).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - torch.tensor(E2M1, dtype=torch.float64)).abs().argmin(dim=-1).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # the even value in the low nibble
    return packed, (exponent + E8M0_BIAS).to(torch.uint8)


def quantise_checkpoint_fp8(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Rewrite ``checkpoint``'s safetensors files and config in place; returns what was stored (codes and scales by
    name, the untouched tensors too)."""

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if not quantisable(name, tensor):
            return {name: tensor}
        codes, scale = fp8_blocks(tensor)
        return {name: codes, scale_name(name): scale}

    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
    return _rewrite(checkpoint, convert, config)


def quantise_checkpoint_mxfp4(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The same for a checkpoint's expert banks in MXFP4, as gpt-oss ships them."""

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if not expert_bank(name, tensor):
            return {name: tensor}
        blocks, scales = mxfp4_blocks(tensor)
        return {f"{name}_blocks": blocks, f"{name}_scales": scales}

    return _rewrite(checkpoint, convert, {"quant_method": "mxfp4"})


def _rewrite(
    checkpoint: Path,
    convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
    quantization_config: dict,
) -> dict[str, torch.Tensor]:
    """Each shard's tensors through ``convert`` (a name to the tensors stored in its place), the index and the
    config updated; returns everything stored."""
    from safetensors.torch import load_file, save_file

    stored: dict[str, torch.Tensor] = {}
    placed: dict[str, str] = {}  # stored tensor -> its file, for a sharded checkpoint's index
    for shard in sorted(checkpoint.glob("*.safetensors")):
        written: dict[str, torch.Tensor] = {}
        for name, tensor in load_file(shard).items():
            for new_name, new_tensor in convert(name, tensor).items():
                written[new_name] = new_tensor
                placed[new_name] = shard.name
        save_file(written, shard, metadata={"format": "pt"})
        stored.update(written)
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = placed
        index.write_text(json.dumps(data, indent=2))
    config_path = checkpoint / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = quantization_config
    config_path.write_text(json.dumps(config, indent=2))
    return stored
