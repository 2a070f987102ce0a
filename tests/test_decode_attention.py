"""zoo.runtime.attention: compiled decode steps attend their one query with the family's eager attention (SDPA for
more queries), and the model's own setting comes back afterwards."""
import sys

import pytest
import torch
from tiny import tiny_native

import zoo
from zoo.runtime import attention
from zoo.runtime.decode import generate, greedy


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _attention_inputs(q_len, seed=0):
    """Mixtral-shaped attention inputs: 4 query heads over 2 key/value heads, head size 8, 6 positions."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(1, 4, q_len, 8, generator=g)
    key, value = torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    mask = torch.zeros(1, 1, q_len, 6)
    mask[..., 4:] = torch.finfo(torch.float32).min  # the last positions not yet written
    return query, key, value, mask


@pytest.mark.parametrize("q_len", [1, 3])
def test_one_query_takes_the_familys_eager_attention_and_more_take_sdpa(q_len, monkeypatch):
    model = tiny_native("mixtral")
    layer = model.model.layers[0].self_attn
    family = sys.modules[type(layer).__module__]
    called, real = [], family.eager_attention_forward
    monkeypatch.setattr(family, "eager_attention_forward", lambda *a, **k: called.append(1) or real(*a, **k))
    query, key, value, mask = _attention_inputs(q_len)
    out, _ = attention.decode_attention(layer, query, key, value, mask, scaling=8 ** -0.5, dropout=0.0)
    sdpa, _ = attention.ALL_ATTENTION_FUNCTIONS["sdpa"](layer, query, key, value, mask, scaling=8 ** -0.5,
                                                          dropout=0.0)
    assert len(called) == (1 if q_len == 1 else 0)
    assert out.shape == (1, q_len, 4, 8)
    torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-6)


def test_a_family_without_its_own_eager_attention_keeps_sdpa(monkeypatch):
    model = tiny_native("mixtral")
    layer = model.model.layers[0].self_attn
    monkeypatch.delattr(sys.modules[type(layer).__module__], "eager_attention_forward")
    query, key, value, mask = _attention_inputs(1)
    out, _ = attention.decode_attention(layer, query, key, value, mask, scaling=8 ** -0.5, dropout=0.0)
    sdpa, _ = attention.ALL_ATTENTION_FUNCTIONS["sdpa"](layer, query, key, value, mask, scaling=8 ** -0.5,
                                                          dropout=0.0)
    assert torch.equal(out, sdpa)


@pytest.mark.parametrize("decode", ["generate", "jit greedy"])
def test_compiled_steps_use_it_and_the_models_setting_comes_back(decode, monkeypatch):
    """The compiled step's one query goes through decode_attention (seen while dynamo traces it), the tokens are the
    eager model's, and the model is on SDPA again afterwards, also after a call that failed inside (generate)."""
    model = zoo.convert(tiny_native("mixtral"))
    ids = torch.tensor([[1, 17, 33, 5]])
    assert model.config._attn_implementation == "sdpa"
    want = generate(model, ids, max_new_tokens=6, min_new_tokens=6, compile=False)

    def run():
        if decode == "generate":
            return generate(model, ids, max_new_tokens=6, min_new_tokens=6, compile=True, backend="eager")
        return greedy(model, ids, 6, compile=True, backend="eager", ahead_of_time=False)

    queries = []

    def spy(module, query, *args, **kwargs):
        queries.append(query.shape[2])
        return attention.decode_attention(module, query, *args, **kwargs)

    monkeypatch.setitem(attention.ALL_ATTENTION_FUNCTIONS, attention.register(), spy)
    assert torch.equal(run(), want) and 1 in queries
    assert model.config._attn_implementation == "sdpa"

    if decode != "generate":  # (one failing call is enough: both go through the same context)
        return

    def broken(module, query, *a, **k):
        raise RuntimeError("attention failed")

    torch._dynamo.reset()
    monkeypatch.setitem(attention.ALL_ATTENTION_FUNCTIONS, attention.DECODE_ATTENTION, broken)
    with pytest.raises(Exception, match="attention failed"):
        run()
    assert model.config._attn_implementation == "sdpa"
