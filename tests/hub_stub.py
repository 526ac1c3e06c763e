"""A stand-in for the Hugging Face Hub's file API, serving one local folder as a model repository.

Runs in the pytest process, on a loopback port, in a thread. Owns the few routes huggingface_hub's
`snapshot_download` uses: the revision's metadata (`/api/models/ORG/NAME/revision/REV`: its commit
and file list), the file tree at that commit (`/api/models/ORG/NAME/tree/COMMIT`), and each file
(`HEAD`/`GET /ORG/NAME/resolve/REV/FILE`, with the commit and ETag headers the client checks).
Every request is recorded, so a test can tell what was fetched.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse


class HubStub:
    def __init__(self, repo_id: str, folder: Path, commit: str = "a" * 40, port: int = 0) -> None:
        self.repo_id = repo_id
        self.folder = folder
        self.commit = commit
        self.requests: list[tuple[str, str]] = []
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                stub.answer(self, with_body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                stub.answer(self, with_body=False)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> HubStub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.folder)) for p in self.folder.rglob("*") if p.is_file())

    def answer(self, handler: http.server.BaseHTTPRequestHandler, with_body: bool) -> None:
        path = unquote(urlparse(handler.path).path)
        self.requests.append((handler.command, path))
        info_prefix = f"/api/models/{self.repo_id}/revision/"
        tree_prefix = f"/api/models/{self.repo_id}/tree/"
        file_prefix = f"/{self.repo_id}/resolve/"
        if path.startswith(tree_prefix):
            entries = [
                {"type": "file", "path": f, "size": (self.folder / f).stat().st_size,
                 "oid": hashlib.sha1((self.folder / f).read_bytes()).hexdigest()}  # noqa: S324 (git's blob id)
                for f in self.files()
            ]  # fmt: skip
            listing = json.dumps(entries).encode()
            self._send(handler, 200, listing, {"content-type": "application/json"}, with_body)
        elif path.startswith(info_prefix):
            body = json.dumps(
                {"id": self.repo_id, "sha": self.commit, "siblings": [{"rfilename": f} for f in self.files()]}
            ).encode()
            self._send(handler, 200, body, {"content-type": "application/json"}, with_body)
        elif path.startswith(file_prefix) and "/" in path[len(file_prefix) :]:
            name = path[len(file_prefix) :].split("/", 1)[1]
            target = self.folder / name
            if not target.is_file() or name not in self.files():
                self._send(handler, 404, b"{}", {"x-error-code": "EntryNotFound"}, with_body)
                return
            data = target.read_bytes()
            headers = {
                "x-repo-commit": self.commit,
                "etag": '"' + hashlib.sha256(data).hexdigest() + '"',
                "content-type": "application/octet-stream",
            }
            self._send(handler, 200, data, headers, with_body)
        else:
            self._send(handler, 404, b"{}", {"x-error-code": "RepoNotFound"}, with_body)

    @staticmethod
    def _send(
        handler: http.server.BaseHTTPRequestHandler,
        status: int,
        body: bytes,
        headers: dict[str, str],
        with_body: bool,
    ) -> None:
        handler.send_response(status)
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.send_header("content-length", str(len(body)))
        handler.end_headers()
        if with_body:
            handler.wfile.write(body)
