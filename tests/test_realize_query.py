"""The decode steps' post-grad pass: a one-row bmm's left input realised once, not inlined into the reduction."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch._inductor.utils import run_and_get_code

from zoo.runtime.realize_query import RealizeOneRowBmmInputs


def rotated_scores(q, k, position):
    """A one-query attention's scores as a decode step computes them: the query rotated by cos/sin of its position."""
    angle = position * torch.arange(q.shape[-1], dtype=q.dtype)
    return torch.bmm(q * angle.cos() + q.flip(-1) * angle.sin(), k)


def marked(q_rows: int) -> list[str]:
    graph = make_fx(rotated_scores, tracing_mode="fake")(torch.randn(4, q_rows, 16), torch.randn(4, 16, 32),
                                                         torch.tensor(3.0)).graph
    RealizeOneRowBmmInputs()(graph)
    return [n.name for n in graph.nodes if n.meta.get("inductor_realize_to_strides")]


def test_marks_only_the_left_input_of_a_one_row_bmm():
    graph = make_fx(rotated_scores, tracing_mode="fake")(torch.randn(4, 1, 16), torch.randn(4, 16, 32),
                                                         torch.tensor(3.0)).graph
    RealizeOneRowBmmInputs()(graph)
    bmm = next(n for n in graph.nodes if n.target is torch.ops.aten.bmm.default)
    assert [n for n in graph.nodes if n.meta.get("inductor_realize_to_strides")] == [bmm.args[0]]


@pytest.mark.parametrize("rows", [2, 5])
def test_bmms_of_several_rows_are_left_alone(rows):
    assert marked(rows) == []


def test_the_uuid_is_stable_and_names_this_pass():
    assert RealizeOneRowBmmInputs().uuid() == RealizeOneRowBmmInputs().uuid()
    assert isinstance(RealizeOneRowBmmInputs().uuid(), bytes)


def test_compile_configs_carrying_it_are_equal_so_transformers_keeps_its_compiled_call():
    """transformers compiles the model's call anew when the config differs from the last one (a dataclass: its
    options dict compared by value), so two instances of the pass must be equal."""
    from zoo.runtime.decode import compile_config

    assert RealizeOneRowBmmInputs() == RealizeOneRowBmmInputs() and RealizeOneRowBmmInputs() != object()
    assert len({RealizeOneRowBmmInputs(), RealizeOneRowBmmInputs()}) == 1
    assert compile_config() == compile_config()
    assert compile_config() != compile_config(cpp_wrapper=False)


def compiled(with_pass: bool):
    options = {"post_grad_custom_post_pass": RealizeOneRowBmmInputs()} if with_pass else {}
    torch._dynamo.reset()
    return torch.compile(rotated_scores, backend="inductor", options=options, fullgraph=True)


def cos_inside_the_key_loop(code: str) -> bool:
    """Whether the generated kernel computes a cos inside its loop over the 256 key positions."""
    lines = code[code.index('extern "C"'):].splitlines()
    key_loop = next(i for i, line in enumerate(lines) if "for(" in line and "256L" in line)
    return any("cos(" in line for line in lines[key_loop:])  # std::cos(v) or v.cos(), not a kernel name


def test_compiled_with_the_pass_the_rotated_row_is_computed_before_the_reduction_and_the_scores_are_the_same():
    q, k, position = torch.randn(4, 1, 16), torch.randn(4, 16, 256), torch.tensor(7.0)
    reference = rotated_scores(q, k, position)
    inside = {}
    for with_pass in (False, True):
        out, code = run_and_get_code(compiled(with_pass), q, k, position)
        torch.testing.assert_close(out, reference)
        inside[with_pass] = cos_inside_the_key_loop("\n".join(code))
    # without the pass inductor inlines the row's cos into the sum over key positions (the cost this pass removes)
    assert inside == {False: True, True: False}
