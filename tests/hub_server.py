"""A loopback Hub for the publishing tests: the few endpoints huggingface_hub 2.x calls to push and to download.

    LoopbackHub().start() -> base url     a ThreadingHTTPServer on 127.0.0.1, random port, in a daemon thread
    python tests/hub_server.py            the same as a process: prints the base url, serves until Ctrl-C
    hub.repos["user/name"]                Repo: private flag, branches (name -> commit), commits (sha -> {path: bytes})
    hub.requests                          (client host, method, path) of every request, for the tests' assertions

Endpoints (paths as huggingface_hub builds them from HF_ENDPOINT):

    POST /api/repos/create                          create_repo; 409 + {"url"} when it exists (exist_ok)
    POST /api/validate-yaml                         create_commit checks a README.md's metadata parses
    POST /api/models/{repo}/preupload/{rev}         upload mode per file: always "regular", so the commit carries
                                                    the bytes (base64) and no LFS / Xet transfer is needed
    POST /api/models/{repo}/commit/{rev}            NDJSON: header, then file / deletedFile / deletedFolder lines
    POST /api/models/{repo}/branch/{branch}         create_branch (publish --revision)
    GET  /api/models/{repo}[/revision/{rev}]        model_info / repo_info: sha, private, siblings
    GET  /api/models/{repo}/tree/{rev}[/{path}]     list_repo_tree (non-recursive)
    HEAD/GET /{repo}/resolve/{rev}/{path}           downloads: ETag, X-Repo-Commit, Content-Length; no Xet headers

Missing things answer 404 with the X-Error-Code huggingface_hub maps to its errors (RepoNotFound, RevisionNotFound,
EntryNotFound). Writes need an `Authorization: Bearer ...` header; private repos are hidden (404) from requests
without one. Nothing here is a real Hub: no LFS, no pull requests, no users beyond the namespace in a repo id.
"""

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import yaml

HOST = "127.0.0.1"
_REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"


@dataclass
class Repo:
    private: bool = False
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit sha
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> snapshot of every file

    def commit(self, branch: str, files: dict[str, bytes], message: str) -> str:
        digest = hashlib.sha1(message.encode())
        for path in sorted(files):
            digest.update(path.encode() + b"\0" + hashlib.sha256(files[path]).digest())
        digest.update(str(len(self.commits)).encode())  # two commits of the same tree still differ
        sha = digest.hexdigest()
        self.commits[sha] = files
        self.branches[branch] = sha
        return sha

    def resolve(self, revision: str) -> str | None:
        if revision in self.branches:
            return self.branches[revision]
        return revision if revision in self.commits else None


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, body: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.body = status, code, body


class LoopbackHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.url = ""

    def start(self) -> str:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self.server = ThreadingHTTPServer((HOST, 0), Handler)  # port 0: the OS picks a free one
        self.server.daemon_threads = True
        self.url = f"http://{HOST}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    # ---- the Hub's behaviour, one method per endpoint ----

    def _repo(self, repo_id: str, authorized: bool) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and not authorized):
            raise HubError(404, f"Repository Not Found for url: {repo_id}", "RepoNotFound")
        return repo

    def _snapshot(self, repo_id: str, revision: str, authorized: bool) -> tuple[str, dict[str, bytes]]:
        repo = self._repo(repo_id, authorized)
        sha = repo.resolve(revision)
        if sha is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return sha, repo.commits[sha]

    def create_repo(self, payload: dict) -> dict:
        if payload.get("type", "model") != "model":
            raise HubError(400, "the loopback Hub holds model repos only")
        repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        if "/" not in repo_id:
            raise HubError(400, "pass a namespaced repo id (user/name): the loopback Hub has no whoami")
        url = f"{self.url}/{repo_id}"
        if repo_id in self.repos:
            raise HubError(409, "You already created this model repo", body={"error": "exists", "url": url})
        repo = Repo(private=payload.get("visibility") == "private" or bool(payload.get("private")))
        repo.commit("main", {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"}, "initial")
        self.repos[repo_id] = repo
        return {"url": url, "name": repo_id}

    def preupload(self, repo_id: str, revision: str, payload: dict) -> dict:
        self._snapshot(repo_id, revision, authorized=True)
        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in payload["files"]]
        return {"files": files, "commitOid": self.repos[repo_id].resolve(revision)}

    def commit(self, repo_id: str, revision: str, body: bytes) -> dict:
        sha, files = self._snapshot(repo_id, revision, authorized=True)
        if revision not in self.repos[repo_id].branches:
            raise HubError(400, f"can only commit to a branch, not {revision}")
        files = dict(files)
        message = ""
        for line in body.splitlines():
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                message = value["summary"]
            elif key == "file":
                if value.get("encoding") != "base64":
                    raise HubError(400, f"unsupported encoding {value.get('encoding')!r}")
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                if files.pop(value["path"], None) is None:
                    raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                files = {path: data for path, data in files.items() if not path.startswith(prefix)}
            else:  # lfsFile: never asked for, since preupload answers "regular"
                raise HubError(400, f"the loopback Hub does not take {key!r} operations")
        new_sha = self.repos[repo_id].commit(revision, files, message)
        return {"success": True, "commitOid": new_sha, "commitUrl": f"{self.url}/{repo_id}/commit/{new_sha}"}

    def create_branch(self, repo_id: str, branch: str, payload: dict) -> dict:
        repo = self._repo(repo_id, authorized=True)
        if branch in repo.branches:
            raise HubError(409, f"Reference already exists: {branch}")
        start = repo.resolve(payload.get("startingPoint") or "main")
        if start is None:
            raise HubError(404, f"Invalid rev id: {payload.get('startingPoint')}", "RevisionNotFound")
        repo.branches[branch] = start
        return {}

    def model_info(self, repo_id: str, revision: str, authorized: bool) -> dict:
        sha, files = self._snapshot(repo_id, revision, authorized)
        return {
            "id": repo_id,
            "modelId": repo_id,
            "sha": sha,
            "private": self.repos[repo_id].private,
            "tags": [],
            "siblings": [{"rfilename": path, "size": len(data)} for path, data in sorted(files.items())],
        }

    def tree(self, repo_id: str, revision: str, folder: str, authorized: bool) -> list[dict]:
        _, files = self._snapshot(repo_id, revision, authorized)
        prefix = folder.strip("/") + "/" if folder.strip("/") else ""
        entries: dict[str, dict] = {}
        for path, data in sorted(files.items()):
            if not path.startswith(prefix):
                continue
            head, _, rest = path[len(prefix) :].partition("/")
            if rest:
                entries[prefix + head] = {"type": "directory", "path": prefix + head, "oid": "0" * 40, "size": 0}
            else:
                entries[path] = {"type": "file", "path": path, "oid": _git_oid(data), "size": len(data)}
        if prefix and not entries:
            raise HubError(404, f"{folder} does not exist on {revision}", "EntryNotFound")
        return list(entries.values())

    def resolve_file(self, repo_id: str, revision: str, path: str, authorized: bool) -> tuple[str, bytes]:
        sha, files = self._snapshot(repo_id, revision, authorized)
        if path not in files:
            raise HubError(404, f"Entry not found: {path}", "EntryNotFound")
        return sha, files[path]


def _git_oid(data: bytes) -> str:
    """The blob id git (and the Hub) gives a file: sha1 of "blob {size}\\0" + content."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    hub: LoopbackHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - quiet: the tests read hub.requests instead
        pass

    def do_HEAD(self):  # noqa: N802 - http.server's naming
        self._dispatch("HEAD")

    def do_GET(self):  # noqa: N802
        self._dispatch("GET")

    def do_POST(self):  # noqa: N802
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        path = unquote(urlsplit(self.path).path)
        with self.hub.lock:
            self.hub.requests.append((self.client_address[0], method, path))
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        authorized = self.headers.get("Authorization", "").startswith("Bearer ")
        try:
            with self.hub.lock:
                self._route(method, path, body, authorized)
        except HubError as error:
            payload = json.dumps(error.body or {"error": str(error)}).encode()
            headers = {"X-Error-Message": str(error)}
            if error.code:
                headers["X-Error-Code"] = error.code
            self._send(error.status, payload, headers, head=method == "HEAD")  # HEAD answers carry no body

    def _route(self, method: str, path: str, body: bytes, authorized: bool) -> None:
        hub = self.hub
        if method == "POST" and not authorized and path != "/api/validate-yaml":
            raise HubError(401, "Invalid credentials in Authorization header")
        if method == "POST":
            if path == "/api/repos/create":
                return self._json(hub.create_repo(json.loads(body)))
            if path == "/api/validate-yaml":
                return self._validate_yaml(json.loads(body))
            if match := re.fullmatch(rf"/api/models/{_REPO}/preupload/(?P<rev>.+)", path):
                return self._json(hub.preupload(match["repo"], match["rev"], json.loads(body)))
            if match := re.fullmatch(rf"/api/models/{_REPO}/commit/(?P<rev>.+)", path):
                return self._json(hub.commit(match["repo"], match["rev"], body))
            if match := re.fullmatch(rf"/api/models/{_REPO}/branch/(?P<branch>.+)", path):
                return self._json(hub.create_branch(match["repo"], match["branch"], json.loads(body or b"{}")))
        if method == "GET":
            if match := re.fullmatch(rf"/api/models/{_REPO}(/revision/(?P<rev>.+))?", path):
                return self._json(hub.model_info(match["repo"], match["rev"] or "main", authorized))
            if match := re.fullmatch(rf"/api/models/{_REPO}/tree/(?P<rev>[^/]+)(/(?P<folder>.*))?", path):
                return self._json(hub.tree(match["repo"], match["rev"], match["folder"] or "", authorized))
        if method in ("GET", "HEAD"):
            if match := re.fullmatch(rf"/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)", path):
                sha, data = hub.resolve_file(match["repo"], match["rev"], match["file"], authorized)
                headers = {"ETag": f'"{_git_oid(data)}"', "X-Repo-Commit": sha}
                return self._send(200, data, headers, head=method == "HEAD")
        raise HubError(404, f"the loopback Hub has no endpoint {method} {path}")

    def _validate_yaml(self, payload: dict) -> None:
        match = re.match(r"^\s*---\r?\n([\s\S]*?)\r?\n---", payload.get("content", ""))
        try:
            metadata = yaml.safe_load(match.group(1)) if match else {}
        except yaml.YAMLError as error:
            raise HubError(400, "invalid YAML", body={"errors": [{"message": str(error)}]}) from error
        if not isinstance(metadata, dict):
            raise HubError(400, "invalid metadata", body={"errors": [{"message": "metadata must be a mapping"}]})
        self._json({"errors": [], "warnings": []})

    def _json(self, value) -> None:
        self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json"})

    def _send(self, status: int, data: bytes, headers: dict[str, str], head: bool = False) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)


def main(argv: list[str] | None = None) -> None:
    """Standalone, for trying publish.py by hand (the README walk-through): prints the address, serves until Ctrl-C."""
    import argparse
    import time

    parser = argparse.ArgumentParser(
        prog="python tests/hub_server.py",
        description="Serve a loopback Hub on 127.0.0.1 (a random port) for training/publish.py and from_pretrained: "
        "prints its address (use it as HF_ENDPOINT, with any HF_TOKEN for writes) and serves until Ctrl-C. Nothing "
        "is stored on disk.",
    )
    parser.parse_args(argv)
    loopback = LoopbackHub()
    print(loopback.start(), flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        loopback.stop()


if __name__ == "__main__":
    main()
