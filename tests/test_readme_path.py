"""The README's path, walked as a user would from the command line, on a tiny random Mixtral that has its own
32000-token tokenizer: convert, apply two steps, eval, finetune a few steps, eval the adapter, merge, export,
generate. Every handoff keeps the tokenizer, and every output is a model the next command takes."""
import json

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

import zoo
from zoo.cli import cli
from tiny import COMMON
from test_user_path_tokenizer import own_tokenizer

VOCAB = 32000


def ok(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, f"moe-zoo {' '.join(map(str, args))}:\n{result.output}"
    return result.output


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme-path") / "mixtral-32k"
    tok = own_tokenizer(VOCAB, chars=1_500_000)  # a byte-level BPE of 32000 tokens, trained here on the corpus
    assert len(tok) == VOCAB
    torch.manual_seed(0)
    config = MixtralConfig(**{**COMMON, "vocab_size": VOCAB, "max_position_embeddings": 512, "pad_token_id": 1,
                              "bos_token_id": 0, "eos_token_id": 0},
                           intermediate_size=96, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
    MixtralForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def perplexities(output: str) -> dict:
    """``ppl <domain>`` rows of eval's table."""
    return {line.split()[1]: float(line.split()[-1]) for line in output.splitlines() if line.startswith("ppl ")}


def test_the_readme_path(src):
    root = src.parent
    tokenizer_bytes = (src / "tokenizer.json").read_bytes()

    ok("convert", src, root / "zoo")
    assert json.loads((root / "zoo" / "config.json").read_text())["model_type"] == "zoo_mixtral"

    ok("apply", root / "zoo", "prune-reap:num_experts=3", "topk-softmax:top_k=1", "--out", root / "applied",
       "--calibration", "mixed:1024")
    config = json.loads((root / "applied" / "config.json").read_text())
    assert [step["name"] for step in config["zoo_recipe"]] == ["prune-reap", "topk-softmax"]
    calibration = config["zoo_recipe"][0]["calibration"]
    assert calibration["domain"] == "mixed" and calibration["tokens"] == 1024
    for folder in ("zoo", "applied"):
        assert (root / folder / "tokenizer.json").read_bytes() == tokenizer_bytes, folder

    before = perplexities(ok("eval", root / "applied", "--windows", 2, "--no-speed"))
    assert set(before) == {"english", "code"} and all(v > 1000 for v in before.values())  # random, 32k vocabulary

    trained = ok("finetune", root / "applied", "--adapter", "lora-experts:r=4", "--domain", "code", "--steps", 3,
                 "--batch-size", 2, "--seq-len", 64, "--windows", 2, "--out", root / "adapter")
    assert "windows of 64 tokens" in trained and "saved to" in trained
    adapter = root / "adapter"
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(root / "applied")  # absolute: loads from anywhere
    assert (adapter / "tokenizer.json").read_bytes() == tokenizer_bytes
    card = (adapter / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: peft") and "# adapter" in card and "zoo.load(" in card
    assert "base_model:" not in card  # a local base: no Hub id to name

    after = perplexities(ok("eval", adapter, "--windows", 2, "--no-speed"))
    assert set(after) == set(before) and after != before  # the adapter is on: other numbers

    ok("merge", adapter, root / "merged")
    merged = zoo.load(root / "merged")
    peft = zoo.load(adapter)
    ids = torch.randint(2, VOCAB, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, peft(ids).logits, atol=1e-4, rtol=1e-4)

    ok("export", root / "merged", root / "native")
    native = json.loads((root / "native" / "config.json").read_text())
    assert native["model_type"] == "mixtral" and native["num_local_experts"] == 3
    assert native["num_experts_per_tok"] == 1
    plain = AutoModelForCausalLM.from_pretrained(root / "native")
    with torch.no_grad():
        torch.testing.assert_close(plain(ids).logits, merged(ids).logits, atol=1e-4, rtol=1e-4)
    assert (root / "native" / "tokenizer.json").read_bytes() == tokenizer_bytes

    for model in (root / "native", adapter):
        text = ok("generate", model, "def main(", "--max-new-tokens", 4, "--no-compile")
        assert text.strip(), model
