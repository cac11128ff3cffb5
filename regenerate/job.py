"""The regenerate job: check everything that can be refused, read the conversations, prepare --out, run the hf engine
(on every rank of a torchrun world) or the servers, merge the files and write regenerate.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from eagle3 import dist as D
from eagle3.conversations.formats import check_distinct_data, data_sha256
from eagle3.atomic import atomic_write_text
from eagle3.records import REGENERATE_FILE, identity_of
from eagle3.regenerate.config import RegenConfig, validate
from eagle3.regenerate.files import merge_out, prepare_out, run_config
from eagle3.regenerate.hf_engine import plan_batches, resolve_batching, resolve_kv_cache, run_hf
from eagle3.regenerate.items import read_items
from eagle3.regenerate.record import build_record, read_target, summary
from eagle3.regenerate.server_client import probe_servers, run_server
from eagle3.target import load as T


def run_regenerate(cfg: RegenConfig) -> dict:
    """Regenerate the assistant turns of cfg.data into cfg.out; returns the regenerate.json record (also when
    servers stopped answering: then its status is 'incomplete' and a rerun continues)."""
    t0 = time.perf_counter()
    cfg = dataclasses.replace(cfg, data=list(cfg.data), servers=list(cfg.servers) if cfg.servers else None)
    validate(cfg)
    # Everything that can be refused is refused before OUT is touched.
    target, tokenizer, tok = read_target(cfg.target, cfg.trust_remote_code, cfg.full_weights_digest,
                                         weights_optional=cfg.backend == "server")
    urls, model, engine_info = None, None, None
    if cfg.backend == "server":
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            raise ValueError("--server runs in one process (its parallelism is --concurrency per server); "
                             "torchrun is for --engine hf")
        world = None
        urls, model = probe_servers(cfg)
    else:
        world = D.init_world(cfg.device)
        if cfg.dtype is None:
            cfg.dtype = "bf16" if world.device.type == "cuda" else "fp32"
        if cfg.dtype not in T.DTYPES:
            raise ValueError(f"--dtype {cfg.dtype!r}: choose one of {sorted(T.DTYPES)}")
        cfg.dtype = str(T.DTYPES[cfg.dtype]).removeprefix("torch.")
        model = target["path"]
        engine_info = {"name": "hf", "dtype": cfg.dtype, "device": world.device.type, "batch_size": cfg.batch_size,
                       "batching": resolve_batching(cfg.batching, world.device),
                       "kv_cache": "static" if resolve_batching(cfg.batching, world.device) == "padded"
                       and resolve_kv_cache(cfg.kv_cache, world.device, cfg.max_prompt_tokens) else "dynamic",
                       "world_size": world.world_size}
    is_main = world is None or world.is_main
    log = D.main_log(is_main)
    # data_sha256: of a file or of a dataset directory
    inputs = [{"file": os.path.abspath(p), "sha256": data_sha256(p) if os.path.exists(p) else None}
              for p in cfg.data]
    check_distinct_data(cfg.data, [i["sha256"] for i in inputs])
    items, skipped, read = read_items(cfg.data, cfg.num_samples, cfg.max_turns)
    if target is None:
        log("[regenerate] note: no --target: regenerate.json records no target identity, and the dump will refuse "
            "this data unless --allow-foreign-data")

    current = run_config(cfg, identity_of(target, tokenizer), model, inputs)
    if world is None:
        done = prepare_out(cfg, current, skipped)
    else:  # rank 0's error is raised on every rank, so none waits in a collective
        done = D.broadcast_object(D.run_on_main(lambda: prepare_out(cfg, current, skipped), world))
    n_done = len(done & {i.sample_index for i in items})
    log(f"[regenerate] {read} conversations read: {len(items)} to regenerate ({n_done} already done), "
        f"{len(skipped)} skipped; {cfg.backend} backend, model {model}, temperature "
        f"{cfg.temperature:g}, top_p {cfg.top_p:g}, max_new_tokens {cfg.max_new_tokens}, reasoning {cfg.reasoning}")

    down: dict = {}
    if cfg.backend == "server":
        written, tokens, gen_s, down = run_server(cfg, urls, model, items, done, log)
    else:
        written, tokens, gen_s = run_hf(cfg, items, done, world, tok, log)
        if cfg.stop_after_batches is not None:
            D.barrier()
            left = sum(1 for b in plan_batches(items, cfg.batch_size) if any(i.sample_index not in done for i in b))
            if left > cfg.stop_after_batches * world.world_size:
                raise SystemExit(f"stopped after {cfg.stop_after_batches} batches (--stop-after-batches)")
        D.barrier()
        written = sum(D.all_gather_objects(written))
        tokens = sum(D.all_gather_objects(tokens))
        gen_s = max(D.all_gather_objects(gen_s))

    def finish() -> dict:
        convs, errors, skipped_all = merge_out(cfg.out)
        have = {c["sample_index"] for c in convs} | {e["sample_index"] for e in errors}
        pending = sum(it.sample_index not in have for it in items)  # not attempted (all servers went away)
        rec = build_record(cfg, target=target, tokenizer=tokenizer, model=model, servers=urls, inputs=inputs,
                           read=read, convs=convs, errors=errors, skipped=skipped_all, pending=pending,
                           elapsed=time.perf_counter() - t0, gen_s=gen_s, run_tokens=tokens, run_convs=written,
                           engine=engine_info)
        if down:
            rec["servers_down"] = down
        atomic_write_text(os.path.join(cfg.out, REGENERATE_FILE), json.dumps(rec, indent=1, ensure_ascii=False))
        log(summary(rec, cfg.out))
        return rec

    if world is None:
        record = finish()
    else:
        record = D.broadcast_object(D.run_on_main(finish, world))
        D.barrier()
    return record
