"""A user's mistake on the command line is one clear line (click's ``Error: ...``, exit code != 0), never a
traceback, and it is caught before any work; the library functions refuse bad arguments with a ValueError."""
import json

import click
import pytest
import torch
from click.testing import CliRunner

import zoo
import zoo.evaluation.eval
import zoo.training.finetune
from zoo.cli import cli
from tiny import tiny_native


def fails(args, *needles, group=cli):
    """Run the command; it must exit non-zero through click (no other exception), say every needle, once."""
    res = CliRunner().invoke(group, args)
    assert res.exit_code != 0, res.output
    assert isinstance(res.exception, SystemExit), repr(res.exception)  # click's own exit, not a crash
    assert "Traceback" not in res.output
    assert res.output.count("Error:") == 1, res.output
    for needle in needles:
        assert needle in res.output, res.output
    return res.output


@pytest.fixture
def never(monkeypatch):
    """Make the expensive work raise, so a check that comes after it fails the test."""
    def patch(obj, name):
        def work(*args, **kwargs):
            raise AssertionError(f"{name} ran: the check must come before the work")
        monkeypatch.setattr(obj, name, work)
    return patch


@pytest.fixture
def afile(tmp_path):
    path = tmp_path / "afile"
    path.write_text("not a model\n")
    return str(path)


