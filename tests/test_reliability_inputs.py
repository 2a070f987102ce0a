"""Exact inputs: a repeated option, a size the data or memory cannot give, an id outside the vocabulary, a recipe
whose order cannot work: each refused up front, in one line, the same way streamed and in memory."""
import pytest
import torch
from click.testing import CliRunner

import zoo
import zoo.editing.stream
from cli_checks import fails
from tiny import tiny_native
from zoo.cli import cli
from zoo.components.options import parse_step

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::FutureWarning")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from zoo.data.tokenizer import load_tokenizer
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(vocab_size=8192, hidden_size=32, intermediate_size=48,
                                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                             num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64))
    folder = tmp_path_factory.mktemp("saved") / "m"
    zoo.convert(model.eval()).save_pretrained(folder)
    load_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("step, needle", [
    ("prune-reap:num_experts=6,num_experts=4", "'num_experts' is given twice"),
    ("prune-reap:num_experts=6, num_experts =6", "'num_experts' is given twice"),
    ('steer:disable={"1":[0],"1":[2]}', "key '1' is given twice"),
    ("prune-reap:=4", "no name before '='"),
])
def test_repeated_or_nameless_options_are_refused(step, needle, tmp_path):
    with pytest.raises(ValueError, match=needle):
        parse_step(step)
    fails(["apply", "zoo-tiny-moe", step, "--out", str(tmp_path / "o")], needle)
    assert not (tmp_path / "o").exists()


def test_calibration_larger_than_the_corpus_is_refused_at_once(tmp_path):
    import time

    start = time.perf_counter()
    fails(["apply", "zoo-tiny-moe", "prune-reap:num_experts=6", "--out", str(tmp_path / "o"),
           "--calibration", "code:2000000000"], "more than the code training text holds")
    assert time.perf_counter() - start < 30  # (it drew windows for minutes)
    with pytest.raises(ValueError, match="more than the mixed training text holds"):
        zoo.editing.calibration.corpus("mixed", tokens=10**12)
    with pytest.raises(ValueError, match="whole number"):
        zoo.editing.calibration.corpus("code", tokens=2.5)
    assert zoo.editing.calibration.corpus("code", tokens=4096)["tokens"] == 4096


def test_calibration_beyond_memory_is_refused_before_capture(monkeypatch):
    import zoo.io.memory as memory

    model = zoo.convert(tiny_native("mixtral"))
    monkeypatch.setattr(memory, "available_memory", lambda: 10_000)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="more than the .* of memory available"):
        zoo.apply(model, "prune-frequency", num_experts=3, calibration=[torch.randint(3, 128, (4, 64))])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_ids_outside_the_vocabulary_are_refused_with_its_size():
    from zoo.runtime.decode import greedy

    model = zoo.convert(tiny_native("mixtral")).eval()
    for ids in (torch.tensor([[3, 128]]), torch.tensor([[-1, 4]])):
        with pytest.raises(ValueError, match="vocabulary has 128 ids"):
            greedy(model, ids, 2, compile=False)
    with pytest.raises(ValueError, match="integer token ids"):
        greedy(model, torch.tensor([[3.0, 4.0]]), 2, compile=False)
    assert greedy(model, torch.tensor([[3, 127]]), 2, compile=False).shape == (1, 4)  # the prompt and 2 new


@pytest.mark.parametrize("steps, needle", [
    (["quantize:bits=8", "prune-reap:num_experts=3"], "layer 0 has 'quantized' experts; prune-reap needs dense"),
    (["prune-reap:num_experts=3", "prune-frequency:num_experts=4"], "num_experts=4 but layer 0 has only 3 experts"),
    (["moe-svd", "quantize:bits=8"], "layer 0 has 'factored' experts; quantize needs dense"),
])
def test_step_order_is_judged_the_same_streamed_and_in_memory(saved, tmp_path, steps, needle):
    for how in ("--stream", "--no-stream"):
        fails(["apply", str(saved), *steps, "--out", str(tmp_path / how), "--calibration", "code:256", how], needle)
        assert not (tmp_path / how).exists()


def test_a_working_order_still_streams(saved, tmp_path):
    res = CliRunner().invoke(cli, ["apply", str(saved), "prune-reap:num_experts=3", "quantize:bits=8",
                                   "--out", str(tmp_path / "o"), "--calibration", "code:256", "--stream"])
    assert res.exit_code == 0, res.output
    layout = zoo.load(tmp_path / "o").config.zoo_layout
    assert all(entry is None or (entry["num_experts"], entry["experts"]) == (3, "quantized") for entry in layout)


def test_consolidated_model_moved_to_another_dtype_says_why():
    from zoo.editing.consolidation import consolidate, unshare

    a, b = zoo.convert(tiny_native("mixtral")).eval(), zoo.convert(tiny_native("mixtral")).eval()
    with torch.no_grad():
        b.model.layers[0].mlp.experts.gate_up_proj[0] += 1
    consolidate([a, b], threshold=0.5, progress=False)
    b.to(torch.bfloat16)
    ids = torch.tensor([[3, 9, 27, 81]])
    with torch.no_grad(), pytest.raises(ValueError, match="moved to another dtype.*unshare"):
        a(input_ids=ids)
    b.to(torch.float32)
    unshare(b)
    b.to(torch.bfloat16)  # with its own experts, a model may take any dtype
    with torch.no_grad():
        a(input_ids=ids), b(input_ids=ids)
