"""Alignment of the adapted model as users run it: the plan's kernels, then its blocks compiled (``module.compile()``).

On CUDA the plan compiles block by block; these CPU tests force that mode with Dynamo's ``aot_eager`` backend,
wrapped to count the graphs it is handed and the calls into them.  Layer-by-layer capture must still see every
component inside a compiled block, with one graph serving every block (a capture that made Dynamo compile each
block anew would, past its recompile limit of 8, judge eager code).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import first_norm, poison_output, scale_norm_output
from torch._dynamo.backends.registry import lookup_backend, register_backend
from transformers import LlamaForCausalLM

from adapt.model.intake import resolve_source
from adapt.model.zoo import make_config
from validators.align import AlignOptions, align
from validators.modules import find_blocks

LAYERS = 10  # past Dynamo's recompile limit (8): a graph per block would leave the last ones eager
OPTIONS = AlignOptions(batch=2, seq_len=16, parity_steps=2)
COMPILED = dataclasses.replace(OPTIONS, compile_mode="blocks", compile_backend="counting_aot_eager")
SEEN = {"graphs": 0, "calls": 0}


@register_backend(name="counting_aot_eager")
def _counting_aot_eager(gm: torch.fx.GraphModule, example_inputs):
    """``aot_eager``, counting the graphs it compiles and the calls into them."""
    SEEN["graphs"] += 1
    compiled = lookup_backend("aot_eager")(gm, example_inputs)

    def run(*args):
        SEEN["calls"] += 1
        return compiled(*args)

    return run


@pytest.fixture(autouse=True)
def fresh_dynamo(fresh_seed):
    torch._dynamo.reset()
    SEEN.update(graphs=0, calls=0)
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random Llama checkpoint and the operators stage's kernel plan for it."""
    from operators import run_ops

    config = make_config("llama")
    config.num_hidden_layers = LAYERS
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(path)
    src = resolve_source(str(path))
    return src, run_ops(src, onnx=False, check_patch=False).plan


def test_compiled_candidate_aligns_every_layer_of_every_block(llama):
    src, plan = llama
    assert plan.compile["mode"] == "none"  # the CPU plan runs eager: the test forces the CUDA plan's mode
    eager = align(src, plan, dtype="bf16", options=OPTIONS)
    assert SEEN["calls"] == 0 and eager.candidate_compile == "none" and "candidate compiled: none" in eager.notes
    compiled = align(src, plan, dtype="bf16", options=COMPILED)
    assert compiled.passed and compiled.inconclusive is None, (compiled.seed, compiled.first_divergent, compiled.notes)
    assert compiled.candidate_compile == "blocks (counting_aot_eager)"
    assert "candidate compiled: blocks (counting_aot_eager)" in compiled.notes
    assert [layer.name for layer in compiled.layers] == [layer.name for layer in eager.layers]
    assert {layer.block for layer in compiled.layers} == {*range(LAYERS), None}
    assert sum(layer.component is not None for layer in compiled.layers) == 4 * LAYERS
    assert not any("not captured" in note or "recompile limit" in note for note in compiled.notes)
    assert compiled.gradients and all(g.passed for g in compiled.gradients)
    assert len(compiled.gradients) == len(eager.gradients)
    assert compiled.parity is not None and compiled.parity.passed and compiled.parity.steps == 2
    # Each block ran a compiled graph in the captured forward and in both training steps, and the graphs did not
    # multiply with the depth: one for the captured forward, one for the blocks' own capture hooks, one for training.
    assert SEEN["calls"] >= LAYERS * (1 + COMPILED.parity_steps), SEEN
    assert SEEN["graphs"] <= 3, SEEN
    # The plan as it runs compiled block by block: the residual-add fusion is left to the compiler.
    assert not any("add_rms_norm" in entry for entry in compiled.patched_modules)
    assert any("add_rms_norm" in entry for entry in eager.patched_modules)


@pytest.mark.parametrize("block", [0, 6])
def test_a_broken_norm_inside_a_compiled_block_is_named(llama, block):
    src, _ = llama
    report = align(src, dtype="bf16", transform=scale_norm_output(block, 1.05), options=COMPILED)
    blocks = find_blocks(LlamaForCausalLM(make_config("llama")))
    norm_name, _ = first_norm(blocks.blocks[0])
    assert SEEN["calls"] > 0 and report.candidate_compile == "blocks (counting_aot_eager)"
    assert not report.passed
    assert report.first_divergent_block == block
    assert report.first_divergent_component == norm_name
    assert report.first_divergent == f"{blocks.block_path(block)}.{norm_name}"
    assert all(layer.passed for layer in report.layers if layer.block is not None and layer.block < block)
    broken = next(layer for layer in report.layers if layer.name == report.first_divergent)
    assert broken.err_ratio > 2


def test_nan_inside_a_compiled_block_names_the_component(llama):
    src, _ = llama
    report = align(src, dtype="bf16", transform=poison_output(3, "mlp"), options=COMPILED)
    assert SEEN["calls"] > 0
    assert not report.passed
    assert report.nonfinite_module == report.first_divergent == "model.layers.3.mlp"
    assert report.layers == []
    assert any("compiled candidate: NaN/Inf located among its captured outputs" in note for note in report.notes)


def _hook_every_block_its_own_way(model: torch.nn.Module) -> torch.nn.Module:
    """A no-op hook per block that Dynamo guards on by id (as a per-block fusion hook would be): a graph per block."""
    for block in find_blocks(model).blocks:
        block.self_attn.register_forward_hook(lambda *_: None, always_call=True)
    return model


def test_blocks_past_the_recompile_limit_are_said_to_have_run_eagerly(llama):
    src, _ = llama
    options = dataclasses.replace(COMPILED, parity_steps=0)
    report = align(src, dtype="bf16", transform=_hook_every_block_its_own_way, options=options)
    assert report.passed, report.notes  # the same function, computed eagerly past the limit
    assert SEEN["graphs"] >= torch._dynamo.config.recompile_limit  # one graph per block, up to the limit
    assert any(
        note.startswith("Dynamo hit its recompile limit while the compiled candidate ran") for note in report.notes
    )


def test_streamed_alignment_says_its_candidate_is_not_compiled(llama):
    src, plan = llama
    options = dataclasses.replace(COMPILED, backward=False, parity_steps=0)
    report = align(src, plan, dtype="bf16", streamed=True, options=options)
    assert SEEN["calls"] == 0
    assert report.candidate_compile == "none"
    assert any(note.startswith("candidate not compiled: streamed alignment") for note in report.notes)
