"""A stand-in for the Gemini API's two routes (`models/M:generateContent` and
`models/M:streamGenerateContent?alt=sse`) on a local port: replies with a fixed text (streamed a
word per event) and records every request's path, JSON body and API key."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeGemini:
    def __init__(self, reply: str = "Paris is the capital."):
        self.reply = reply
        self.requests: list[dict] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                size = int(self.headers.get("content-length", 0))
                body = json.loads(self.rfile.read(size) or b"{}")
                fake.requests.append({"path": self.path, "body": body,
                                      "key": self.headers.get("x-goog-api-key")})
                words = fake.reply.split(" ")
                pieces = [w + (" " if i < len(words) - 1 else "") for i, w in enumerate(words)]
                if ":streamGenerateContent" in self.path:
                    self.send_response(200)
                    self.send_header("content-type", "text/event-stream")
                    self.end_headers()
                    for i, p in enumerate(pieces):
                        last = i == len(pieces) - 1
                        event = json.dumps(fake.response(p, last)).encode()
                        self.wfile.write(b"data: " + event + b"\r\n\r\n")
                        self.wfile.flush()
                    return
                out = json.dumps(fake.response(fake.reply, True)).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def response(self, text: str, last: bool) -> dict:
        cand = {"content": {"role": "model", "parts": [{"text": text}]}, "index": 0}
        out = {"candidates": [cand], "responseId": "resp-1", "modelVersion": "fake"}
        if last:
            cand["finishReason"] = "STOP"
            out["usageMetadata"] = {"promptTokenCount": 7, "candidatesTokenCount": 5,
                                    "totalTokenCount": 12}
        return out

    def close(self):
        self.server.shutdown()
