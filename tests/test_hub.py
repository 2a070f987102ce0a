"""zoo.publishing.hub.push_to_hub end to end over HTTP, against tests/hub_server.py (olah + upload endpoints).

The push and the pulls run in subprocesses: huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE when it
is imported, and this suite runs with HF_HUB_OFFLINE=1 (conftest), which the subprocesses drop."""
import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zoo
import zoo.publishing.hub
from tiny import tiny_native

HERE = Path(__file__).resolve().parent
TOKEN = "hf_secret_test_token"
REPO = "org/name"
SPACE = "org/name-router-explorer"  # topk-softmax names the router-explorer Space

PUSH = f"""
import json, sys, torch, zoo, zoo.publishing.hub
from tiny import tiny_native
from zoo.data.tokenizer import load_tokenizer
model = zoo.apply(zoo.convert(tiny_native("mixtral")), "topk-softmax", top_k=1)
ids = torch.tensor([[5, 17, 33, 9, 70, 11, 3, 44], [8, 21, 66, 12, 90, 1, 2, 3]])
with torch.no_grad():
    logits = model(ids).logits
result = zoo.publishing.hub.push_to_hub(model, {REPO!r}, space=True, tokenizer=load_tokenizer(), token={TOKEN!r},
                             space_dir=sys.argv[1])
torch.save({{"ids": ids, "logits": logits, "state": model.state_dict()}}, sys.argv[2])
print(json.dumps(result))
"""

PULL = f"""
import sys, torch
ref = torch.load(sys.argv[1], weights_only=True)
import zoo
from transformers import AutoModelForCausalLM
from huggingface_hub import HfApi, ModelCard, SpaceCard
out = {{}}
for how, model in (("zoo.load", zoo.load("hf-hub:{REPO}")), ("auto", AutoModelForCausalLM.from_pretrained({REPO!r}))):
    with torch.no_grad():
        out[how] = {{"class": type(model).__name__, "logits": model(ref["ids"]).logits, "state": model.state_dict()}}
text = "To be, or not to be"
out["tokens"] = zoo.load_tokenizer("hf-hub:{REPO}")(text)["input_ids"]
from zoo.data.tokenizer import load_tokenizer
out["tokens_ref"] = load_tokenizer()(text)["input_ids"]
api = HfApi()
out["model_files"] = sorted(api.list_repo_files({REPO!r}))
out["model_card"] = ModelCard.load({REPO!r}).content
out["space_files"] = sorted(api.list_repo_files({SPACE!r}, repo_type="space"))
out["space_card"] = SpaceCard.load({SPACE!r}, repo_type="space").data.to_dict()
torch.save(out, sys.argv[2])
"""


