"""A real (stdlib) OpenAI-compatible chat-completions server for tests, run as its own process:

    python fake_openai_server.py [--fail-first N | --always-fail | --hang | --empty] [--reasoning]
                                 [--hostile MODE [--every K]]

It prints its port on the first line of stdout. Answers are a deterministic function of the request, so tests can
check what the client sent: ``re: <last user turn>``, plus `` | prev: <previous assistant turn>`` when the history
holds one (the history the client wrote), or ``no-think: ...`` when chat_template_kwargs.enable_thinking is false.
``--reasoning`` adds a reasoning_content and an inline <think> block. GET /v1/stats returns the chat request bodies.
``--hostile MODE`` answers chat requests (every K-th one with --every K, else all) the way a broken or hostile server
might: HOSTILE below.
"""

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "fake-model"
# What --hostile sends: a 200 whose body is not JSON, a choice without a message, content that is a list or a number,
# a string token count, no choices at all; HTTP 400 for everything; a valid answer trickled one byte a second; an
# answer cut by the token limit inside a multi-byte character (its partial bytes decoded as U+FFFD); GET /models
# trickled too ("trickle-models").
HOSTILE = ("not-json", "no-message", "list-content", "number-content", "string-usage", "no-choices", "refuse",
           "trickle", "cut-utf8", "trickle-models")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fail-first", type=int, default=0, help="answer the first N chat requests with HTTP 500")
    ap.add_argument("--always-fail", action="store_true")
    ap.add_argument("--hang", action="store_true", help="never answer chat requests")
    ap.add_argument("--empty", action="store_true", help="answer with empty content")
    ap.add_argument("--reasoning", action="store_true", help="answer with reasoning_content and a <think> block")
    ap.add_argument("--hostile", choices=HOSTILE, default=None)
    ap.add_argument("--every", type=int, default=1, help="--hostile on every K-th chat request only")
    args = ap.parse_args()
    lock = threading.Lock()
    requests = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _raw(self, code, body: bytes, trickle: bool = False):
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not trickle:
                self.wfile.write(body)
                return
            for i in range(len(body)):  # one byte a second: each read is quick, the whole answer is not
                self.wfile.write(body[i:i + 1])
                self.wfile.flush()
                time.sleep(1.0)

        def do_GET(self):
            if self.path.rstrip("/").endswith("/models") and args.hostile == "trickle-models":
                self._raw(200, json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode(),
                          trickle=True)
            elif self.path.rstrip("/").endswith("/models"):
                self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]})
            elif self.path.rstrip("/").endswith("/stats"):
                with lock:
                    self._send(200, {"requests": list(requests)})
            else:
                self._send(404, {"error": {"message": "not found"}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            with lock:
                requests.append(body)
                n = len(requests)
            if args.hang:
                time.sleep(3600)
            if args.always_fail or n <= args.fail_first:
                self._send(500, {"error": {"message": f"injected failure {n}", "type": "server_error"}})
                return
            msgs = body["messages"]
            last_user = next(m["content"] for m in reversed(msgs) if m["role"] == "user")
            prev = [m["content"] for m in msgs if m["role"] == "assistant"]
            no_think = (body.get("chat_template_kwargs") or {}).get("enable_thinking") is False
            answer = ("no-think: " if no_think else "re: ") + last_user + (f" | prev: {prev[-1]}" if prev else "")
            message = {"role": "assistant", "content": answer}
            if args.reasoning and not no_think:
                message = {"role": "assistant", "content": f"<think>inline thoughts</think>\n{answer}",
                           "reasoning_content": f"thinking about {last_user}"}
            if args.empty:
                message["content"] = ""
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            reply = {"id": f"chatcmpl-{n}", "object": "chat.completion", "created": 0, "model": MODEL,
                     "choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": len(answer.split()),
                                                    "total_tokens": 1 + len(answer.split())}}
            mode = args.hostile if args.hostile and n % args.every == 0 else None
            if mode == "not-json":
                return self._raw(200, b"<html>502 Bad Gateway</html>")
            if mode == "refuse":
                return self._send(400, {"error": {"message": "model not found", "type": "invalid_request_error"}})
            if mode == "no-message":
                del choice["message"]
            elif mode == "list-content":
                message["content"] = [{"type": "text", "text": answer}]
            elif mode == "number-content":
                message["content"] = 42
            elif mode == "string-usage":
                reply["usage"]["completion_tokens"] = "twelve"  # ("12" the client turns into 12)
            elif mode == "no-choices":
                reply["choices"] = []
            elif mode == "cut-utf8":
                message["content"] = answer + " caf\ufffd"
                choice["finish_reason"] = "length"
            self._raw(200, json.dumps(reply).encode(), trickle=mode == "trickle")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
