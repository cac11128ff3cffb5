"""Whether the installed llama.cpp can answer a chat request from a worker thread, as its server does.

launch/install.sh runs it after installing the test extra; exit status 0 = it can. A segfault (the AMX matmul of a
-march=native build on a Xeon with AMX faults off the main thread) ends the process with a signal, not 0.
"""
import threading

from llama_cpp import Llama

from eagle3.dump.example import gguf_path

model = Llama(model_path=gguf_path(), n_ctx=256, n_threads=1, verbose=False)
out = {}
worker = threading.Thread(target=lambda: out.update(model.create_chat_completion(
    [{"role": "user", "content": "hi"}], max_tokens=2, temperature=0)))
worker.start()
worker.join()
raise SystemExit(0 if out.get("choices") else 1)
