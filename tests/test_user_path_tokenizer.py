"""The user's path keeps the model's own tokenizer: convert, apply (in memory and streamed) and export save it
beside the weights, generate and eval use it, and a tokenizer that does not fit the model is refused."""
import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import MixtralConfig, PreTrainedTokenizerFast

import zoo
from zoo.cli import cli
from zoo.data.corpus import load_text
from zoo.io.loading import ZOO_VOCAB, TokenizerMismatch, check_tokenizer, source_folder, tokenizer_for
from tiny import COMMON

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def own_tokenizer(vocab_size=512, chars=200_000):
    """A byte-level BPE of ``vocab_size`` tokens trained here on the first ``chars`` characters of each domain's
    train split (not the zoo's 8192)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([load_text("english", "train")[:chars], load_text("code", "train")[:chars]],
                            trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", pad_token="<pad>", bos_token="<eos>")
    tok.chat_template = TEMPLATE
    return tok


def tiny_mixtral(vocab_size, seed=0):
    import torch
    from transformers import MixtralForCausalLM

    torch.manual_seed(seed)
    config = MixtralConfig(**{**COMMON, "vocab_size": vocab_size, "max_position_embeddings": 512,
                              "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 0},
                           intermediate_size=96, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
    return MixtralForCausalLM(config).eval()


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("user-path")
    tok = own_tokenizer()
    src = root / "src"
    tiny_mixtral(len(tok)).save_pretrained(src)
    tok.save_pretrained(src)
    return {"root": root, "src": src, "vocab": len(tok)}


def invoke(*args):
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.output


def ok(*args):
    code, output = invoke(*args)
    assert code == 0, output
    return output


def fails(*args):
    code, output = invoke(*args)
    assert code != 0 and "Traceback" not in output, output
    return output


def has_tokenizer(folder, src):
    missing = [f for f in TOKENIZER_FILES if not (folder / f).is_file()]
    assert not missing, f"{folder} lacks {missing}"
    assert (folder / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("how", ["--no-stream", "--stream"])
def test_convert_and_apply_keep_the_tokenizer_and_generate_runs_on_the_result(paths, how, one_thread):
    root = paths["root"]
    converted, applied = root / f"converted{how}", root / f"applied{how}"
    ok("convert", paths["src"], converted, how)
    has_tokenizer(converted, paths["src"])
    applied.mkdir()
    (applied / "notes.txt").write_text("mine")  # a save never deletes what it did not write
    ok("apply", converted, "prune-reap:num_experts=3", "--out", applied, how)
    has_tokenizer(applied, paths["src"])
    assert (applied / "notes.txt").read_text() == "mine"
    step = json.loads((applied / "config.json").read_text())["zoo_recipe"][-1]
    cal = step["calibration"]
    assert cal is not None and cal["type"] == "corpus" and cal["default"] is True
    assert {k: cal[k] for k in ("domain", "tokens", "seq_len", "seed")} == zoo.editing.calibration.default()
    assert cal["source"] and cal["tokens_used"] == 8192
    out = ok("generate", applied, "def main", "--no-compile", "--max-new-tokens", "2")
    assert out.strip()


def test_streamed_and_in_memory_record_the_same_calibration(paths):
    root = paths["root"]
    for how in ("--no-stream", "--stream"):
        if not (root / f"applied{how}").exists():
            pytest.skip("needs the apply test first")
    recipes = [json.loads((root / f"applied{how}" / "config.json").read_text())["zoo_recipe"]
               for how in ("--no-stream", "--stream")]
    assert recipes[0] == recipes[1]


def test_export_keeps_the_tokenizer(paths, tmp_path, one_thread):
    ok("export", paths["src"], tmp_path / "native", "--no-stream")
    has_tokenizer(tmp_path / "native", paths["src"])
    ok("export", paths["src"], tmp_path / "streamed", "--stream")
    has_tokenizer(tmp_path / "streamed", paths["src"])


def test_eval_uses_the_models_own_tokenizer(paths, one_thread):
    out = ok("eval", paths["src"], "--no-speed", "--windows", "1", "--json")
    assert json.loads(out)["perplexity"]["english"] < 4 * paths["vocab"]


def test_eval_refuses_a_tokenizer_that_does_not_fit_naming_both_sizes(paths, tmp_path, one_thread):
    from zoo.data.tokenizer import load_tokenizer

    wrong = tmp_path / "wrong"
    shutil.copytree(paths["src"], wrong)
    for name in os.listdir(wrong):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            os.remove(wrong / name)
    load_tokenizer().save_pretrained(wrong)  # the zoo's 8192 tokens beside a 512-token model
    for how in ("--no-stream", "--stream"):
        out = fails("eval", wrong, "--no-speed", "--windows", "1", how)
        assert str(ZOO_VOCAB) in out and str(paths["vocab"]) in out
    out = fails("generate", wrong, "hello", "--no-compile", "--max-new-tokens", "2")
    assert str(ZOO_VOCAB) in out and str(paths["vocab"]) in out


def test_a_model_without_a_tokenizer_is_refused_in_one_line_unless_its_vocabulary_is_the_zoos(tmp_path, one_thread):
    bare = tmp_path / "bare"
    tiny_mixtral(20_000).save_pretrained(bare)  # a larger vocabulary than the zoo's, no tokenizer beside it
    out = fails("eval", bare, "--no-speed", "--windows", "1")
    assert "no tokenizer found" in out and "20000" in out and "save" in out and len(out.strip().splitlines()) == 1
    model = zoo.load(bare)
    with pytest.raises(TokenizerMismatch, match="no tokenizer found"):
        tokenizer_for(model, required=True)
    missing = tokenizer_for(model)  # raises when used: token-id calibration batches need no tokenizer
    for use in (lambda: missing("some text"), lambda: missing.encode("x"), lambda: len(missing)):
        with pytest.raises(TokenizerMismatch, match="no tokenizer found.*20000.*save"):
            use()
    ids = torch.randint(3, 20_000, (2, 16), generator=torch.Generator().manual_seed(0))
    assert zoo.editing.calibration.batches([ids], missing)[0].equal(ids)
    with pytest.raises(TokenizerMismatch, match="no tokenizer found"):
        zoo.editing.calibration.batches(zoo.editing.calibration.corpus("code", tokens=256), missing)
    zoo_sized = tmp_path / "zoo-sized"
    tiny_mixtral(ZOO_VOCAB).save_pretrained(zoo_sized)
    assert len(tokenizer_for(zoo.load(zoo_sized))) == ZOO_VOCAB  # the zoo's own stands in


def test_check_tokenizer_accepts_a_padded_vocabulary_and_refuses_a_quarter_of_one():
    tok = own_tokenizer(300)
    size = len(tok)
    check_tokenizer(tok, tiny_mixtral(size + 64))  # models pad their vocabulary a little
    for vocab in (size - 1, 4 * size):
        with pytest.raises(TokenizerMismatch, match=f"{size} tokens but the model's vocabulary has {vocab}"):
            check_tokenizer(tok, tiny_mixtral(vocab))


def test_source_folder_finds_a_registry_models_shipped_folder(tmp_path):
    assert os.path.isfile(os.path.join(source_folder("zoo-tiny-moe"), "tokenizer.json"))
    assert source_folder(str(tmp_path / "nowhere")) is None and source_folder("") is None


def test_a_component_that_does_not_calibrate_records_no_calibration(paths, tmp_path, one_thread):
    ok("apply", paths["src"], "quantize:bits=8,group_size=32", "--out", tmp_path / "q", "--no-stream")
    assert json.loads((tmp_path / "q" / "config.json").read_text())["zoo_recipe"][-1]["calibration"] is None
    has_tokenizer(tmp_path / "q", paths["src"])


def test_a_hub_id_in_the_local_cache_gives_its_tokenizer_files(paths, tmp_path, monkeypatch):
    """A cached hub snapshot (files are links to blobs) lends its side files; an uncached id lends none."""
    from huggingface_hub import constants

    from zoo.io.loading import copy_side_files

    cache = tmp_path / "hub"
    repo = cache / "models--someone--tiny-mixtral"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "blobs").mkdir()
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in os.listdir(paths["src"]):
        shutil.copyfile(paths["src"] / name, repo / "blobs" / name)
        os.symlink(os.path.relpath(repo / "blobs" / name, snapshot), snapshot / name)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    assert os.path.samefile(source_folder("someone/tiny-mixtral"), snapshot)
    dest = tmp_path / "dest"
    dest.mkdir()
    copied = copy_side_files("someone/tiny-mixtral", dest)
    assert set(TOKENIZER_FILES) <= set(copied)
    assert not (dest / "tokenizer.json").is_symlink()
    assert (dest / "tokenizer.json").read_bytes() == (paths["src"] / "tokenizer.json").read_bytes()
    assert source_folder("someone/not-cached") is None and copy_side_files("someone/not-cached", dest) == []


def test_upcycle_hidden_gate_tokenizes_the_corpus_with_the_dense_models_own_tokenizer(tmp_path, one_thread):
    from transformers import MistralConfig, MistralForCausalLM

    tok = own_tokenizer()
    torch.manual_seed(0)
    config = MistralConfig(**{**COMMON, "vocab_size": len(tok), "max_position_embeddings": 512},
                           intermediate_size=96, num_hidden_layers=2)
    MistralForCausalLM(config).save_pretrained(tmp_path / "dense")
    tok.save_pretrained(tmp_path / "dense")
    dense = MistralForCausalLM.from_pretrained(tmp_path / "dense")
    moe = zoo.apply(dense, "upcycle", num_experts=4, top_k=2, gate="hidden")
    assert "zoo corpus" in moe.config.zoo_recipe[-1]["results"]["router_prompts"]
    shutil.rmtree(tmp_path / "dense")  # no tokenizer now, and a vocabulary that is not the zoo's: one clear error
    MistralForCausalLM(config).save_pretrained(tmp_path / "dense")
    bare = MistralForCausalLM.from_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match="no tokenizer found"):
        zoo.apply(bare, "upcycle", num_experts=4, top_k=2, gate="hidden")
