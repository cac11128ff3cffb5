"""eagle3 train --init-from EXPORT_DIR: a warm start from an export (ours or a published SGLang drafter), refused
when the export disagrees with the dumps about capture, shapes or vocab map."""

import dataclasses
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from eagle3 import contract as C


@pytest.fixture(scope="module")
def exported(tiny_dump, tiny_targets, tmp_path_factory):
    """A real 4-step run on the tiny Llama dump (capture HF [1, 3, 4]) and its SGLang export."""
    from eagle3.export.sglang import export_drafter
    from eagle3.train.config import TrainConfig
    from eagle3.train.trainer import train
    root = tmp_path_factory.mktemp("init_from")
    run = str(root / "run")
    train(TrainConfig(dump=[tiny_dump], target=tiny_targets["llama"], out=run, drafter="tiny", bf16=False,
                      max_steps=4, save_interval=4, token_budget=512, warmup_steps=1, held_out_fraction=0.0,
                      num_workers=0, progress=False, report_to="none", draft_vocab_size=24))
    export = str(root / "export")
    export_drafter(run, export)
    return run, export


def foreign_copy(export, dst, ids=None):
    """The export as a published drafter directory: config.json + model.safetensors, no provenance."""
    shutil.copytree(export, dst)
    os.remove(os.path.join(dst, "eagle3_provenance.json"))
    if ids is not None:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    return str(dst)


def test_the_warm_drafter_is_the_export(exported, tiny_dump):
    from eagle3.model import Eagle3Drafter
    from eagle3.train.init_from import load_into, read_init_from
    _, export = exported
    init = read_init_from(export, C.load_manifest(tiny_dump))
    assert init.served_capture == [1, 3, 4]
    d = Eagle3Drafter(init.config)
    vocab = init.vocab({})
    d.set_vocab_map(vocab["d2t"], vocab["t2d"])
    load_into(d, init)
    want = load_file(os.path.join(export, "model.safetensors"))
    got = d.export_state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k].to(v.dtype), v), k  # bf16 weights held exactly in the fp32 drafter


def test_a_published_drafter_without_provenance_is_taken_on_its_ids(exported, tiny_dump, tmp_path):
    from eagle3.train.init_from import read_init_from
    _, export = exported
    foreign = foreign_copy(export, tmp_path / "published")
    assert read_init_from(foreign, C.load_manifest(tiny_dump)).served_capture == [1, 3, 4]


def test_refused_when_the_served_capture_is_not_the_dumps(exported, tiny_dump, tmp_path):
    from eagle3.train.init_from import read_init_from
    _, export = exported
    # SGLang (llama rule: id + 1) would capture HF [2, 3, 4] with these ids; the dump holds [1, 3, 4]
    foreign = foreign_copy(export, tmp_path / "other_ids", ids=[1, 2, 3])
    with pytest.raises(C.ContractError, match=r"HF 2 .* but the dumps hold HF 1"):
        read_init_from(foreign, C.load_manifest(tiny_dump))


def test_refused_when_the_shapes_do_not_fit_the_target(exported, tiny_dump):
    from eagle3.train.init_from import read_init_from
    _, export = exported
    m = C.load_manifest(tiny_dump)
    other = dataclasses.replace(m, target=dataclasses.replace(m.target, hidden_size=32, vocab_size=7))
    with pytest.raises(C.ContractError, match=r"hidden_size 64 \(the target's: 32\).*vocab_size"):
        read_init_from(export, other)


def test_a_vocab_other_than_the_exports_is_refused(exported, tiny_dump):
    from eagle3.train.init_from import check_same_vocab, read_init_from
    _, export = exported
    init = read_init_from(export, C.load_manifest(tiny_dump))
    same = init.vocab({})
    check_same_vocab(init, same, "vocab.safetensors")
    t2d = same["t2d"].clone()
    on, off = int(t2d.nonzero()[-1]), int((~t2d).nonzero()[-1])
    t2d[on], t2d[off] = False, True  # one token swapped for another
    ids = t2d.nonzero().squeeze(-1)
    other = {"d2t": ids - torch.arange(ids.numel()), "t2d": t2d}
    with pytest.raises(C.ContractError, match="not the draft vocabulary of --init-from"):
        check_same_vocab(init, other, "vocab.safetensors")


def test_train_init_from_starts_at_the_export_and_records_it(exported, tiny_dump, tiny_targets, tmp_path):
    """Through the trainer: with lr 0 the weights never move, so the checkpoint is the export's weights; the
    vocabulary is the export's map; run.json names the start by its weights' sha256."""
    from eagle3.data.vocab import load_vocab
    from eagle3.train.config import TrainConfig
    from eagle3.train.trainer import train
    _, export = exported
    out = str(tmp_path / "warm")
    train(TrainConfig(dump=[tiny_dump], target=tiny_targets["llama"], out=out, drafter="tiny", bf16=False,
                      max_steps=2, save_interval=2, token_budget=512, warmup_steps=1, held_out_fraction=0.0, lr=0.0,
                      num_workers=0, progress=False, report_to="none", init_from=export))
    want = load_file(os.path.join(export, "model.safetensors"))
    got = load_file(os.path.join(out, "checkpoints", "step00000002", "drafter.safetensors"))
    for k, v in want.items():
        assert torch.equal(got[k].to(v.dtype), v), k
    vocab = load_vocab(os.path.join(out, "vocab.safetensors"))
    assert torch.equal(vocab["t2d"], want["t2d"]) and torch.equal(vocab["d2t"], want["d2t"])
    with open(os.path.join(out, "run.json")) as f:
        run = json.load(f)
    assert run["init_from"]["model_safetensors_sha256"] == C.file_sha256(os.path.join(export, "model.safetensors"))
    assert run["drafter"]["draft_vocab_size"] == 24  # the export's shape, not the preset's default