class HubServer:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True)
        self.stderr = open(root / "server.log", "w")
        self.proc = subprocess.Popen([sys.executable, str(HERE / "hub_server.py"), str(root), "--max-seconds", "300"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        port = self.proc.stdout.readline().strip() if ready else ""
        if not port.isdigit():
            self.stop()
            pytest.fail(f"the test Hub server did not start: {(root / 'server.log').read_text()[-3000:]}")
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        """Close stdin (the server's signal to stop); kill it if it has not stopped within 15 s."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()

    def requests(self) -> list[dict]:
        return [json.loads(line) for line in (self.root / "requests.jsonl").read_text().splitlines()]


@pytest.fixture
def hub(tmp_path):
    pytest.importorskip("olah", reason="the test Hub server needs olah (pip install -e .[test])")
    server = HubServer(tmp_path / "hub")
    yield server
    server.stop()
    assert server.proc.returncode is not None


def run(hub, tmp_path, script: str, *args) -> subprocess.CompletedProcess:
    # no HF_HUB_OFFLINE, no token, no shared cache from the outer environment
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
               PYTHONPATH=os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", script, *map(str, args)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return proc


def minimal_space(folder: Path) -> Path:
    """A Space folder of its own, so this test does not depend on the real spaces/ being written."""
    folder.mkdir()
    (folder / "app.py").write_text("import gradio as gr\n\ndemo = gr.Blocks()\n")
    (folder / "requirements.txt").write_text("moe-zoo\n")
    (folder / "README.md").write_text("---\ntitle: Router explorer\nsdk: gradio\napp_file: app.py\n"
                                      "models: []  # filled in by push_to_hub\n---\n\n# Router explorer\n")
    return folder


def test_push_to_hub_then_load_back_over_http(hub, tmp_path):
    space_src = minimal_space(tmp_path / "space-src")
    push = run(hub, tmp_path, PUSH, space_src, tmp_path / "pushed.pt")
    result = json.loads(push.stdout.strip().splitlines()[-1])
    assert result["repo_id"] == REPO and result["url"] == f"{hub.url}/{REPO}"
    assert result["space_id"] == SPACE and result["space_url"] == f"{hub.url}/spaces/{SPACE}"
    assert len(result["commit_oid"]) == 40 and len(result["space_commit_oid"]) == 40
    pull = run(hub, tmp_path, PULL, tmp_path / "pushed.pt", tmp_path / "pulled.pt")
    hub.stop()  # every request is logged once the server has stopped

    ref = torch.load(tmp_path / "pushed.pt", weights_only=True)
    out = torch.load(tmp_path / "pulled.pt", weights_only=True)
    for how in ("zoo.load", "auto"):
        assert out[how]["class"] == "ZooMixtralForCausalLM"
        assert out[how]["state"].keys() == ref["state"].keys()
        assert all(torch.equal(out[how]["state"][k], v) for k, v in ref["state"].items()), how
        torch.testing.assert_close(out[how]["logits"], ref["logits"], rtol=0, atol=1e-6)
    assert out["tokens"] == out["tokens_ref"]
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json"} <= set(out["model_files"])
    assert f'from_pretrained("{REPO}")' in out["model_card"]
    assert out["space_files"] == ["README.md", "app.py", "requirements.txt"]
    assert out["space_card"]["models"] == [REPO] and out["space_card"]["sdk"] == "gradio"

    # the token went out as the Authorization header of the uploads, and nowhere else
    requests = hub.requests()
    uploads = [r for r in requests if r["method"] == "POST"]
    assert {r["path"] for r in uploads} >= {"/api/repos/create", f"/api/models/{REPO}/commit/main",
                                            f"/api/spaces/{SPACE}/commit/main"}
    assert all(r["headers"].get("authorization") == f"Bearer {TOKEN}" for r in uploads)
    assert not any("authorization" in r["headers"] for r in requests if r["method"] != "POST")  # anonymous pulls
    for r in requests:
        r["headers"].pop("authorization", None)
    assert TOKEN not in json.dumps(requests)
    for text in (push.stdout, push.stderr, pull.stdout, pull.stderr, json.dumps(result),
                 (hub.root / "server.log").read_text()):
        assert TOKEN not in text


class FakeApi:
    """Records what push_to_hub would upload, without HTTP."""

    def __init__(self, endpoint=None, token=None):
        FakeApi.last, self.token, self.uploads = self, token, {}

    def create_repo(self, repo_id, repo_type=None, **kwargs):
        if repo_id == "org/fails":
            raise OSError(f"403 Forbidden: bad token {self.token}")
        return f"https://hub/{'spaces/' if repo_type else ''}{repo_id}"

    def upload_folder(self, repo_id, folder_path, repo_type=None, commit_message=None):
        root = Path(folder_path)
        self.uploads[repo_id] = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
        return type("Info", (), {"oid": "0" * 40, "commit_url": f"https://hub/{repo_id}/commit/" + "0" * 40})


def test_push_folder_contents_tokenizer_from_name_or_path_and_space_fallback(tmp_path, monkeypatch):
    import huggingface_hub
    from zoo.data.tokenizer import load_tokenizer

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    zoo.convert(tiny_native("mixtral")).save_pretrained(tmp_path / "saved")
    load_tokenizer().save_pretrained(tmp_path / "saved")
    model = zoo.load(tmp_path / "saved")  # config._name_or_path is that folder: its tokenizer files go along
    assert zoo.publishing.hub.space_for(model) == ("router-explorer", None)  # empty recipe: the default Space
    space_src = minimal_space(tmp_path / "space-src")
    (space_src / "README.md").unlink()  # a Space without README still gets front matter pointing at the model

    result = zoo.publishing.hub.push_to_hub(model, "org/plain", token=TOKEN, space_dir=space_src)
    assert result["space_id"] == "org/plain-router-explorer" and TOKEN not in json.dumps(result)
    files, space_files = FakeApi.last.uploads["org/plain"], FakeApi.last.uploads["org/plain-router-explorer"]
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert b'from_pretrained("org/plain")' in files["README.md"]
    assert set(space_files) == {"app.py", "requirements.txt", "README.md"}
    assert b"models:\n- org/plain" in space_files["README.md"] and b"sdk: gradio" in space_files["README.md"]

    topk = zoo.apply(model, "topk-softmax", top_k=1)
    name, owner = zoo.publishing.hub.space_for(topk)
    assert name == "router-explorer" and owner.name == "topk-softmax"
    assert zoo.publishing.hub.push_to_hub(topk, "org/nospace", space=False)["space_id"] is None
    assert list(FakeApi.last.uploads) == ["org/nospace"]

    # a saved folder goes up as it is, weights byte for byte, with the card rendered for the repo
    result = zoo.publishing.hub.push_to_hub(tmp_path / "saved", "org/folder", space=False)
    files = FakeApi.last.uploads["org/folder"]
    assert files["model.safetensors"] == (tmp_path / "saved" / "model.safetensors").read_bytes()
    assert b'from_pretrained("org/folder")' in files["README.md"] and "tokenizer.json" in files
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".moe-zoo-push")) == []

    with pytest.raises(TypeError, match="zoo.convert"):
        zoo.publishing.hub.push_to_hub(tiny_native("mixtral"), "org/native")
    with pytest.raises(RuntimeError, match="bad token hf_\\*\\*\\*") as excinfo:
        zoo.publishing.hub.push_to_hub(model, "org/fails", token=TOKEN)
    assert TOKEN not in str(excinfo.value)
