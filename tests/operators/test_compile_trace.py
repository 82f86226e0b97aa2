"""A patched model compiles whole: every adapt kernel is one ``torch.ops.adapt`` node, forward and backward.

For each zoo family the kernel plan (adapt-triton preferred) is applied to the tiny model, which then runs
under ``torch.compile(fullgraph=True)`` with AOTAutograd and no code generation.  A recording backend
keeps Dynamo's graph and AOTAutograd's forward and backward graphs: each kernel the plan installed
must be a node there, so a trace that routed around a kernel fails.  The operators' own call counters
(advanced only by real executions) show the kernels ran, and the compiled loss and every gradient
must equal the eager patched model's.  ``torch.export`` of a patched Llama keeps the operators too.
The kernels run in Triton's CPU interpreter; shapes are the zoo's smallest.
"""

from __future__ import annotations

import pytest
import torch
from ops_testlib import planned
from torch import nn

from adapt.model.zoo import ZOO_NAMES
from operators import apply_kernel_plan
from operators.registry import Target

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="runs the kernels in Triton's CPU interpreter")

CPU = Target("cpu", "float32", True, None, prefer=["adapt-triton"])
_MOE_FORWARD = {"moe_route", "moe_sort", "moe_permute", "grouped_gemm", "glu", "moe_unpermute"}
_MOE_BACKWARD = {"moe_route_backward", "moe_combine", "grouped_gemm_backward", "glu_backward", "moe_unpermute_backward"}
# kernel the plan chose -> (operators in the forward graph, operators in the backward graph)
EXPECTED = {
    "rms_norm": ({"rms_norm"}, {"rms_norm_backward"}),
    "add_rms_norm": ({"add_rms_norm"}, {"rms_norm_backward"}),
    "layer_norm": ({"layer_norm"}, {"layer_norm_backward"}),
    "swiglu_linear": ({"glu_linear"}, {"glu_linear_backward"}),
    "geglu_linear": ({"glu_linear"}, {"glu_linear_backward"}),
    "apply_rotary": ({"apply_rotary"}, {"apply_rotary_backward"}),
    "fused_linear_cross_entropy": ({"fused_linear_cross_entropy"}, set()),  # mean loss: gradients made in forward
    "moe_grouped_gemm": (_MOE_FORWARD, _MOE_BACKWARD),
}


@pytest.fixture(autouse=True)
def every_test_draws_fresh(fresh_seed):
    return fresh_seed


class RecordingBackend:
    """AOTAutograd without code generation that keeps Dynamo's graph and the forward and backward graphs."""

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        self.graphs: dict[str, list[torch.fx.GraphModule]] = {"dynamo": [], "forward": [], "backward": []}

        def keep(kind):
            def compiler(gm, example_inputs):
                self.graphs[kind].append(gm)
                return make_boxed_func(gm.forward)

            return compiler

        self._aot = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))

    def __call__(self, gm, example_inputs):
        self.graphs["dynamo"].append(gm)
        return self._aot(gm, example_inputs)

    def adapt_ops(self, kind: str) -> set[str]:
        return {_op_name(n.target) for g in self.graphs[kind] for n in g.graph.nodes if _op_name(n.target)}


def _op_name(target) -> str | None:
    """``rms_norm`` for ``torch.ops.adapt.rms_norm`` (packet or overload), else None."""
    name = getattr(target, "_qualified_op_name", None) or getattr(target, "name", lambda: "")()
    return name.split("::", 1)[1].split(".")[0] if isinstance(name, str) and name.startswith("adapt::") else None


def expected_ops(plan) -> tuple[set[str], set[str]]:
    forward, backward = set(), set()
    for choice in plan.components:
        if choice.patch and choice.provider == "adapt-triton":
            fw, bw = EXPECTED[choice.kernel.split(" ")[0]]
            forward |= fw
            backward |= bw
    return forward, backward


def takes_labels(model: nn.Module) -> bool:
    import inspect

    return "labels" in inspect.signature(type(model).forward).parameters and model.get_output_embeddings() is not None


