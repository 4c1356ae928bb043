"""A stand-in for the Hugging Face Hub on 127.0.0.1, for `finetune publish`'s tests: only the routes huggingface_hub
2.x calls for create_repo, create_commit / upload_folder (HF_HUB_DISABLE_XET: regular files inline, LFS files through
the LFS batch API) and snapshot_download, read from its source (hf_api.py, _commit_api.py, lfs.py,
_snapshot_download.py, file_download.py). It keeps every request, body included, so a test can search every byte
that left the machine.

What it cannot prove (README, `finetune publish`): the Hub's own checks (its YAML metadata schema and model-index
validation, licence and tag vocabularies, which files its .gitattributes makes LFS, access rights, rate limits) and
the Xet upload protocol the real client prefers when hf_xet is installed.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import unquote, urlparse

# Suffixes the Hub's default .gitattributes stores in LFS (the ones finetune publishes; the real list is longer).
LFS_SUFFIXES = (".safetensors", ".bin", ".gguf", ".png", ".pt")


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]  # names in lower case
    body: bytes


@dataclass
class Repo:
    private: bool
    commits: list[tuple[str, dict[str, bytes]]] = field(default_factory=list)  # (sha, {path: bytes})
    lfs_paths: set[str] = field(default_factory=set)

    def tree(self, revision: str) -> Optional[tuple[str, dict[str, bytes]]]:
        if not self.commits:
            return None
        if revision == "main":
            return self.commits[-1]
        return next((c for c in self.commits if c[0] == revision), None)


def git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubStandIn:
    """`with HubStandIn() as hub:` serves on hub.endpoint; hub.requests holds every request."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "HubStandIn":
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def uploaded_bytes(self) -> bytes:
        """Every request body and every URL, as sent: what left the machine besides the headers."""
        return b"\n".join(r.path.encode() + b"\n" + r.body for r in self.requests)

    # --------------------------------------------------------------------------------------------
    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _body(self) -> bytes:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    return self.rfile.read(length)
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().strip() or b"0", 16)
                        if size == 0:
                            self.rfile.readline()
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return b""

            def _send(self, status: int, payload=None, headers: Optional[dict[str, str]] = None,
                      body: Optional[bytes] = None) -> None:
                data = body if body is not None else (json.dumps(payload).encode() if payload is not None else b"")
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                if body is None:
                    self.send_header("Content-Type", "application/json")
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _dispatch(self) -> None:
                body = self._body() if self.command in ("POST", "PUT") else b""
                with hub._lock:
                    hub.requests.append(Request(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                    try:
                        hub._route(self, urlparse(self.path).path, body)
                    except Exception as exc:  # a route the stand-in lacks shows up in the test's failure
                        self._send(500, {"error": f"stand-in: {type(exc).__name__}: {exc}"})

            do_GET = do_POST = do_PUT = do_HEAD = _dispatch

        return Handler

    def _route(self, h, path: str, body: bytes) -> None:
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if path == "/api/repos/create":
            payload = json.loads(body)
            repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
            if repo_id in self.repos:
                return h._send(409, {"error": "You already created this model repo"})
            self.repos[repo_id] = Repo(private=payload.get("visibility") == "private" or bool(payload.get("private")))
            return h._send(200, {"url": f"{self.endpoint}/{repo_id}", "name": repo_id})
        if path == "/api/validate-yaml":
            return h._send(200, {"errors": [], "warnings": []})
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo_id, verb, revision = f"{parts[2]}/{parts[3]}", parts[4], "/".join(parts[5:])
            repo = self.repos.get(repo_id)
            if repo is None:
                return h._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            if verb == "preupload":
                files = json.loads(body)["files"]
                return h._send(200, {"files": [{"path": f["path"], "shouldIgnore": False, "oid": None,
                                                "uploadMode": "lfs" if f["path"].endswith(LFS_SUFFIXES) else "regular"}
                                               for f in files]})
            if verb == "commit":
                return self._commit(h, repo_id, repo, body)
            if verb == "revision":
                return self._info(h, repo_id, repo, revision)
            if verb == "tree":
                return self._tree(h, repo, revision.split("/")[0])
        if len(parts) == 6 and parts[1].endswith(".git") and parts[2:] == ["info", "lfs", "objects", "batch"]:
            return self._lfs_batch(h, json.loads(body))
        if parts[0] == "__lfs" and h.command == "PUT":
            data, oid = body, parts[1]
            if hashlib.sha256(data).hexdigest() != oid:
                return h._send(400, {"error": "sha256 mismatch"})
            self.lfs[oid] = data
            return h._send(200, {})
        if parts[0] == "__lfs_verify":
            oid = json.loads(body)["oid"]
            return h._send(200 if oid in self.lfs else 404, {})
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(h, f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]))
        return h._send(404, {"error": f"stand-in has no route for {h.command} {path}"})

    def _lfs_batch(self, h, payload: dict) -> None:
        objects = []
        for obj in payload["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.lfs:
                entry["actions"] = {"upload": {"href": f"{self.endpoint}/__lfs/{obj['oid']}"},
                                    "verify": {"href": f"{self.endpoint}/__lfs_verify"}}
            objects.append(entry)
        h._send(200, {"transfer": "basic", "objects": objects})

    def _commit(self, h, repo_id: str, repo: Repo, body: bytes) -> None:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        files = dict(repo.commits[-1][1]) if repo.commits else {}
        for line in lines:
            value = line["value"]
            if line["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
                repo.lfs_paths.discard(value["path"])
            elif line["key"] == "lfsFile":
                if value["oid"] not in self.lfs:
                    return h._send(422, {"error": f"LFS object {value['oid']} was never uploaded"})
                files[value["path"]] = self.lfs[value["oid"]]
                repo.lfs_paths.add(value["path"])
            elif line["key"] in ("deletedFile", "deletedFolder"):
                files = {p: d for p, d in files.items() if p != value["path"] and not p.startswith(value["path"] + "/")}
        sha = hashlib.sha1(uuid.uuid4().bytes).hexdigest()
        repo.commits.append((sha, files))
        h._send(200, {"success": True, "commitOid": sha, "commitUrl": f"{self.endpoint}/{repo_id}/commit/{sha}"})

    def _info(self, h, repo_id: str, repo: Repo, revision: str) -> None:
        tree = repo.tree(revision)
        if tree is None:
            return h._send(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
        sha, files = tree
        h._send(200, {"id": repo_id, "modelId": repo_id, "sha": sha, "private": repo.private,
                      "siblings": [{"rfilename": p} for p in sorted(files)]})

    def _tree(self, h, repo: Repo, revision: str) -> None:
        tree = repo.tree(revision)
        if tree is None:
            return h._send(404, {"error": "Revision not found"}, {"X-Error-Code": "RevisionNotFound"})
        entries = []
        for path, data in sorted(tree[1].items()):
            entry = {"type": "file", "oid": git_blob_sha(data), "size": len(data), "path": path}
            if path in repo.lfs_paths:
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        h._send(200, entries)

    def _resolve(self, h, repo_id: str, revision: str, path: str) -> None:
        repo = self.repos.get(repo_id)
        tree = repo.tree(revision) if repo is not None else None
        if tree is None or path not in tree[1]:
            return h._send(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
        sha, files = tree
        data = files[path]
        etag = hashlib.sha256(data).hexdigest() if path in repo.lfs_paths else git_blob_sha(data)
        headers = {"X-Repo-Commit": sha, "ETag": f'"{etag}"'}
        if path in repo.lfs_paths:
            headers["X-Linked-Etag"] = f'"{etag}"'
            headers["X-Linked-Size"] = str(len(data))
        h._send(200, headers=headers, body=data)
