"""An in-memory Google Cloud Storage server for tests: the part of the JSON API that
TensorStore's gcs driver (Orbax's arrays) and gcsfs (etils.epath: everything else) use.

What matters for correctness is kept faithful: object generations (`x-goog-generation`),
the `ifGenerationMatch` / `ifGenerationNotMatch` preconditions that TensorStore's
OCDBT manifest writes rely on, byte ranges, prefix/delimiter listings with paging, and no
directories (a "folder" is only a common prefix). Ready-made emulators skip the
preconditions, and Orbax's writes then fail against them.

    server = FakeGCS(buckets=["runs"]); server.start()
    os.environ["STORAGE_EMULATOR_HOST"] = server.url      # gcsfs
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = server.url   # TensorStore
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import urllib.parse
import uuid
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Object:
    def __init__(self, name: str, data: bytes, generation: int, content_type: str):
        self.name, self.data, self.generation, self.content_type = name, data, generation, content_type

    def resource(self, bucket: str) -> dict:
        return {"kind": "storage#object", "bucket": bucket, "name": self.name,
                "id": f"{bucket}/{self.name}/{self.generation}", "size": str(len(self.data)),
                "generation": str(self.generation), "metageneration": "1",
                "contentType": self.content_type, "storageClass": "STANDARD",
                "md5Hash": base64.b64encode(hashlib.md5(self.data).digest()).decode(),
                "crc32c": base64.b64encode(_crc32c(self.data).to_bytes(4, "big")).decode(),
                "timeCreated": "2026-01-01T00:00:00.000Z", "updated": "2026-01-01T00:00:00.000Z"}


def _crc32c(data: bytes) -> int:
    try:
        import google_crc32c  # installed with gcsfs
        return int.from_bytes(google_crc32c.Checksum(data).digest(), "big")
    except ImportError:
        return zlib.crc32(data)  # only shown, never checked by the clients used here


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        # A client that hangs up mid-reply (a process killed by a test, a pool closing
        # at exit) is routine here; anything else is a bug of this server: show it.
        import sys
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class FakeGCS:
    def __init__(self, buckets: list[str], host: str = "127.0.0.1"):
        self.buckets: dict[str, dict[str, _Object]] = {b: {} for b in buckets}
        self.lock = threading.Lock()
        self.generation = 1000
        self.uploads: dict[str, dict] = {}
        self.requests = 0
        self.served: dict[str, int] = {}  # object name -> bytes of its data sent in replies
        fake = self

        class Handler(_Handler):
            gcs = fake

        self.httpd = _Server((host, 0), Handler)
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> FakeGCS:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def put(self, bucket: str, name: str, data: bytes, content_type: str, query: dict) -> tuple[int, dict]:
        with self.lock:
            objects = self.buckets.get(bucket)
            if objects is None:
                return 404, _error(404, f"no bucket {bucket}")
            problem = _precondition(objects.get(name), query)
            if problem:
                return problem
            self.generation += 1
            obj = objects[name] = _Object(name, data, self.generation, content_type)
            return 200, obj.resource(bucket)


def _error(code: int, message: str) -> dict:
    return {"error": {"code": code, "message": message, "errors": [{"message": message}]}}


def _precondition(obj: _Object | None, query: dict) -> tuple[int, dict] | None:
    gen = obj.generation if obj is not None else 0
    if "ifGenerationMatch" in query and int(query["ifGenerationMatch"]) != gen:
        return 412, _error(412, "Precondition Failed")
    if "ifGenerationNotMatch" in query and int(query["ifGenerationNotMatch"]) == gen:
        return 304, {}
    return None


class _Handler(BaseHTTPRequestHandler):
    gcs: FakeGCS
    protocol_version = "HTTP/1.1"

    def log_message(self, *a) -> None:
        pass

    # -- plumbing ---------------------------------------------------------------------------

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, code: int, body: bytes | dict = b"", headers: dict | None = None) -> None:
        if isinstance(body, dict):
            body = json.dumps(body).encode() if body or code >= 400 else b""
            headers = {"Content-Type": "application/json", **(headers or {})}
        if code in (204, 304):
            body = b""
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _route(self):
        url = urllib.parse.urlsplit(self.path)
        query = {k: v[0] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
        # Object names are percent-encoded ("a%2Fb"): match on the raw path, then unquote.
        return url.path, query

    def _object(self, bucket: str, name: str) -> _Object | None:
        return self.gcs.buckets.get(bucket, {}).get(name)

    # -- verbs ------------------------------------------------------------------------------

    def do_GET(self) -> None:
        self.gcs.requests += 1
        path, q = self._route()
        if m := re.fullmatch(r"(?:/download)?/storage/v1/b/([^/]+)/o/(.+)", path):
            bucket, name = m[1], urllib.parse.unquote(m[2])
            with self.gcs.lock:
                obj = self._object(bucket, name)
            if obj is None:
                return self._send(404, _error(404, f"No such object: {bucket}/{name}"))
            if "generation" in q and int(q["generation"]) != obj.generation:
                return self._send(404, _error(404, "No such object generation"))
            problem = _precondition(obj, q)
            if problem:
                return self._send(*problem)
            if q.get("alt") != "media" and not path.startswith("/download"):
                return self._send(200, obj.resource(bucket))
            return self._media(obj)
        if m := re.fullmatch(r"/storage/v1/b/([^/]+)/o", path):
            return self._list(m[1], q)
        if m := re.fullmatch(r"/storage/v1/b/([^/]+)", path):
            if m[1] not in self.gcs.buckets:
                return self._send(404, _error(404, "No such bucket"))
            return self._send(200, {"kind": "storage#bucket", "name": m[1], "id": m[1]})
        self._send(501, _error(501, f"fake_gcs: GET {path} is not implemented"))

    do_HEAD = do_GET

    def _media(self, obj: _Object) -> None:
        data, code = obj.data, 200
        headers = {"x-goog-generation": str(obj.generation), "x-goog-metageneration": "1",
                   "x-goog-stored-content-length": str(len(obj.data)),
                   "Content-Type": obj.content_type}
        if rng := self.headers.get("Range"):
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
            if m:
                size = len(obj.data)
                if m[1] == "":  # the last n bytes
                    start, end = max(0, size - int(m[2])), size - 1
                else:
                    start, end = int(m[1]), min(size - 1, int(m[2])) if m[2] else size - 1
                if start >= size and size > 0:
                    return self._send(416, _error(416, "Requested range not satisfiable"))
                data, code = obj.data[start:end + 1], 206
                headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        if self.command == "GET":
            with self.gcs.lock:
                self.gcs.served[obj.name] = self.gcs.served.get(obj.name, 0) + len(data)
        self._send(code, data, headers)

    def _list(self, bucket: str, q: dict) -> None:
        if bucket not in self.gcs.buckets:
            return self._send(404, _error(404, "No such bucket"))
        prefix, delim = q.get("prefix", ""), q.get("delimiter", "")
        start, end = q.get("startOffset", ""), q.get("endOffset", "")
        token, limit = q.get("pageToken", ""), int(q.get("maxResults") or 1000)
        with self.gcs.lock:
            names = sorted(self.gcs.buckets[bucket])
            objects = dict(self.gcs.buckets[bucket])
        entries = []  # (sort key, object or prefix)
        seen = set()
        for name in names:
            if not name.startswith(prefix) or (start and name < start) or (end and name >= end):
                continue
            rest = name[len(prefix):]
            if delim and delim in rest:
                p = prefix + rest[:rest.index(delim) + len(delim)]
                if p not in seen:
                    seen.add(p)
                    entries.append((p, None))
                continue
            entries.append((name, objects[name]))
        entries = [e for e in entries if e[0] > token] if token else entries
        page, more = entries[:limit], len(entries) > limit
        out = {"kind": "storage#objects",
               "items": [o.resource(bucket) for _, o in page if o is not None],
               "prefixes": [k for k, o in page if o is None]}
        if more:
            out["nextPageToken"] = page[-1][0]
        self._send(200, out)

    def do_POST(self) -> None:
        self.gcs.requests += 1
        path, q = self._route()
        body = self._body()
        if m := re.fullmatch(r"/upload/storage/v1/b/([^/]+)/o", path):
            bucket, kind = m[1], q.get("uploadType", "media")
            if kind == "media":
                return self._send(*self.gcs.put(bucket, q["name"], body,
                                                self.headers.get("Content-Type", "application/octet-stream"), q))
            if kind == "multipart":
                meta, data, ctype = _multipart(self.headers.get("Content-Type", ""), body)
                return self._send(*self.gcs.put(bucket, meta.get("name") or q["name"], data,
                                                meta.get("contentType") or ctype, q))
            if kind == "resumable" and "upload_id" in q:
                return self._chunk(q, body)
            if kind == "resumable":
                meta = json.loads(body or b"{}")
                upload = uuid.uuid4().hex
                self.gcs.uploads[upload] = {"bucket": bucket, "name": meta.get("name") or q.get("name"),
                                            "q": q, "data": bytearray(),
                                            "type": self.headers.get("X-Upload-Content-Type",
                                                                     "application/octet-stream")}
                loc = f"{self.gcs.url}/upload/storage/v1/b/{bucket}/o?uploadType=resumable&upload_id={upload}"
                return self._send(200, b"", {"Location": loc})
        if m := re.fullmatch(r"/storage/v1/b/([^/]+)/o/(.+)/(?:rewriteTo|copyTo)/b/([^/]+)/o/(.+)", path):
            src = self._object(m[1], urllib.parse.unquote(m[2]))
            if src is None:
                return self._send(404, _error(404, "No such object"))
            code, res = self.gcs.put(m[3], urllib.parse.unquote(m[4]), src.data, src.content_type, q)
            if code != 200 or path.split("/")[-4] == "copyTo":
                return self._send(code, res)
            return self._send(200, {"kind": "storage#rewriteResponse", "done": True,
                                    "totalBytesRewritten": res["size"], "objectSize": res["size"],
                                    "resource": res})
        self._send(501, _error(501, f"fake_gcs: POST {path} is not implemented"))

    def do_PUT(self) -> None:
        self.gcs.requests += 1
        _, q = self._route()
        self._chunk(q, self._body())

    def _chunk(self, q: dict, body: bytes) -> None:
        """One piece of a resumable upload (gcsfs POSTs them, the API documents PUT)."""
        upload = self.gcs.uploads.get(q.get("upload_id", ""))
        if upload is None:
            return self._send(404, _error(404, "fake_gcs: no such upload"))
        upload["data"] += body
        rng = self.headers.get("Content-Range", "")
        m = re.fullmatch(r"bytes (?:\d+-\d+|\*)/(\d+|\*)", rng.strip()) if rng else None
        if m is None or m[1] == "*" or len(upload["data"]) < int(m[1]):
            n = len(upload["data"])
            return self._send(308, b"", {"Range": f"bytes=0-{n - 1}"} if n else {})
        del self.gcs.uploads[q["upload_id"]]
        self._send(*self.gcs.put(upload["bucket"], upload["name"], bytes(upload["data"]),
                                 upload["type"], upload["q"]))

    def do_DELETE(self) -> None:
        self.gcs.requests += 1
        path, q = self._route()
        m = re.fullmatch(r"/storage/v1/b/([^/]+)/o/(.+)", path)
        if m is None:
            return self._send(501, _error(501, f"fake_gcs: DELETE {path} is not implemented"))
        bucket, name = m[1], urllib.parse.unquote(m[2])
        with self.gcs.lock:
            objects = self.gcs.buckets.get(bucket, {})
            obj = objects.get(name)
            if obj is None:
                return self._send(404, _error(404, "No such object"))
            problem = _precondition(obj, q)
            if problem:
                return self._send(*problem)
            del objects[name]
        self._send(204)


def _multipart(content_type: str, body: bytes) -> tuple[dict, bytes, str]:
    """The JSON metadata, data and data content type of a multipart/related upload."""
    m = re.search(r'boundary="?([^";]+)"?', content_type)
    if m is None:
        raise ValueError(f"multipart upload without a boundary: {content_type!r}")
    parts = body.split(b"--" + m[1].encode())
    chunks = []
    for part in parts[1:]:
        if part.startswith(b"--"):
            break
        part = part.lstrip(b"\r\n")
        ends = [(i, sep) for sep in (b"\r\n\r\n", b"\n\n") if (i := part.find(sep)) >= 0]
        i, sep = min(ends) if ends else (len(part), b"")
        head, data = part[:i], part[i + len(sep):]
        if data.endswith(b"\r\n"):
            data = data[:-2]
        elif data.endswith(b"\n"):
            data = data[:-1]
        ctype = re.search(rb"(?i)content-type:\s*([^\r\n]+)", head)
        chunks.append((data, ctype[1].decode() if ctype else "application/octet-stream"))
    meta = json.loads(chunks[0][0] or b"{}")
    data, ctype = chunks[1] if len(chunks) > 1 else (b"", "application/octet-stream")
    return meta, data, ctype
