"""A local stand-in of the Hugging Face Hub's HTTP API, enough for ``huggingface_hub``'s ``create_repo``,
``create_commit`` and ``upload_folder`` (repo creation, the README's metadata check, the preupload check, a commit),
on 127.0.0.1 without network: point ``HF_ENDPOINT`` at ``HubStandIn.url``. Its preupload answer puts every file
inline in the commit ("regular"), so huggingface_hub's LFS and Xet transfers are not exercised. It keeps what was
committed (``repos[repo_id][path]``: bytes) and every request it saw (``requests``: (method, path)), and refuses a
POST without ``Authorization: Bearer <token>`` as the Hub does (401)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml
from _dist import without_rank_environment
from _fixtures import ROOT

TOKEN = "hf_standin_token"


def hub_env(home: Path, endpoint: str, token: str | None = TOKEN) -> dict[str, str]:
    """This process's environment for a command that talks to the Hub at ``endpoint``: no rank variables, no
    FASTCOV_DEBUG, huggingface_hub's caches in ``home``, ``token`` as HF_TOKEN (none when None), DeepSpeed on CPU."""
    env = without_rank_environment("FASTCOV_DEBUG", "HF_TOKEN", "HF_HUB_OFFLINE", "HF_ENDPOINT", "HF_HOME")
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1", DS_ACCELERATOR="cpu")
    if token is not None:
        env["HF_TOKEN"] = token
    return env


def run_fastcov(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m fastcov ARGS`` in its own process, as a user runs it, from the checkout's root."""
    return subprocess.run([sys.executable, "-m", "fastcov", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


class HubStandIn:
    def __init__(self, token: str = TOKEN):
        self.token = token
        self.repos: dict[str, dict[str, bytes]] = {}
        self.private: dict[str, bool] = {}
        self.commits: list[dict] = []
        self.cards: list[str] = []  # README.md contents validated (POST /api/validate-yaml)
        self.requests: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _reply(self, status: int, body: object | None = None) -> None:
                data = json.dumps(body).encode() if body is not None else b""
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> bytes:
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def do_GET(self):
                hub.requests.append(("GET", self.path))
                self._reply(404, {"error": "not served by the stand-in"})

            def do_POST(self):
                hub.requests.append(("POST", self.path))
                body = self._body()
                if self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self._reply(401, {"error": "Invalid credentials in Authorization header"})
                if self.path == "/api/repos/create":
                    req = json.loads(body)
                    repo_id = f"{req['organization']}/{req['name']}" if req.get("organization") else f"me/{req['name']}"
                    if repo_id in hub.repos:
                        return self._reply(409, {"error": "You already created this model repo",
                                                 "url": f"{hub.url}/{repo_id}"})
                    hub.repos[repo_id] = {}
                    hub.private[repo_id] = req.get("visibility") == "private" or bool(req.get("private"))
                    return self._reply(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})
                if self.path == "/api/validate-yaml":  # a README.md's front matter, checked before the commit
                    content = json.loads(body)["content"]
                    front = content.split("---")[1] if content.startswith("---") else ""
                    try:
                        if not isinstance(yaml.safe_load(front) or {}, dict):
                            raise yaml.YAMLError("the front matter is not a mapping")
                    except yaml.YAMLError as exc:
                        return self._reply(400, {"errors": [{"message": str(exc)}]})
                    hub.cards.append(content)
                    return self._reply(200, {"warnings": []})
                m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(preupload|commit)/([^/?]+)(\?.*)?", self.path)
                if not m or m.group(1) not in hub.repos:
                    return self._reply(404, {"error": "Repository not found"})
                repo_id, what = m.group(1), m.group(2)
                if what == "preupload":
                    files = json.loads(body)["files"]
                    return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                                       for f in files]})
                lines = [json.loads(ln) for ln in body.decode().splitlines() if ln.strip()]
                header = next(ln["value"] for ln in lines if ln["key"] == "header")
                for ln in lines:
                    if ln["key"] == "file":
                        hub.repos[repo_id][ln["value"]["path"]] = base64.b64decode(ln["value"]["content"])
                    elif ln["key"] != "header":
                        return self._reply(400, {"error": f"the stand-in does not take {ln['key']!r}"})
                oid = hashlib.sha1(body).hexdigest()
                hub.commits.append({"repo": repo_id, "summary": header.get("summary"), "oid": oid})
                return self._reply(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{oid}", "commitOid": oid,
                                         "pullRequestUrl": None})

        return Handler
