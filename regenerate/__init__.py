"""`eagle3 regenerate`: let the target write the assistant turns of a conversation dataset.

A drafter accepts best on the text its target actually produces, so the answers of a public dataset are rewritten
by the target (as SpecForge's scripts/regenerate_train_data.py does) before the dump. Two backends:

* ``--server URL [URL ...]``: any OpenAI-compatible chat-completions server (SGLang, vLLM, llama.cpp, ...);
  ``--concurrency`` requests in flight per server, retries with exponential backoff on transient failures.
* ``--engine hf --target DIR``: the target through transformers, batched ``model.generate`` with a KV cache and
  left padding; data parallel under ``torchrun --nproc-per-node N -m eagle3.regenerate ...``.

The stage runs before the dump: it reads its data with eagle3.conversations (the data formats, their hashes, the
end-of-turn tokens) and uses nothing of the dump but dump/shards.py's atomic write; the dump learns where its data
came from through eagle3.records (`data_sources`), never through this package. Its modules, in the order data flows:

* config.py: RegenConfig, the options of a run, and their checks;
* items.py: the conversations to regenerate (which turns, which are skipped) and the answers that replace them;
* hf_engine.py: ``--engine hf``; server_client.py: ``--server``;
* files.py: conversations.jsonl, errors.jsonl, skipped.jsonl, the ranks' part files and regenerate_config.json
  in --out (resume, repair of a cut-off line, merge);
* record.py: regenerate.json (target identity, counts, status) and what the CLI reports as a failure;
* job.py: run_regenerate, the whole run; __main__.py: ``python -m`` / ``torchrun -m eagle3.regenerate``.
"""
