"""A protocol fake of the Hugging Face Hub (loopback only), for the tests of models and datasets named
by their Hub id (harness/core/hub.py). It is a fake, named as such: it serves the few routes that
huggingface_hub's downloads call, as huggingface_hub 2.4 calls them (hf_api.py: model_info,
dataset_info, list_repo_tree; file_download.py: the HEAD for a file's metadata, the GET of its
bytes), from repositories the test builds out of local files. It never stands in for an engine.

    GET      /api/{models|datasets}/ORG/NAME[/revision/REV]   info: sha (the commit), siblings with
                                                              sizes, gated, private
    GET      /api/{models|datasets}/ORG/NAME/tree/REV[/PATH]  the file listing (one page, no Link)
    HEAD|GET /ORG/NAME/resolve/REV/PATH                       a model repository's file
    HEAD|GET /datasets/ORG/NAME/resolve/REV/PATH              a dataset repository's file
             ETag (the git blob sha1), X-Repo-Commit, Content-Length; an LFS file (*.safetensors)
             answers 302 with Location (http://localhost:PORT/fake-lfs/SHA256: this server under
             another host name, as the Hub's storage is another host) and X-Linked-Etag (its
             sha256) / X-Linked-Size, as the Hub does
    HEAD|GET /fake-lfs/SHA256                                 an LFS file's bytes

Errors carry the Hub's X-Error-Code and X-Error-Message (RepoNotFound, RevisionNotFound,
EntryNotFound, GatedRepo), which huggingface_hub turns into its own exceptions. A gated or private
repository is readable with `Authorization: Bearer <FakeHub.token>` only. Every request is
recorded (method, path, Authorization) in `FakeHub.requests`.

    hub = FakeHub(token="...")
    commit = hub.add("org/model", {"config.json": b"...", "model.safetensors": path}, revision="main")
    with serving(hub.app()) as url:   # HF_ENDPOINT=url
        ...
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

LFS = (".safetensors",)
# The LFS store's host: another name of this server (the Hub's storage is another host, so
# huggingface_hub takes an LFS file's metadata from the redirect and sends no token there)
LFS_HOST = "localhost"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    repo_id: str
    repo_type: str  # model | dataset
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> {path: bytes}
    refs: dict[str, str] = field(default_factory=dict)  # branch / tag -> commit
    gated: bool = False
    private: bool = False

    def commit_of(self, revision: str) -> str | None:
        revision = unquote(revision)
        if revision in self.refs:
            return self.refs[revision]
        return revision if revision in self.commits else None


class FakeHub:
    def __init__(self, token: str | None = None):
        self.token = token
        self.repos: dict[tuple[str, str], FakeRepo] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.blobs: dict[str, bytes] = {}  # sha256 -> bytes (the LFS store)
        self._lock = threading.Lock()

    # ---- building repositories -------------------------------------------------------------------
    def add(self, repo_id: str, files: dict[str, bytes | str | Path], revision: str = "main",
            repo_type: str = "model", gated: bool = False, private: bool = False) -> str:
        """A commit of `files` (bytes, or a local file's path) on `revision` of the repository; its
        40-hex commit id."""
        data = {name: (Path(v).read_bytes() if isinstance(v, (str, Path)) else v) for name, v in files.items()}
        h = hashlib.sha1(f"{repo_type}:{repo_id}:{revision}".encode())
        for name in sorted(data):
            h.update(name.encode() + b"\0" + hashlib.sha256(data[name]).digest())
        commit = h.hexdigest()
        repo = self.repos.setdefault((repo_type, repo_id), FakeRepo(repo_id, repo_type))
        repo.commits[commit], repo.refs[revision] = data, commit
        repo.gated, repo.private = repo.gated or gated, repo.private or private
        for name, content in data.items():
            if name.endswith(LFS):
                self.blobs[hashlib.sha256(content).hexdigest()] = content
        return commit

    def add_dir(self, repo_id: str, directory: Path, revision: str = "main", skip: tuple[str, ...] = (),
                **kw: Any) -> str:
        files = {str(p.relative_to(directory)): p for p in sorted(Path(directory).rglob("*"))
                 if p.is_file() and p.name not in skip}
        return self.add(repo_id, files, revision, **kw)

    # ---- what the client asked ----------------------------------------------------------------
    def file_requests(self) -> list[tuple[str, str, str | None]]:
        """Requests for a file's bytes or metadata (resolve and LFS routes), not the API's."""
        return [r for r in self.requests if "/resolve/" in r[1] or r[1].startswith("/fake-lfs/")]

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    # ---- the app ---------------------------------------------------------------------------------------
    def _allowed(self, repo: FakeRepo, request: Request) -> bool:
        if not (repo.gated or repo.private):
            return True
        return self.token is not None and request.headers.get("authorization") == f"Bearer {self.token}"

    def app(self) -> FastAPI:
        app = FastAPI()
        hub = self

        @app.middleware("http")
        async def record(request: Request, call_next: Any) -> Any:
            with hub._lock:
                hub.requests.append((request.method, request.url.path, request.headers.get("authorization")))
            return await call_next(request)

        def error(status: int, code: str, message: str, commit: str | None = None) -> JSONResponse:
            headers = {"X-Error-Code": code, "X-Error-Message": message}
            if commit:
                headers["X-Repo-Commit"] = commit
            return JSONResponse({"error": message}, status_code=status, headers=headers)

        def find(kind: str, repo_id: str, request: Request) -> FakeRepo | JSONResponse:
            repo = hub.repos.get((kind, repo_id))
            if repo is None or (repo.private and not hub._allowed(repo, request)):
                return error(401 if request.headers.get("authorization") is None else 404, "RepoNotFound",
                             "Repository not found")
            return repo

        def info(kind: str, repo_id: str, revision: str, request: Request) -> Response:
            repo = find(kind, repo_id, request)
            if isinstance(repo, Response):
                return repo
            commit = repo.commit_of(revision)
            if commit is None:
                return error(404, "RevisionNotFound", f"Invalid rev id: {unquote(revision)}")
            files = repo.commits[commit]
            siblings = []
            for name, content in sorted(files.items()):
                s: dict[str, Any] = {"rfilename": name, "size": len(content), "blobId": git_blob_sha1(content)}
                if name.endswith(LFS):
                    s["lfs"] = {"sha256": hashlib.sha256(content).hexdigest(), "size": len(content), "pointerSize": 134}
                siblings.append(s)
            body = {"_id": commit[:24], "id": repo_id, "sha": commit, "private": repo.private,
                    "gated": "manual" if repo.gated else False, "disabled": False, "siblings": siblings,
                    "lastModified": "2025-01-01T00:00:00.000Z", "tags": [], "downloads": 0, "likes": 0}
            if kind == "model":
                body["modelId"] = repo_id
            return JSONResponse(body)

        def tree(kind: str, repo_id: str, revision: str, prefix: str, request: Request) -> Response:
            repo = find(kind, repo_id, request)
            if isinstance(repo, Response):
                return repo
            commit = repo.commit_of(revision)
            if commit is None:
                return error(404, "RevisionNotFound", f"Invalid rev id: {unquote(revision)}")
            out = []
            for name, content in sorted(repo.commits[commit].items()):
                if prefix and not name.startswith(prefix.rstrip("/") + "/"):
                    continue
                entry: dict[str, Any] = {"type": "file", "oid": git_blob_sha1(content), "size": len(content),
                                         "path": name}
                if name.endswith(LFS):
                    entry["lfs"] = {"oid": hashlib.sha256(content).hexdigest(), "size": len(content),
                                    "pointerSize": 134}
                out.append(entry)
            return JSONResponse(out)

        def resolve(kind: str, repo_id: str, revision: str, path: str, request: Request) -> Response:
            repo = find(kind, repo_id, request)
            if isinstance(repo, Response):
                return repo
            commit = repo.commit_of(revision)
            if commit is None:
                return error(404, "RevisionNotFound", f"Invalid rev id: {unquote(revision)}")
            if not hub._allowed(repo, request):
                return error(403 if request.headers.get("authorization") else 401, "GatedRepo",
                             f"Access to {kind} {repo_id} is restricted. You must have access to it and be "
                             "authenticated to access it. Please log in.")
            files = repo.commits[commit]
            if path not in files:
                return error(404, "EntryNotFound", f"{path} does not exist on \"{unquote(revision)}\"", commit)
            content = files[path]
            headers = {"X-Repo-Commit": commit, "ETag": f'"{git_blob_sha1(content)}"'}
            if path.endswith(LFS):  # the Hub sends LFS files to its storage: a redirect with the blob's own headers
                sha = hashlib.sha256(content).hexdigest()
                port = request.url.port
                headers.update({"X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(content)),
                                "Location": f"http://{LFS_HOST}:{port}/fake-lfs/{sha}"})
                return Response(status_code=302, headers=headers)
            return _file(request, content, headers)

        @app.api_route("/api/{kind}s/{org}/{name}", methods=["GET"])
        async def api_info(kind: str, org: str, name: str, request: Request) -> Response:
            return info(kind, f"{org}/{name}", "main", request)

        @app.api_route("/api/{kind}s/{org}/{name}/revision/{revision:path}", methods=["GET"])
        async def api_info_rev(kind: str, org: str, name: str, revision: str, request: Request) -> Response:
            return info(kind, f"{org}/{name}", revision, request)

        @app.api_route("/api/{kind}s/{org}/{name}/tree/{revision}", methods=["GET"])
        async def api_tree(kind: str, org: str, name: str, revision: str, request: Request) -> Response:
            return tree(kind, f"{org}/{name}", revision, "", request)

        @app.api_route("/api/{kind}s/{org}/{name}/tree/{revision}/{prefix:path}", methods=["GET"])
        async def api_tree_path(kind: str, org: str, name: str, revision: str, prefix: str,
                                request: Request) -> Response:
            return tree(kind, f"{org}/{name}", revision, prefix, request)

        @app.api_route("/fake-lfs/{sha}", methods=["GET", "HEAD"])
        async def lfs(sha: str, request: Request) -> Response:
            content = hub.blobs.get(sha)
            if content is None:
                return error(404, "EntryNotFound", "no such blob")
            return _file(request, content, {"ETag": f'"{sha}"', "X-Linked-Etag": f'"{sha}"',
                                            "X-Linked-Size": str(len(content))})

        @app.api_route("/datasets/{org}/{name}/resolve/{revision}/{path:path}", methods=["GET", "HEAD"])
        async def dataset_file(org: str, name: str, revision: str, path: str, request: Request) -> Response:
            return resolve("dataset", f"{org}/{name}", revision, path, request)

        @app.api_route("/{org}/{name}/resolve/{revision}/{path:path}", methods=["GET", "HEAD"])
        async def model_file(org: str, name: str, revision: str, path: str, request: Request) -> Response:
            return resolve("model", f"{org}/{name}", revision, path, request)

        return app


def _file(request: Request, content: bytes, headers: dict[str, str]) -> Response:
    headers = {**headers, "Content-Length": str(len(content)), "Accept-Ranges": "bytes"}
    if request.method == "HEAD":
        return Response(status_code=200, headers=headers)
    return Response(content=content, status_code=200, headers=headers, media_type="application/octet-stream")