def published_mla(dst, tiny_target_dir, ids, prefix="layers.0."):
    """A published Kimi-style MLA EAGLE-3.1 drafter directory as TorchSpec's --vllm converter writes one:
    Eagle3DeepseekV2ForCausalLM, model_type kimi_k2, fc_norm + norm_output, full vocab (no d2t/t2d), `layers.0.`
    names, the embedding included, weights in two shards."""
    from safetensors.torch import save_file
    from eagle3.model import DrafterConfig, Eagle3Drafter
    t = json.load(open(os.path.join(tiny_target_dir, "config.json")))
    cfg = DrafterConfig(layout="mla", hidden_size=t["hidden_size"], num_attention_heads=4, num_key_value_heads=4,
                        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        intermediate_size=96, vocab_size=t["vocab_size"], draft_vocab_size=t["vocab_size"],
                        target_hidden_size=t["hidden_size"], fc_norm=True, norm_output=True,
                        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                      "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    torch.manual_seed(3)
    d = Eagle3Drafter(cfg)
    sd = {(prefix + k[len("midlayer."):] if k.startswith("midlayer.") else k): v.to(torch.bfloat16)
          for k, v in d.state_dict().items() if k not in ("d2t", "t2d")}
    os.makedirs(dst)
    names = sorted(sd)
    save_file({k: sd[k] for k in names[: len(names) // 2]}, os.path.join(dst, "model-00001-of-00002.safetensors"))
    save_file({k: sd[k] for k in names[len(names) // 2:]}, os.path.join(dst, "model-00002-of-00002.safetensors"))
    config = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "kimi_k2", "num_hidden_layers": 1,
              **{k: v for k, v in cfg.to_dict().items() if k not in ("layout", "num_aux_layers", "head_dim",
                                                                       "norm_before_fc")},
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}}
    json.dump(config, open(os.path.join(dst, "config.json"), "w"))
    return str(dst), d


def test_a_published_mla_eagle31_drafter_is_a_warm_start(tiny_dump, tiny_targets, tmp_path):
    """Layout, options, full vocab and weights come from the published directory; the run trains on from there."""
    from eagle3.train.config import TrainConfig
    from eagle3.train.init_from import load_into, read_init_from
    from eagle3.model import Eagle3Drafter
    path, ref = published_mla(tmp_path / "pub", tiny_targets["llama"], ids=[0, 2, 3])  # llama rule: +1 -> HF 1, 3, 4
    init = read_init_from(path, C.load_manifest(tiny_dump))
    assert init.config.layout == "mla" and init.config.options == ["fc_norm", "norm_output"]
    assert init.config.draft_vocab_size == init.config.vocab_size and init.served_capture == [1, 3, 4]
    d = Eagle3Drafter(init.config)
    vocab = init.vocab({})
    assert bool(vocab["t2d"].all()) and not bool(vocab["d2t"].any())
    d.set_vocab_map(vocab["d2t"], vocab["t2d"])
    load_into(d, init)
    for k, v in ref.export_state_dict().items():
        assert torch.equal(d.export_state_dict()[k], v.to(torch.bfloat16).to(torch.float32) if v.is_floating_point()
                           else v), k
    from eagle3.train.trainer import train
    r = train(TrainConfig(dump=[tiny_dump], target=tiny_targets["llama"], out=str(tmp_path / "run"), bf16=False,
                          max_steps=2, save_interval=2, token_budget=512, warmup_steps=1, held_out_fraction=0.0,
                          num_workers=0, progress=False, report_to="none", init_from=path))
    assert r["step"] == 2
    run = json.load(open(tmp_path / "run" / "run.json"))
    assert run["drafter"]["layout"] == "mla" and run["drafter"]["norm_output"] is True


def test_a_published_drafter_for_other_layers_is_refused(tiny_dump, tiny_targets, tmp_path):
    """SGLang's rule for the dump's llama target (+1) reads ids [1, 3, 4] as HF [2, 4, 5]: not the dump's [1, 3, 4]."""
    from eagle3.train.init_from import read_init_from
    path, _ = published_mla(tmp_path / "pub", tiny_targets["llama"], ids=[1, 3, 4])
    with pytest.raises(C.ContractError, match=r"capture .*2.*4.*5.*but the dumps hold"):
        read_init_from(path, C.load_manifest(tiny_dump))