def step(model: nn.Module, run, ids: torch.Tensor, labels: torch.Tensor | None, probe: dict[str, torch.Tensor]):
    """One training step of ``model`` called through ``run`` (itself or its compiled form): the loss and
    every parameter gradient.  Without labels the loss weights the
    model's output by a random ``probe`` (drawn on the first call, reused after), so no two output
    elements share a gradient."""
    model.zero_grad(set_to_none=True)
    if labels is not None:
        loss = run(input_ids=ids, labels=labels).loss
    else:
        out = run(input_ids=ids)
        hidden = out.logits if getattr(out, "logits", None) is not None else out[0]
        loss = (hidden * probe.setdefault("weights", torch.randn(hidden.shape))).sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.slow  # the interpreter makes each family 30-200 s on two busy cores; the export test is the quick guard
@pytest.mark.parametrize("family", ZOO_NAMES)
def test_compiled_patched_model_matches_eager_with_every_kernel_in_the_graph(zoo, family):
    from operators.kernels import ops

    model, plan = planned(str(zoo(family)), target=CPU)
    want_forward, want_backward = expected_ops(plan)
    training = model.training
    handle = apply_kernel_plan(model, plan)
    try:
        model.eval()  # no dropout: eager and compiled must draw nothing random (gradients flow all the same)
        vocab = getattr(model.config, "vocab_size", 256)
        ids = torch.randint(0, vocab, (2, 5))
        labels = torch.randint(0, vocab, (2, 5)) if takes_labels(model) else None
        probe: dict[str, torch.Tensor] = {}
        eager = step(model, model, ids, labels, probe)

        torch._dynamo.reset()
        backend = RecordingBackend()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        before = ops.CALLS.copy()
        got = step(model, compiled, ids, labels, probe)
        ran = {name for name, count in ops.CALLS.items() if count > before[name]}
    finally:
        handle.revert()
        model.train(training)
        torch._dynamo.reset()

    assert len(backend.graphs["dynamo"]) == 1
    assert want_forward <= backend.adapt_ops("dynamo"), "a kernel the plan installed is missing from Dynamo's graph"
    assert want_forward <= backend.adapt_ops("forward")
    assert want_backward <= backend.adapt_ops("backward")
    assert want_forward | want_backward <= ran, "the compiled step did not execute every kernel"
    if family not in ("bert", "custom"):  # the decoder families all get adapt kernels on CPU
        assert want_forward
    torch.testing.assert_close(got[0], eager[0], rtol=1e-5, atol=1e-6)
    assert set(eager[1]) <= set(got[1])
    for name in set(got[1]) - set(eager[1]):  # AOTAutograd sends zeros back through unused outputs (BERT's pooler)
        assert not got[1][name].any(), name
    for name, grad in eager[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_export_of_a_patched_llama_keeps_the_adapt_operators(zoo):
    model, plan = planned(str(zoo("llama")), target=CPU)
    want_forward, _ = expected_ops(plan)
    training = model.training
    ids = torch.randint(0, model.config.vocab_size, (1, 5))
    labels = torch.randint(0, model.config.vocab_size, (1, 5))
    model.eval()
    try:
        with torch.no_grad():
            reference = model(input_ids=ids).logits
        with apply_kernel_plan(model, plan):
            with torch.no_grad():
                eager_loss = model(input_ids=ids, labels=labels).loss
            program = torch.export.export(model, (), {"input_ids": ids, "labels": labels, "use_cache": False})
            exported = {_op_name(n.target) for n in program.graph.nodes} - {None}
            exported_loss = program.module()(input_ids=ids, labels=labels, use_cache=False).loss
    finally:
        model.train(training)
    assert {"rms_norm", "add_rms_norm", "glu_linear", "apply_rotary", "fused_linear_cross_entropy"} <= want_forward
    assert want_forward <= exported
    torch.testing.assert_close(exported_loss, eager_loss, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # the export left the model unpatched again
        assert torch.equal(model(input_ids=ids).logits, reference)