# ---- where the model is -----------------------------------------------------------------------------------
def test_missing_relative_folder_says_no_such_folder(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    out = fails(["eval", "./no/such/folder"], "no such folder", "./no/such/folder")
    assert "offline" not in out


def test_missing_absolute_folder_says_no_such_folder(tmp_path):
    out = fails(["convert", str(tmp_path / "gone"), str(tmp_path / "out")], "no such folder")
    assert "offline" not in out and not (tmp_path / "out").exists()


def test_missing_home_folder_says_no_such_folder():
    assert "offline" not in fails(["eval", "~/moe-zoo-no-such-model-folder"], "no such folder")


def test_folder_without_config_says_so(tmp_path):
    (tmp_path / "empty").mkdir()
    fails(["eval", str(tmp_path / "empty")], "no config.json in")


def test_file_given_as_model_says_it_is_a_file(afile):
    fails(["eval", afile], "is a file, not a model folder")


def test_two_part_name_that_is_no_folder_mentions_both(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    fails(["eval", "runs/typo"], "no local folder of that name", "offline")


def test_unknown_registry_name_keeps_its_quotes():
    fails(["convert", "name with spaces", "out"], "no model named 'name with spaces'")


def test_invalid_hub_id_is_not_reported_as_offline():
    out = fails(["convert", "org/name with spaces", "out"], "not a folder, a registry name or a hub id")
    assert "offline" not in out


def test_empty_model_name():
    fails(["eval", ""], "no model given")


# ---- where the result goes --------------------------------------------------------------------------------
def test_convert_into_an_existing_file_before_loading(afile, never):
    never(zoo, "load")
    fails(["convert", "zoo-tiny-moe", afile], "OUT", "is a file, not a folder")


def test_apply_into_an_existing_file_before_loading(afile, never):
    never(zoo, "load")
    fails(["apply", "zoo-tiny-moe", "quantize:bits=8", "--out", afile], "--out", "is a file, not a folder")


def test_finetune_into_an_existing_file_before_loading(afile, never):
    never(zoo, "load")
    fails(["finetune", "zoo-tiny-moe", "--adapter", "lora-experts", "--domain", "code", "--out", afile],
          "--out", "is a file, not a folder")


def test_eval_plot_into_a_missing_folder_before_evaluating(tmp_path, never):
    never(zoo, "load")
    fails(["eval", "zoo-tiny-moe", "--plot", str(tmp_path / "nodir" / "x.png")], "--plot", "no folder")


def test_library_save_error_becomes_one_line():
    """A ValueError subclass (zoo.io.atomic.SaveTargetError) or an OSError from a library call is one line."""
    from zoo.io.atomic import SaveTargetError
    from zoo.cli.helpers import one_line

    for exc in (SaveTargetError("cannot save into 'x': it is a file, not a folder"),
                PermissionError(13, "Permission denied", "/root/x"), KeyError("no component named 'x'")):
        with pytest.raises(click.ClickException) as info:
            with one_line():
                raise exc
        assert info.value.message in ("cannot save into 'x': it is a file, not a folder",
                                      "[Errno 13] Permission denied: '/root/x'", "no component named 'x'")


# ---- options ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("windows", ["0", "-3"])
def test_eval_windows_must_be_positive(windows):
    fails(["eval", "zoo-tiny-moe", "--windows", windows], "--windows")


@pytest.mark.parametrize("size", ["abc", "1.2.3GB", "4XB"])
def test_max_memory_must_be_a_size(size):
    fails(["convert", "zoo-tiny-moe", "out", "--max-memory", size], "--max-memory", "not a memory size")


def test_max_memory_must_be_positive():
    fails(["export", "zoo-tiny-moe", "out", "--max-memory", "0"], "--max-memory", "more than 0 bytes")


@pytest.mark.parametrize("spec", ["mixed:abc", "mixed:-5", "code:0"])
def test_calibration_tokens_must_be_positive(spec, tmp_path):
    fails(["apply", "zoo-tiny-moe", "quantize:bits=8", "--out", str(tmp_path / "o"), "--calibration", spec],
          "--calibration", "TOKENS")


def test_calibration_domain_must_exist(tmp_path):
    fails(["apply", "zoo-tiny-moe", "quantize:bits=8", "--out", str(tmp_path / "o"), "--calibration", "poetry"],
          "--calibration", "domain must be one of")


def test_apply_malformed_step(tmp_path):
    fails(["apply", "zoo-tiny-moe", "quantize:bits", "--out", str(tmp_path / "o")], "STEPS", "key=value")


def test_apply_missing_source(tmp_path):
    fails(["apply", str(tmp_path / "gone"), "quantize:bits=8", "--out", str(tmp_path / "o")], "no such folder")


FINETUNE = ["finetune", "zoo-tiny-moe", "--adapter", "lora-experts", "--domain", "code"]


@pytest.mark.parametrize("option,value", [("--steps", "0"), ("--batch-size", "-1"), ("--seq-len", "1"),
                                          ("--windows", "0"), ("--lr", "0"), ("--lr", "-1"), ("--seed", "-1"),
                                          ("--threads", "0"), ("--threads", "100000")])
def test_finetune_numbers_out_of_range(option, value, never):
    never(zoo, "load")
    fails(FINETUNE + [option, value], option)


def test_finetune_seq_len_beyond_the_model_positions(never, tmp_path):
    """zoo-tiny-moe has 1024 positions: refused right after loading, before perplexity or training."""
    never(zoo.training.finetune, "held_out")
    fails(FINETUNE + ["--seq-len", "100000", "--out", str(tmp_path / "o")], "100000", "max_position_embeddings")
    assert not (tmp_path / "o").exists()


def test_finetune_malformed_adapter():
    fails(["finetune", "zoo-tiny-moe", "--adapter", "lora-experts:r", "--domain", "code"], "--adapter", "key=value")


def test_finetune_missing_model_is_not_blamed_on_the_adapter(tmp_path):
    out = fails(FINETUNE[:1] + [str(tmp_path / "gone")] + FINETUNE[2:], "no such folder")
    assert "lora-experts:" not in out


@pytest.mark.parametrize("prompt", ["", "   "])
def test_generate_empty_prompt(prompt, never):
    never(zoo, "load")
    fails(["generate", "zoo-tiny-moe", prompt], "PROMPT", "empty")


def test_generate_zero_new_tokens(never):
    never(zoo, "load")
    fails(["generate", "zoo-tiny-moe", "hi", "--max-new-tokens", "0"], "--max-new-tokens")


def test_generate_more_tokens_than_positions():
    fails(["generate", "zoo-tiny-moe", "hi", "--no-compile", "--max-new-tokens", "100000000"],
          "max_new_tokens", "max_position_embeddings")


def test_generate_quantize_on_a_dense_model():
    fails(["generate", "zoo-tiny-dense", "hi", "--no-compile", "--max-new-tokens", "2", "--step", "quantize:bits=8"],
          "--step quantize", "not a supported MoE family")


def test_generate_threads_must_be_positive(never):
    never(zoo, "load")
    fails(["generate", "zoo-tiny-moe", "hi", "--threads", "-2"], "--threads")


@pytest.mark.parametrize("text,needle", [("[1, 2]", "JSON object"), ("{bad", "Expecting property name"),
                                         ('{"stepz": 3}', "unknown keys")])
def test_train_bad_config(text, needle, tmp_path, never):
    import zoo.training.train

    never(zoo.training.train, "train")
    config = tmp_path / "c.json"
    config.write_text(text)
    fails(["train", str(config)], str(config), needle)


def test_train_out_is_a_file(afile, tmp_path, never):
    import zoo.training.train

    never(zoo.training.train, "train")
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"out": afile}))
    fails(["train", str(config)], "'out' in", "is a file, not a folder")
    fails(["train", str(config), "--out", afile, "--steps", "5"], "--out", "is a file, not a folder")


