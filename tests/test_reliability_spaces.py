"""The public Spaces' limits: every input is cut or refused before any work (tokenising, loading, training)
starts, uploads are capped, and ``moe-zoo demo NAME`` takes only Space names, never paths."""
import os
import sys
import urllib.error
import urllib.request
import uuid

import gradio as gr
import numpy as np
import pytest

from zoo.components.resources import resource_path
from zoo.demos.spaces import (MAX_AUDIO_SECONDS, MAX_OPTIONS_CHARS, MAX_PROMPT_CHARS, UnknownSpace, launch, load_app,
                        space_dir)

from test_spaces import default_model, free_port  # noqa: F401  (shared fixture and helper)

HUGE = "To be, or not to be. " * 400_000  # 8.4 MB of text


def never(*args, **kwargs):
    raise AssertionError("the work started although the input is over its limit")


class SpyTokenizer:
    """The real tokenizer, recording the length of every text it is asked to tokenise."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.tok(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tok, name)


# ---- router-explorer ----------------------------------------------------------------------------------

def test_explorer_cuts_huge_text_before_tokenising(default_model, monkeypatch):  # noqa: F811
    app = load_app("router-explorer")
    app.build_demo()  # the router controls
    model, tok = app.base()
    spy = SpyTokenizer(tok)
    monkeypatch.setattr(app, "base", lambda: (model, spy))
    labels, grids, ppl = app.route(HUGE, "topk-softmax", {"top_k": 2})
    assert spy.lengths and max(spy.lengths) <= MAX_PROMPT_CHARS < len(HUGE)
    assert len(labels) == app.MAX_TOKENS and all(g.shape[0] == app.MAX_TOKENS for g in grids.values())


def test_explorer_refuses_huge_options_before_loading():
    app = load_app("router-explorer")
    app.build_demo()
    app.base = never
    with pytest.raises(gr.Error, match="topk-softmax: top_k must be a number from -256 to 256"):
        app.route("some text", "topk-softmax", {"top_k": 10**9})
    with pytest.raises(gr.Error, match="options is too long"):
        app.route("some text", "steer", {"disable": {"0": list(range(MAX_OPTIONS_CHARS))}})
    with pytest.raises(gr.Error, match="no router named 'topk-sofmax'; did you mean 'topk-softmax'"):
        app.route("some text", "topk-sofmax", {})


# ---- adapter-lab ----------------------------------------------------------------------------------------

@pytest.fixture
def adapter_lab():
    app = load_app("adapter-lab")
    app.build_demo()  # the adapter controls
    app.base = lambda name: object()  # no model: nothing past the checks may run
    app.finetune = never
    return app


@pytest.mark.parametrize("options, message", [
    ({"r": 100000}, "lora-experts: r must be a number from -256 to 256"),
    ({"r": 4, "alpha": 1e300}, "alpha must be a number"),
    ({"r": 4, "alpha": float("nan")}, "alpha must be a number"),
    ({"targets": "x" * (MAX_OPTIONS_CHARS + 1)}, f"options is too long: .* at most {MAX_OPTIONS_CHARS}"),
    ("r=4", "options must be a mapping"),
], ids=["huge-r", "huge-alpha", "nan", "long", "not-a-mapping"])
def test_adapter_lab_refuses_oversized_options(adapter_lab, options, message):
    with pytest.raises(gr.Error, match=message):
        adapter_lab.run("lora-experts", options, "code", 2, 1e-3)


@pytest.mark.parametrize("steps, lr, message", [(10**6, 1e-3, "steps must be a number from 1 to 60"),
                                                (2, 1e9, "learning rate must be a number from 0 to 1")],
                         ids=["steps", "lr"])
def test_adapter_lab_refuses_oversized_steps_and_lr(adapter_lab, steps, lr, message):
    with pytest.raises(gr.Error, match=message):
        adapter_lab.run("lora-experts", {"r": 2}, "code", steps, lr)


def test_adapter_lab_passes_inputs_within_limits(adapter_lab):
    """The limits are not so tight that an ordinary run is refused: it reaches finetune."""
    seen = {}

    def finetune(model, name, opts, **kwargs):
        seen.update(name=name, opts=opts, **kwargs)
        raise ValueError("stop here")

    adapter_lab.finetune = finetune
    with pytest.raises(gr.Error, match="stop here"):
        adapter_lab.run("lora-experts", {"r": 8, "alpha": 16}, "code", 60, 1e-3)
    assert seen["opts"] == {"r": 8, "alpha": 16} and seen["steps"] == 60 and seen["lr"] == 1e-3


# ---- multimodal-digits ----------------------------------------------------------------------------------

@pytest.fixture
def digits():
    app = load_app("multimodal-digits")
    app.base = never
    return app


def test_digits_refuses_long_audio_before_the_model(digits):
    rate = 22050
    long_clip = np.zeros(rate * (MAX_AUDIO_SECONDS + 1), dtype=np.int16)
    with pytest.raises(gr.Error, match=f"spoken digit is too long: 11.0 s, at most {MAX_AUDIO_SECONDS} s"):
        digits.answer(None, (rate, long_clip), "which digit ?", None)


def test_digits_refuses_long_prompt_before_the_model(digits):
    with pytest.raises(gr.Error, match="prompt is too long"):
        digits.answer(None, None, HUGE, None)


def test_digits_refuses_huge_image_before_the_model(digits):
    huge = np.broadcast_to(np.uint8(255), (5000, 5000, 3))  # no memory behind it: a view of one byte
    with pytest.raises(gr.Error, match="image is too large"):
        digits.answer({"composite": huge}, None, "which digit ?", None)


# ---- uploads ----------------------------------------------------------------------------------------------

def upload(url: str, size: int) -> int:
    boundary = uuid.uuid4().hex
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"files\"; filename=\"x.bin\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n")
    body = head.encode() + b"\0" * size + f"\r\n--{boundary}--\r\n".encode()
    request = urllib.request.Request(f"{url}gradio_api/upload", data=body, method="POST",
                                     headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_launch_caps_uploads(default_model):  # noqa: F811
    demo = launch("model-zoo", free_port(), prevent_thread_lock=True, quiet=True)
    try:
        assert demo.max_file_size == 5 * 1024 * 1024
        assert upload(demo.local_url, 6 * 1024 * 1024) == 413
        assert upload(demo.local_url, 1024) == 200
    finally:
        demo.close()


# ---- Space names ------------------------------------------------------------------------------------------

@pytest.fixture
def outside(tmp_path):
    """A folder outside spaces/ whose app.py leaves a mark when imported."""
    folder = tmp_path / "evil"
    folder.mkdir()
    (folder / "app.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n"
                                   "def build_demo():\n    raise SystemExit('built')\n")
    return folder


def test_demo_refuses_paths(outside):
    from click.testing import CliRunner

    from zoo.cli import cli

    names = [os.path.relpath(outside, resource_path("spaces")), str(outside), "../spaces/router-explorer",
             "router-explorer/../model-zoo", "router-explorer/", ".", ""]
    for name in names:
        result = CliRunner().invoke(cli, ["demo", name])
        assert result.exit_code == 1 and f"no Space named {name!r}" in result.output, (name, result.output)
    assert not (outside.parent / "imported").exists()
    result = CliRunner().invoke(cli, ["demo", "../router-explorer"])
    assert "did you mean 'router-explorer'" in result.output


def test_plugin_space_beside_its_module(outside, monkeypatch):
    """A plugin's own Space (spaces/<name>/ beside its module) loads by name; paths are refused the same way."""
    plugin = outside.parent / "plugin"
    (plugin / "spaces" / "plugin-space").mkdir(parents=True)
    (plugin / "spaces" / "plugin-space" / "app.py").write_text("def build_demo():\n    return 'plugin demo'\n")
    (plugin / "moe_zoo_reliability_plugin.py").write_text("class Owner:\n    pass\n")
    monkeypatch.syspath_prepend(str(plugin))
    monkeypatch.delitem(sys.modules, "moe_zoo_reliability_plugin", raising=False)
    from moe_zoo_reliability_plugin import Owner

    assert load_app("plugin-space", owner=Owner).build_demo() == "plugin demo"
    assert (space_dir("router-explorer", owner=Owner) / "app.py").is_file()  # shipped Spaces still found
    for name in ("../evil", str(outside), "plugin-space/../../evil"):
        with pytest.raises(UnknownSpace, match="no Space named"):
            load_app(name, owner=Owner)
    with pytest.raises(UnknownSpace):
        load_app("plugin-space")  # without its owner, only the shipped Spaces
    assert not (outside.parent / "imported").exists()
