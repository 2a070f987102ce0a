"""Hub errors never show a token: push_to_hub against a local server that echoes the Authorization header
back in its error (as a misbehaving proxy or server might), with the token from ``token=``, ``HF_TOKEN``
or the stored login; and a server that echoes only the token's first characters."""
import http.server
import json
import threading
import traceback

import pytest

import zoo
import zoo.publishing.hub
import zoo.publishing.token_masking
import zoo.publishing.ship
from tiny import tiny_native

TOKEN = "hf_Xq7Zk29vLmN3pQwErTy5uIoP8aSdFgHjKl"  # random-looking, as real tokens are


class EchoHandler(http.server.BaseHTTPRequestHandler):
    """Answers every request 401, its error message quoting the Authorization header (whole, or cut)."""

    def _answer(self):
        auth = self.headers.get("authorization", "")
        self.server.seen.append(auth)
        shown = self.server.echo(auth.removeprefix("Bearer "))
        body = json.dumps({"error": f"Invalid credentials: {shown}"}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Error-Message", f"token {shown} rejected")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_HEAD = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def echo_hub(monkeypatch, tmp_path):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # conftest sets it; this server is local
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))  # no login of this machine
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "stored_tokens"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), EchoHandler)
    server.seen, server.echo = [], lambda token: token
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def model():
    return zoo.convert(tiny_native("mixtral"))


def push_error(hub, model, token=None) -> zoo.publishing.token_masking.HubError:
    with pytest.raises(zoo.publishing.token_masking.HubError) as excinfo:
        zoo.publishing.hub.push_to_hub(model, "org/name", space=False, token=token, endpoint=hub.url)
    assert hub.seen and hub.seen[0] == f"Bearer {TOKEN}"  # the token went out, and the server echoed it
    return excinfo.value


def assert_masked(error: Exception) -> None:
    shown = "".join(traceback.format_exception(error))  # what an uncaught error prints
    assert TOKEN[:8] not in shown and TOKEN[-8:] not in shown, shown
    assert "401" in str(error) and zoo.publishing.token_masking.MASK in str(error)  # still says what went wrong
    assert error.__cause__ is None and error.__suppress_context__  # the response (headers) is not chained
    assert isinstance(error, OSError) and isinstance(error, RuntimeError)


def test_token_argument_is_masked(echo_hub, model):
    assert_masked(push_error(echo_hub, model, token=TOKEN))


def test_hf_token_env_is_masked(echo_hub, model, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert_masked(push_error(echo_hub, model))


def test_stored_login_is_masked(echo_hub, model, tmp_path):
    (tmp_path / "token").write_text(TOKEN)  # what `hf auth login` writes
    assert_masked(push_error(echo_hub, model))


def test_token_prefix_is_masked(echo_hub, model):
    echo_hub.echo = lambda token: token[:10] + "..."  # a server that shows only the start of the token
    error = push_error(echo_hub, model, token=TOKEN)
    assert_masked(error)
    assert f"Invalid credentials: {zoo.publishing.token_masking.MASK}..." in str(error)


def test_ship_masks_hub_errors(monkeypatch, tmp_path):
    """zoo.publishing.ship loads SRC with transformers, which may be a hub id: a token in its error is masked too."""
    import transformers

    def from_pretrained(src, **kwargs):
        raise OSError(f"{src} is gated; token {TOKEN[:12]} has no access")

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    with pytest.raises(zoo.publishing.token_masking.HubError, match="org/gated is gated; token hf_\\*\\*\\* has no access") as excinfo:
        zoo.publishing.ship.ship("org/gated", str(tmp_path / "out"), "gated")
    assert TOKEN[:8] not in "".join(traceback.format_exception(excinfo.value))


def test_errors_without_a_token_pass_unchanged(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        with zoo.publishing.token_masking.masked_errors():
            raise FileNotFoundError("no such folder")


def test_zoo_load_masks_hub_errors(monkeypatch):
    """zoo.load of a hub id: its 'cannot load' error quotes transformers' error, token masked."""
    import transformers

    def from_pretrained(src, **kwargs):
        raise OSError(f"401 for {src}: token {TOKEN} rejected")

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    with pytest.raises(zoo.io.loading.HubUnavailable) as excinfo:
        zoo.load("org/private-model")
    shown = "".join(traceback.format_exception(excinfo.value))
    assert TOKEN[:8] not in shown and zoo.publishing.token_masking.MASK in str(excinfo.value)


# ---- exact pushes: only what belongs to the model ---------------------------------------------------------------
class RecordingApi:
    """Records what push_to_hub uploads, without HTTP."""
    uploads: dict = {}

    def __init__(self, endpoint=None, token=None):
        RecordingApi.uploads = {}

    def create_repo(self, repo_id, repo_type=None, **kwargs):
        return f"https://hub/{repo_id}"

    def upload_folder(self, repo_id, folder_path, repo_type=None, commit_message=None):
        from pathlib import Path

        root = Path(folder_path)
        RecordingApi.uploads[repo_id] = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        return type("Info", (), {"oid": "0" * 40, "commit_url": "https://hub/commit"})


@pytest.fixture
def recording(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    return RecordingApi


def test_push_of_a_folder_takes_only_the_models_files(recording, model, tmp_path):
    from zoo.data.tokenizer import load_tokenizer

    folder = tmp_path / "m"
    model.save_pretrained(folder, max_shard_size="300KB")
    load_tokenizer().save_pretrained(folder)
    (folder / ".env").write_text(f"HF_TOKEN={TOKEN}\n")
    (folder / "notes.txt").write_text("my notes")
    (folder / ".git").mkdir()
    (folder / ".git" / "config").write_text("[core]")
    (folder / "model-00009-of-00009.safetensors").write_bytes(b"a stale shard the index does not name")
    (folder / "optimizer.safetensors").write_bytes(b"training state")
    result = zoo.publishing.hub.push_to_hub(folder, "org/exact", space=False)
    sent = recording.uploads["org/exact"]
    assert sent == result["files"]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(sent) == {"README.md", "config.json", "generation_config.json", "model.safetensors.index.json",
                         "modeling_moe_zoo.py", "tokenizer.json", "tokenizer_config.json", *index["weight_map"].values()}
    assert {".env", "notes.txt", ".git/config", "model-00009-of-00009.safetensors",
            "optimizer.safetensors"} <= set(result["left_out"])
    assert TOKEN not in json.dumps(result)


def test_extra_files_go_up_only_when_named(recording, model, tmp_path):
    folder = tmp_path / "m"
    model.save_pretrained(folder)
    (folder / "notes.txt").write_text("share these")
    (tmp_path / "outside.txt").write_text("not the model's")
    result = zoo.publishing.hub.push_to_hub(folder, "org/extra", space=False, extra_files=["notes.txt"])
    assert "notes.txt" in recording.uploads["org/extra"] and "notes.txt" in result["files"]
    for bad in (["../outside.txt"], ["missing.txt"], [str(tmp_path / "outside.txt")]):
        with pytest.raises(FileNotFoundError, match="not a file inside"):
            zoo.publishing.hub.push_to_hub(folder, "org/extra", space=False, extra_files=bad)
    with pytest.raises(ValueError, match="push the folder"):
        zoo.publishing.hub.push_to_hub(model, "org/extra", space=False, extra_files=["notes.txt"])


def test_push_of_a_model_in_memory_says_what_it_sent(recording, model):
    result = zoo.publishing.hub.push_to_hub(model, "org/mem", space=False)
    assert result["files"] == recording.uploads["org/mem"]
    assert {"README.md", "config.json", "model.safetensors"} <= set(result["files"]) and result["left_out"] == []