def test_train_steps_must_be_positive(tmp_path):
    config = tmp_path / "c.json"
    config.write_text("{}")
    fails(["train", str(config), "--steps", "0"], "--steps")


# ---- the multimodal plugin's commands ---------------------------------------------------------------------
def test_digits_mm_train_out_is_a_file(afile, never):
    from zoo_multimodal import train_mm
    from zoo_multimodal.commands import digits_mm

    never(train_mm, "train")
    fails(["train", "--out", afile, "--steps", "1"], "--out", "is a file", group=digits_mm)


@pytest.mark.parametrize("option,value", [("--steps", "0"), ("--batch-size", "0"), ("--lr", "0"), ("--seed", "-1")])
def test_digits_mm_train_numbers_out_of_range(option, value, tmp_path):
    from zoo_multimodal.commands import digits_mm

    fails(["train", "--out", str(tmp_path / "o"), option, value], option, group=digits_mm)


def test_digits_mm_generate_out_is_a_file(afile, never):
    from zoo_multimodal import digits as data
    from zoo_multimodal.commands import digits_mm

    never(data, "main")
    fails(["generate", afile], "OUT", "is a file", group=digits_mm)


def test_digits_mm_eval_of_a_text_model(never):
    from zoo_multimodal import evaluate_mm
    from zoo_multimodal.commands import digits_mm

    never(evaluate_mm, "evaluate")
    fails(["eval", "zoo-tiny-moe"], "mixtral model", "zoo_mm", group=digits_mm)


def test_digits_mm_eval_json_into_a_missing_folder(tmp_path, never):
    from zoo_multimodal import evaluate_mm
    from zoo_multimodal.commands import digits_mm

    never(evaluate_mm, "evaluate")
    fails(["eval", "zoo-tiny-mm", "--json", str(tmp_path / "nodir" / "r.json")], "--json", "no folder",
          group=digits_mm)


# ---- the library functions check their arguments up front -----------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return zoo.convert(tiny_native("mixtral")).eval()


@pytest.mark.parametrize("kwargs,needle", [({"max_windows": 0}, "max_windows"), ({"seq_len": 1}, "seq_len"),
                                           ({"seq_len": 129}, "max_position_embeddings")])
def test_evaluate_refuses_bad_arguments(tiny, kwargs, needle, never):
    never(zoo.evaluation.eval, "perplexity_and_usage")
    with pytest.raises(ValueError, match=needle):
        zoo.evaluation.eval.evaluate(tiny, **kwargs)


@pytest.mark.parametrize("kwargs,needle", [({"steps": 0}, "steps"), ({"lr": float("nan")}, "lr"),
                                           ({"batch_size": 2.5}, "batch_size"), ({"seed": -1}, "seed"),
                                           ({"threads": 0}, "threads"), ({"windows": 0}, "windows"),
                                           ({"bf16": "yes"}, "bf16")])
def test_finetune_refuses_bad_arguments_before_loading(kwargs, needle, never):
    never(zoo, "load")
    with pytest.raises(ValueError, match=needle):
        zoo.training.finetune.finetune("zoo-tiny-moe", "lora-experts", **kwargs)


def test_finetune_refuses_seq_len_beyond_positions(tiny, never):
    never(zoo.training.finetune, "held_out")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        zoo.training.finetune.finetune(tiny, "lora-experts", seq_len=129)


@pytest.mark.parametrize("ids,new,needle", [(torch.zeros(1, 0, dtype=torch.long), 4, "at least one token"),
                                            (torch.tensor([[1, 2]]), 0, "max_new_tokens"),
                                            (torch.tensor([[1, 2]]), 127, "max_position_embeddings")])
def test_decode_refuses_bad_arguments(tiny, ids, new, needle):
    from zoo.runtime.decode import generate, greedy

    for decode in (greedy, generate):
        with pytest.raises(ValueError, match=needle):
            decode(tiny, ids, new, compile=False)
