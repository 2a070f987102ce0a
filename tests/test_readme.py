"""Every code block of README.md works as written: Python blocks run in a fresh process (the push against the
local test Hub), each ``moe-zoo`` line names a real command with real options, each ``make`` line a real target,
and the plugin entry point is the group the zoo reads."""
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import click
import pytest

from test_hub import hub  # noqa: F401  (the local test Hub, started per test)
from zoo.cli import cli

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall((ROOT / "README.md").read_text()) if lang == language]


def test_the_readme_has_the_blocks_this_file_checks():
    languages = [lang for lang, _ in BLOCK.findall((ROOT / "README.md").read_text())]
    assert set(languages) <= {"", "python", "toml"}, languages  # a new language needs a check here
    assert blocks("python") and blocks("toml") and blocks("")


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_block_runs_as_written(index, hub, tmp_path):
    import os

    code = blocks("python")[index]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_TOKEN="hf_readme_test_token",
               HF_HUB_DISABLE_TELEMETRY="1", GRADIO_ANALYTICS_ENABLED="False", TQDM_DISABLE="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"README block {index}:\n{code}\n{proc.stderr[-4000:]}"
    out = tmp_path / "out"
    if "push_to_hub" in code:
        assert (out / "native" / "config.json").is_file() and (out / "m" / "tokenizer.json").is_file()
        assert (out / "m" / "README.md").read_text().count("# m\n") == 1  # the card is titled by the folder
        assert any(r["path"].startswith("/api/repos/create") for r in hub.requests())
    if "finetune" in code:
        assert (out / "adapter" / "adapter_config.json").is_file() and (out / "merged" / "config.json").is_file()


def command_lines() -> list[str]:
    """Lines of the plain blocks that start with ``moe-zoo``."""
    return [line.split("  ")[0].strip() for body in blocks("") for line in body.splitlines()
            if line.startswith("moe-zoo ")]


def test_every_moe_zoo_line_names_a_real_command_and_real_options():
    from zoo.components.plugins import commands_hook

    commands_hook(cli)  # the plugins' commands (digits-mm), as `moe-zoo` adds them; a second call adds nothing
    lines = command_lines()
    assert len(lines) >= 15, lines
    for line in lines:
        words = shlex.split(line.replace("[", " ").replace("]", " ").replace("|", " "))[1:]
        command, ctx = cli, click.Context(cli)
        while isinstance(command, click.Group) and words and words[0] in command.list_commands(ctx):
            command = command.get_command(ctx, words.pop(0))
        assert command is not cli, f"README: {line!r} names no moe-zoo command"
        known = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
        for word in words:
            flag = word.split("=")[0].split("/")[0]
            if flag.startswith("--"):
                assert flag in known, f"README: {line!r}: {command.name} has no option {flag}"


def test_every_make_line_names_a_target():
    targets = set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    for body in blocks(""):
        for line in body.splitlines():
            if line.startswith("make "):
                assert line.split()[1] in targets, line


def test_the_entry_point_block_is_the_group_the_zoo_reads():
    from zoo.components.plugins import pm

    (block,) = blocks("toml")
    assert list(tomllib.loads(block)["project"]["entry-points"]) == [pm.project_name]  # the entry-point group
