"""Store a saved checkpoint's linear weights as fp8 blocks, the way DeepSeek-V3 and Qwen3-FP8 ship theirs.

Each 2-D weight of the blocks (not the embedding or the output head) becomes ``float8_e4m3fn`` codes with one
float32 ``weight_scale_inv`` per 128 x 128 block, and ``config.json`` gains the matching ``quantization_config``
(``quant_method: fp8``), which transformers' fine-grained fp8 quantizer reads.  Used by the tests of quantised
intake and loading, and by ``run_device.py --fp8`` for a user's run on such a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

BLOCK = 128
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
SCALE_SUFFIX = "weight_scale_inv"


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


def quantise_checkpoint_fp8(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Rewrite ``checkpoint``'s safetensors files and config in place; returns what was stored (codes and scales by
    name, the untouched tensors too)."""
    from safetensors.torch import load_file, save_file

    stored: dict[str, torch.Tensor] = {}
    new_names: dict[str, str] = {}  # scale tensor -> its file, for a sharded checkpoint's index
    for shard in sorted(checkpoint.glob("*.safetensors")):
        written = {}
        for name, tensor in load_file(shard).items():
            if quantisable(name, tensor):
                written[name], written[scale_name(name)] = fp8_blocks(tensor)
                new_names[scale_name(name)] = shard.name
            else:
                written[name] = tensor
        save_file(written, shard, metadata={"format": "pt"})
        stored.update(written)
    index = checkpoint / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update(new_names)
        index.write_text(json.dumps(data, indent=2))
    config_path = checkpoint / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }
    config_path.write_text(json.dumps(config, indent=2))
    return stored
