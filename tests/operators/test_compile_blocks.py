"""Compiling block by block: one graph serves every identical block while the model trains.

transformers builds a KV cache on every forward unless told not to, and each attention layer indexes it by
its own layer number.  A block compiled on its own is then guarded on that number: it recompiles for each
layer and, past Dynamo's recompile limit, silently runs eagerly.  The plan's "blocks" mode turns the cache
off for training-mode calls that do not ask for it; these tests count the graphs Dynamo hands the backend.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from adapt.model.zoo import make_config
from operators.api import compile_as_planned

LAYERS = 10  # more than Dynamo's default recompile limit (8): a per-layer graph would show as eager layers


class CountingBackend:
    """Runs each graph Dynamo captures as it is, and counts them."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs) -> object:
        self.graphs += 1
        return gm.forward


def _tiny_llama() -> LlamaForCausalLM:
    config = make_config("llama")  # the zoo's Llama, at a depth past the recompile limit
    config.num_hidden_layers = LAYERS
    return LlamaForCausalLM(config)


@pytest.fixture(autouse=True)
def fresh_dynamo(fresh_seed):
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_training_step_compiles_one_graph_for_all_blocks_and_matches_eager():
    model = _tiny_llama().train()
    ids = torch.randint(0, 64, (2, 12))
    expected = model(input_ids=ids, labels=ids).loss
    expected.backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    backend = CountingBackend()
    undo = compile_as_planned(model, "blocks", backend=backend)
    loss = model(input_ids=ids, labels=ids).loss  # the plain training call: no use_cache keyword
    loss.backward()
    assert backend.graphs == 1, f"{backend.graphs} graphs for {LAYERS} identical blocks"
    torch.testing.assert_close(loss, expected)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name], msg=name)
    for fn in undo:
        fn()
    assert all(block._compiled_call_impl is None for block in model.model.layers)


def test_cache_stays_where_the_caller_or_eval_mode_wants_it():
    model = _tiny_llama().eval()
    undo = compile_as_planned(model, "none")
    assert undo == []
    compile_as_planned(model, "blocks", backend=CountingBackend())
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        assert model(input_ids=ids).past_key_values is not None  # eval: the cache is the caller's default
        model.train()
        assert model(input_ids=ids).past_key_values is None  # training, unasked: no cache
        assert model(input_ids=ids, use_cache=True).past_key_values is not None  # asked for: kept


def test_a_patched_model_with_a_fused_residual_add_still_shares_one_graph(tmp_path):
    """The plan's kernels (hand-written norms, SwiGLU, rotary, fused loss) keep one graph for all blocks; the
    residual-add fusion, which hangs on per-block hooks, is left to Inductor when blocks compile one by one."""
    from ops_testlib import planned

    from operators import adapt_model, apply_kernel_plan
    from operators.mapping import for_compile_mode
    from operators.registry import Target

    _tiny_llama().save_pretrained(tmp_path)
    model, plan = planned(str(tmp_path), target=Target("cpu", "float32", True, None, prefer=["adapt-triton"]))
    assert any(c.kind == "residual_add_norm" and c.patch for c in plan.components)
    handle = adapt_model(model, plan, compile_mode="none")
    assert handle.fusion_targets, "uncompiled, the residual add is fused"
    handle.revert()
    blocks_plan = for_compile_mode(plan, "blocks")
    assert not any(c.kind == "residual_add_norm" and c.patch for c in blocks_plan.components)
    assert [c.kernel for c in blocks_plan.components if c.kind != "residual_add_norm"] == [
        c.kernel for c in plan.components if c.kind != "residual_add_norm"
    ]

    model.train()
    ids = torch.randint(0, 64, (2, 12))
    expected = model(input_ids=ids, labels=ids).loss
    handle = apply_kernel_plan(model, blocks_plan)
    backend = CountingBackend()
    undo = compile_as_planned(model, "blocks", backend=backend)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert backend.graphs == 1, f"{backend.graphs} graphs for {LAYERS} identical patched blocks"
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
    for fn in undo:
        fn()
    handle.revert()


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputed_patched_blocks_still_compile_whole_into_one_graph(tmp_path, mode):
    """Checkpointing wraps each patched block in a region where Dynamo refuses Python side effects; the rotary
    patch's dispatcher pushes and pops a list there.  A refused block runs eagerly (on the H200 a Llama-1B step
    went 14% slower), so the count of graph breaks must stay at zero and the gradients those of the kept blocks."""
    from ops_testlib import planned

    from adapt.model.blocks import find_blocks
    from operators import apply_kernel_plan
    from operators.mapping import for_compile_mode
    from operators.recompute import checkpoint_blocks
    from operators.registry import Target

    _tiny_llama().save_pretrained(tmp_path)
    model, plan = planned(str(tmp_path), target=Target("cpu", "float32", True, None, prefer=["adapt-triton"]))
    blocks_plan = for_compile_mode(plan, "blocks")
    assert any(c.kind == "rotary_application" and c.patch for c in blocks_plan.components)
    model.train()
    handle = apply_kernel_plan(model, blocks_plan)
    ids = torch.randint(0, 64, (2, 12))
    expected = model(input_ids=ids, labels=ids).loss
    expected.backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    undo_recompute = checkpoint_blocks(find_blocks(model), mode)
    backend = CountingBackend()
    undo = compile_as_planned(model, "blocks", backend=backend)
    torch._dynamo.utils.counters.clear()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert backend.graphs == 1, f"{backend.graphs} graphs for {LAYERS} identical patched blocks"
    torch.testing.assert_close(loss, expected)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name], msg=name)
    for fn in [*undo, undo_recompute]:
        fn()
    handle.revert()
    assert not torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint, "undo restores Dynamo's setting"
