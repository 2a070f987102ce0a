"""A Hub-compatible server for tests: ``python tests/hub_server.py ROOT`` prints its port, then serves.

Downloads are olah's (https://github.com/vtuber-plan/olah), run offline from local git mirrors
(``ROOT/mirrors/<models|spaces>/<org>/<name>``). olah has no upload side, so this file adds the few
endpoints ``huggingface_hub`` calls to push (create repo, validate-yaml, preupload, commit); they write
git commits into those same mirrors. Every request (method, path, headers, body) is appended to
``ROOT/requests.jsonl``. The server stops when its stdin closes (the test's teardown, or the test
process dying), on SIGTERM, or after ``--max-seconds``.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import uvicorn
from fastapi import Request
from fastapi.responses import JSONResponse
from olah.configs import OlahConfig
from olah.server import AppSettings, app
from olah.server_api_routes import meta_proxy_common
from olah.utils.repo_utils import record_resolved_commit

_git_lock = asyncio.Lock()
_GIT_ENV = {"GIT_AUTHOR_NAME": "hub", "GIT_AUTHOR_EMAIL": "hub@localhost", "GIT_COMMITTER_NAME": "hub",
            "GIT_COMMITTER_EMAIL": "hub@localhost", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, **_GIT_ENV}).stdout.strip()


def _repo_dir(repo_type: str, repo_id: str) -> Path:
    org, _, name = repo_id.partition("/")
    if not org or not name or "/" in name or ".." in repo_id:
        raise ValueError(repo_id)
    return Path(app.state.mirrors) / repo_type / org / name


def _error(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status,
                        headers={"X-Error-Code": code, "X-Error-Message": message})


def _authorized(request: Request) -> bool:
    return request.headers.get("authorization", "").startswith("Bearer ")


async def _record_main(repo_type: str, path: Path) -> str:
    """Tell olah where ``main`` points now. Offline, olah resolves a branch name only from its own cache,
    not from the mirror: without this a missing optional file at ``main`` answers 401 RepoNotFound
    (which transformers treats as fatal) instead of 404 EntryNotFound."""
    oid = _git(path, "rev-parse", "HEAD")
    await record_resolved_commit(app, repo_type, path.parent.name, path.name, "main", oid)
    return oid


async def repo_info(repo_type: str, org: str, name: str, request: Request):
    """``/api/<type>/<org>/<name>`` (repo info without a revision, which transformers' ``resolve_revision``
    asks for): olah answers it offline only from its cache, so answer it from the mirror's ``main``."""
    return await meta_proxy_common(app, repo_type, org, name, "main", request.method.lower(),
                                   request.headers.get("authorization"))


app.router.add_api_route("/api/{repo_type}/{org}/{name}", repo_info, methods=["GET", "HEAD"])
app.router.routes.insert(0, app.router.routes.pop())  # before olah's own route for the same path


@app.post("/api/repos/create")
async def create_repo(request: Request):
    if not _authorized(request):
        return _error(401, "Unauthorized", "Invalid credentials in Authorization header")
    body = await request.json()
    repo_type = (body.get("type") or "model") + "s"
    repo_id = f"{body['organization']}/{body['name']}"
    prefix = "" if repo_type == "models" else f"{repo_type}/"
    url = f"{app.state.base_url}/{prefix}{repo_id}"
    path = _repo_dir(repo_type, repo_id)
    async with _git_lock:
        if path.exists():
            return JSONResponse({"error": "You already created this repo", "url": url}, status_code=409)
        path.mkdir(parents=True)
        _git(path, "init", "-q", "-b", "main")
        _git(path, "commit", "-q", "--allow-empty", "-m", "initial commit")
        await _record_main(repo_type, path)
    return {"url": url, "name": repo_id, "id": repo_id}


@app.post("/api/validate-yaml")
async def validate_yaml():
    return {"errors": [], "warnings": []}


