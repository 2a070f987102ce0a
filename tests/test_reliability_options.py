"""Every option of every applicable component, given each kind of bad value: the step either succeeds or fails
with a clear error (a ValueError/TypeError naming the option or the component, or a MemoryError saying so),
and a failure leaves the model bit-identical. Nothing else (no IndexError, no allocator traceback)."""
import copy

import pytest
import torch

import zoo
from zoo.components.options import accepted_options
from zoo.components.registry import registry
from zoo.components.plugins import load_plugins
from tiny import tiny_native

pytestmark = pytest.mark.usefixtures("one_thread")
CAL = [torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(0))]
BAD = [None, -1, 0, 10**9, 2.5, float("nan"), float("inf"), "x", "", [], {}, True]
# multimodal components need the multimodal model; their options are covered in test_multimodal
ELSEWHERE = {"prune-group", "language-conditioned", "hierarchical-modality"}


def components():
    load_plugins()
    for reg in registry.all():
        if reg.kind in ("router", "compressor", "adapter") and reg.name not in ELSEWHERE:
            skip = ("hidden_size", "num_experts", "layer", "base") if reg.kind == "router" else ()
            yield reg.name, accepted_options(reg.obj, skip=skip)


@pytest.fixture(scope="module")
def base():
    return zoo.convert(tiny_native("mixtral"))


def fingerprint(model):
    return type(model).__name__, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name, options", list(components()), ids=lambda v: v if isinstance(v, str) else "")
def test_bad_values_fail_clearly_and_change_nothing(base, name, options):
    outcomes = {}
    for option in options:
        for bad in BAD:
            model = copy.deepcopy(base)
            before = fingerprint(model)
            try:
                zoo.apply(model, name, calibration=CAL, **{option: bad})
                outcomes[option, repr(bad)] = "applied"
                continue
            except (ValueError, TypeError, MemoryError) as exc:
                message = str(exc)
                assert option in message or name in message, f"{name} {option}={bad!r}: vague error {message!r}"
            after = fingerprint(model)
            assert after[0] == before[0] and all(torch.equal(after[1][k], before[1][k]) for k in before[1]), \
                f"{name} {option}={bad!r} failed but changed the model"
            outcomes[option, repr(bad)] = "refused"
    for (option, bad), outcome in outcomes.items():  # never accepted: values that cannot mean anything
        if bad in ("nan", "inf", "[]", "{}"):
            assert outcome == "refused" or option in ("disable", "force"), (name, option, bad)
