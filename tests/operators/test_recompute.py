"""Activation recomputation per block (``operators.recompute``): what a block keeps, and that gradients survive.

What a compiled block keeps for backward is read off the forward graph AOTAutograd partitions (its outputs
beyond the block's own are the saved activations), so the test sees what Inductor would keep on a GPU.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from adapt.model.zoo import make_config
from operators.api import compile_as_planned
from operators.recompute import checkpoint_blocks, recomputable

aten = torch.ops.aten
COMPUTE_BOUND = {"mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu"}


@pytest.fixture(autouse=True)
def fresh_dynamo(fresh_seed):
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _llama(layers: int = 3) -> LlamaForCausalLM:
    config = make_config("llama")
    config.num_hidden_layers = layers
    return LlamaForCausalLM(config).train()


class SavedActivations:
    """A backend that partitions like Inductor and records, per forward graph, the activations kept for
    backward: graph outputs past the block's own that are not graph inputs (weights, the block input)."""

    def __init__(self) -> None:
        self.graphs: list[list[torch.fx.Node]] = []

        def forward_compiler(gm: torch.fx.GraphModule, example_inputs):
            outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            self.graphs.append([n for n in outputs[1:] if isinstance(n, torch.fx.Node) and n.op != "placeholder"])
            return make_boxed_func(gm.forward)

        self.backend = aot_autograd(
            fw_compiler=forward_compiler,
            bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
            partition_fn=min_cut_rematerialization_partition,
        )

    @staticmethod
    def producer(node: torch.fx.Node) -> str:
        """The operator that computed a kept value (through getitem, for multi-output ops)."""
        if node.target is operator.getitem:
            node = node.args[0]
        return getattr(node.target, "__name__", str(node.target)).split(".")[0]

    def kept_elements(self) -> int:
        return sum(n.meta["val"].numel() for n in self.graphs[0])


def _train_step(model, ids) -> dict[str, torch.Tensor]:
    """As a user's loop calls it: the model's own ``use_cache`` default, so it builds a key/value cache."""
    model(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_selective_keeps_only_compute_bound_outputs_and_a_third_less():
    ids = torch.randint(0, 96, (2, 16))
    kept = {}
    for mode in ("none", "selective"):
        model = _llama()
        checkpoint_blocks(model.model.layers, mode)
        saved = SavedActivations()
        compile_as_planned(model, "blocks", backend=saved.backend)
        torch._dynamo.utils.counters.clear()
        _train_step(model, ids)
        assert not torch._dynamo.utils.counters["graph_break"], "a checkpointed block compiles whole"
        assert len(saved.graphs) == 1, "one graph serves every block"
        kept[mode] = (saved.kept_elements(), {saved.producer(n) for n in saved.graphs[0]})
        torch._dynamo.reset()
    assert not kept["none"][1] <= COMPUTE_BOUND, "without recomputation elementwise outputs are kept too"
    assert kept["selective"][1] <= COMPUTE_BOUND, kept["selective"][1]
    assert kept["selective"][0] < 0.75 * kept["none"][0], kept


def _gpt2_with_dropout() -> GPT2LMHeadModel:
    config = GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=96, n_positions=32, bos_token_id=0, eos_token_id=0
    )  # dropout 0.1 everywhere by default
    return GPT2LMHeadModel(config).train()


def _qwen3_moe() -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=96,
        max_position_embeddings=64,
    )
    return Qwen3MoeForCausalLM(config).train()


@pytest.mark.parametrize("build", [_gpt2_with_dropout, _qwen3_moe], ids=["gpt2-dropout", "qwen3-moe"])
@pytest.mark.parametrize("mode", ["selective", "full"])
@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "compiled"])
def test_recomputed_blocks_give_the_gradients_of_kept_ones(build, mode, backend):
    """Same seed, same dropout masks: recomputation must not change a single gradient bit in eager mode.

    Compiled, a block that breaks its graph (transformers 5.17's grouped-GEMM experts read offsets with ``item()``,
    which AOTAutograd cannot trace) is cut into different graphs with and without the checkpoint, so float32 sums
    may round in another order: there the gradients must agree to float32 rounding, far tighter than any wrong
    replay would.
    """
    base = build()
    ids = torch.randint(0, 96, (2, 16))
    blocks_of = (lambda m: m.transformer.h) if isinstance(base, GPT2LMHeadModel) else (lambda m: m.model.layers)
    results = []
    torch._dynamo.utils.counters.clear()
    for recompute in ("none", mode):
        model = copy.deepcopy(base)
        checkpoint_blocks(blocks_of(model), recompute)
        if backend:
            for block in blocks_of(model):
                block.compile(backend=backend)
        torch.manual_seed(123)
        results.append(_train_step(model, ids))
    plain, recomputed = results
    assert plain.keys() == recomputed.keys()
    counters = torch._dynamo.utils.counters
    exact = backend is None or not (counters["graph_break"] or counters["unimplemented"])
    for name in plain:
        tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6 * plain[name].abs().max().item()}
        torch.testing.assert_close(recomputed[name], plain[name], **tolerance, msg=name)


def test_a_model_that_keeps_a_cache_still_generates_the_same_with_blocks_checkpointed():
    """Without gradients a checkpointed block runs as it is, so generation fills and reads its cache."""
    model = _llama(2).eval()
    ids = torch.randint(0, 96, (1, 6))
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=5, do_sample=False)
        checkpoint_blocks(model.model.layers, "selective")
        checkpointed = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(plain, checkpointed)


def test_undo_restores_each_block_and_keeps_a_patched_forward():
    model = _llama(2)
    first, second = model.model.layers
    patched = first.forward  # stands in for a kernel patch on the block itself
    first.forward = patched
    undo = checkpoint_blocks(model.model.layers, "selective")
    assert first.forward is not patched and "forward" in second.__dict__
    undo()
    assert first.forward is patched
    assert "forward" not in second.__dict__ and "_adapt_recompute" not in second.__dict__


def test_the_policy_keeps_compute_bound_and_random_ops_are_replayed():
    assert not recomputable(aten.mm.default)
    assert not recomputable(torch.ops.adapt.grouped_gemm.default)
    assert not recomputable(aten._scaled_dot_product_cudnn_attention.default)
    assert recomputable(aten.mul.Tensor) and recomputable(aten._to_copy.default)
    assert recomputable(torch.ops.adapt.rms_norm.default)
    with pytest.raises(ValueError, match="recompute must be one of"):
        checkpoint_blocks([], "some")
