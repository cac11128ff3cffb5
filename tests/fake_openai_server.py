"""A real (stdlib) OpenAI-compatible chat-completions server for tests, run as its own process:

    python fake_openai_server.py [--fail-first N | --always-fail | --hang | --empty] [--reasoning]

It prints its port on the first line of stdout. Answers are a deterministic function of the request, so tests can
check what the client sent: ``re: <last user turn>``, plus `` | prev: <previous assistant turn>`` when the history
holds one (the history the client wrote), or ``no-think: ...`` when chat_template_kwargs.enable_thinking is false.
``--reasoning`` adds a reasoning_content and an inline <think> block. GET /v1/stats returns the chat request bodies.
"""

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "fake-model"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fail-first", type=int, default=0, help="answer the first N chat requests with HTTP 500")
    ap.add_argument("--always-fail", action="store_true")
    ap.add_argument("--hang", action="store_true", help="never answer chat requests")
    ap.add_argument("--empty", action="store_true", help="answer with empty content")
    ap.add_argument("--reasoning", action="store_true", help="answer with reasoning_content and a <think> block")
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

        def do_GET(self):
            if self.path.rstrip("/").endswith("/models"):
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
            self._send(200, {"id": f"chatcmpl-{n}", "object": "chat.completion", "created": 0, "model": MODEL,
                             "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": len(answer.split()),
                                       "total_tokens": 1 + len(answer.split())}})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
