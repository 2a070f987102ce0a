"""Key/value caches at lower precision (zoo.runtime.kv_cache) against naive references and the full-precision loop."""
import math

import pytest
import torch
from click.testing import CliRunner

import zoo
from zoo.runtime.kv_cache import dequantize_tokens, kv_cache, kv_perplexity, quantize_tokens


@pytest.fixture(scope="module")
def tiny():
    return zoo.load("zoo-tiny-moe").eval(), zoo.load_tokenizer("zoo-tiny-moe")


@pytest.fixture(scope="module")
def windows(tiny):
    from zoo.data.tokens import eval_windows, token_stream

    return eval_windows(token_stream("english", "val", tiny[1]), 128)[:2]


@pytest.mark.parametrize("bits", [8, 4])
def test_token_codes_match_a_naive_per_group_quantizer(bits):
    x = torch.randn(2, 3, 5, 32, generator=torch.Generator().manual_seed(bits)) * 4
    codes, scale, low = quantize_tokens(x, bits, 8)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == 32 * bits // 8 and scale.shape[-1] == 4
    back = dequantize_tokens(codes, scale, low, bits, 8, torch.float32)
    levels = 2 ** bits - 1
    for idx in range(x[..., 0].numel()):  # every token, group by group, by hand
        row = x.reshape(-1, 32)[idx]
        for g in range(4):
            part = row[g * 8:(g + 1) * 8]
            lo, hi = part.min().half().float(), part.max()
            step = ((hi - part.min()) / levels).clamp(min=1e-8).half().float()
            q = ((part - lo) / step).round().clamp(0, levels)
            assert torch.allclose(back.reshape(-1, 32)[idx, g * 8:(g + 1) * 8], q * step + lo, atol=1e-5)
    assert (back - x).abs().max() <= scale.float().max() / 2 + 1e-2


def test_the_full_precision_loop_is_the_one_pass_perplexity(tiny, windows):
    model, _ = tiny
    ppl, size = kv_perplexity(model, windows, "full", chunk=24)
    with torch.no_grad():
        one_pass = math.exp(sum(model(input_ids=w[None], labels=w[None]).loss.item() for w in windows) / len(windows))
    assert ppl == pytest.approx(one_pass, rel=2e-3)  # batch shapes differ: a near-tie route may flip
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    width = next(model.parameters()).element_size()
    assert size == 2 * cfg.num_hidden_layers * 128 * cfg.num_key_value_heads * head_dim * width  # keys + values


def test_lower_precision_costs_little_quality_and_saves_bytes(tiny, windows):
    model, _ = tiny
    full, full_bytes = kv_perplexity(model, windows, "full")
    runs = {p: kv_perplexity(model, windows, p) for p in ("fp8", "int8", "int4")}
    assert abs(runs["int8"][0] / full - 1) < 0.005 and abs(runs["int4"][0] / full - 1) < 0.03
    assert runs["int4"][0] != full  # the cache is really read back from its codes
    assert runs["int4"][1] < runs["int8"][1] < full_bytes and runs["fp8"][1] <= full_bytes / 2 + 64  # bf16 model: fp8 halves it


def test_greedy_with_a_cache_decodes_like_the_eager_loop(tiny):
    model, tok = tiny
    ids = tok("def add(a, b):", return_tensors="pt").input_ids
    eager = zoo.decode.greedy(model, ids, 12, compile=False)
    assert torch.equal(zoo.decode.greedy(model, ids, 12, kv_cache="full"), eager)
    assert zoo.decode.greedy(model, ids, 12, kv_cache="int8").shape == eager.shape
    made = model.generate(ids, max_new_tokens=12, do_sample=False, cache=kv_cache(model, "int8"))
    assert made.shape == eager.shape


def test_bad_precisions_and_layouts_are_refused_in_one_line(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="did you mean 'int4'"):
        kv_cache(model, "int44")
    from tiny import tiny_native

    gpt_oss = zoo.convert(tiny_native("gpt_oss"))  # sliding-window layers keep only a window: no place for codes
    with pytest.raises(ValueError, match="full attention in every layer"):
        kv_cache(gpt_oss, "int8")
    from zoo.cli import cli

    res = CliRunner().invoke(cli, ["eval", "zoo-tiny-moe", "--kv-cache", "int8", "--stream"])
    assert res.exit_code != 0 and "--kv-cache measures the model in memory" in res.output


def test_eval_reports_the_cache_beside_full_precision(tiny):
    from zoo.cli import cli

    res = CliRunner().invoke(cli, ["eval", "zoo-tiny-moe", "--windows", "1", "--no-speed", "--kv-cache", "int4"])
    assert res.exit_code == 0, res.output
    lines = [line for line in res.output.splitlines() if line.startswith("kv cache int4")]
    assert len(lines) == 2 and all("at full precision" in line for line in lines)