@app.post("/api/{repo_type}/{org}/{name}/preupload/{revision}")
async def preupload(repo_type: str, org: str, name: str, revision: str, request: Request):
    if not _repo_dir(repo_type, f"{org}/{name}").exists():
        return _error(404, "RepoNotFound", "Repository not found")
    files = (await request.json())["files"]
    # "regular": file contents come inline (base64) in the commit, so no LFS / Xet storage is needed
    return {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                      for f in files]}


@app.post("/api/{repo_type}/{org}/{name}/commit/{revision}")
async def commit(repo_type: str, org: str, name: str, revision: str, request: Request):
    if not _authorized(request):
        return _error(401, "Unauthorized", "Invalid credentials in Authorization header")
    path = _repo_dir(repo_type, f"{org}/{name}")
    if not path.exists():
        return _error(404, "RepoNotFound", "Repository not found")
    if revision != "main":
        return _error(400, "BadRequest", "this test server only commits to main")
    operations = [json.loads(line) for line in (await request.body()).splitlines() if line.strip()]
    summary = next((op["value"].get("summary") for op in operations if op["key"] == "header"), None) or "commit"
    files = [op for op in operations if op["key"] != "header"]
    for op in files:
        if op["key"] not in ("file", "deletedFile", "deletedFolder"):
            return _error(400, "BadRequest", f"unsupported commit operation {op['key']!r}")
        if path.resolve() not in (path / op["value"]["path"]).resolve().parents:
            return _error(400, "BadRequest", "path outside the repository")
    async with _git_lock:
        for op in files:
            target = path / op["value"]["path"]
            if op["key"] == "file":
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(base64.b64decode(op["value"]["content"]))
            else:
                _git(path, "rm", "-r", "-q", "--ignore-unmatch", op["value"]["path"])
        _git(path, "add", "-A")
        _git(path, "commit", "-q", "--allow-empty", "-m", summary)
        oid = await _record_main(repo_type, path)
    prefix = "" if repo_type == "models" else f"{repo_type}/"
    return {"commitUrl": f"{app.state.base_url}/{prefix}{org}/{name}/commit/{oid}", "commitOid": oid,
            "pullRequestUrl": None}


class RequestLog:
    """ASGI middleware: one JSON line per request (method, path, query, status, headers, body)."""

    def __init__(self, inner, path: Path):
        self.inner, self.path = inner, path

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        chunks: list[bytes] = []
        status = []

        async def logged_receive():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        async def logged_send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.inner(scope, logged_receive, logged_send)
        finally:
            entry = {"method": scope["method"], "path": scope["path"], "query": scope["query_string"].decode(),
                     "status": status[0] if status else None,
                     "headers": {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]},
                     "body": b"".join(chunks).decode("utf-8", "replace")}
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")


class _Server(uvicorn.Server):
    async def startup(self, sockets=None):
        await super().startup(sockets)
        print(app.state.port, flush=True)  # the parent waits for this line: the server is ready


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--max-seconds", type=float, default=300.0)
    args = parser.parse_args(argv)
    mirrors = args.root / "mirrors"
    mirrors.mkdir(parents=True, exist_ok=True)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = OlahConfig()
    config.host, config.port, config.offline = "127.0.0.1", port, True
    config.mirrors_path, config.repos_path = [str(mirrors)], str(args.root / "olah-cache")
    config.mirror_netloc = config.mirror_lfs_netloc = f"127.0.0.1:{port}"
    app.state.app_settings = AppSettings(config=config)
    app.state.mirrors, app.state.port, app.state.base_url = str(mirrors), port, f"http://127.0.0.1:{port}"

    server = _Server(uvicorn.Config(RequestLog(app, args.root / "requests.jsonl"), log_level="warning",
                                    timeout_graceful_shutdown=2))

    def stop_when(wait) -> None:
        wait()
        server.should_exit = True

    threading.Thread(target=stop_when, args=(sys.stdin.read,), daemon=True).start()
    deadline = threading.Timer(args.max_seconds, setattr, (server, "should_exit", True))
    deadline.daemon = True
    deadline.start()
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
