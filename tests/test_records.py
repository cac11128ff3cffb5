"""eagle3.records: run.json, checkpoint records and export provenance as typed records whose to_dict() is exactly
what is on disk, and whose from_dict() names the file and the key it cannot use."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from eagle3 import contract as C
from eagle3.records import (CKPT_FILE, PROVENANCE_FILE, RUN_FILE, CheckpointRecord, ExportProvenance, RunRecord,
                            find_checkpoint)


def ckpt_record_path(run, step):
    return os.path.join(run, "checkpoints", f"step{step:08d}", CKPT_FILE)


@pytest.fixture(scope="module")
def export_dir(tiny_export):
    return tiny_export


def assert_same_on_disk(record, path):
    """The record written back as its writer writes it: the same bytes (keys, values and their order)."""
    text = open(path).read()
    assert record.to_dict() == json.loads(text)
    assert json.dumps(record.to_dict(), indent=1) == text


def test_run_record_round_trips_a_real_run(tiny_run):
    path = os.path.join(tiny_run, RUN_FILE)
    rec = RunRecord.read(path)
    assert_same_on_disk(rec, path)
    assert RunRecord.from_dict(rec.to_dict()) == rec
    assert isinstance(rec.target, C.TargetInfo) and rec.target.num_hidden_layers == 6
    assert isinstance(rec.capture, C.CaptureSpec) and rec.capture.hidden_state_indices == [1, 3, 4]
    assert rec.identity["capture.hidden_state_indices"] == [1, 3, 4] and rec.extra == {}


@pytest.mark.parametrize("step", [2, 4])
def test_checkpoint_record_round_trips_a_real_checkpoint(tiny_run, step):
    path = ckpt_record_path(tiny_run, step)
    rec = CheckpointRecord.read(path)
    assert_same_on_disk(rec, path)
    assert rec.step == step and rec.tag == f"step{step:08d}" and rec.best is None
    assert "drafter.safetensors" in rec.sha256
    # the run's fields are the run.json the save was made with
    run = RunRecord.read(os.path.join(tiny_run, RUN_FILE))
    assert (rec.identity, rec.capture, rec.target, rec.drafter) == (run.identity, run.capture, run.target, run.drafter)


def test_checkpoint_record_of_best_keeps_the_writers_key_order(tiny_run):
    """checkpoints/best's record holds `best` before `sha256` (train/trainer.py save_best); the others have none."""
    d = json.load(open(ckpt_record_path(tiny_run, 4)))
    best = {"step": 4, "split": "eval", "decode_accept_len": 1.5}
    d = {**{k: v for k, v in d.items() if k != "sha256"}, "best": best, "sha256": d["sha256"]}
    rec = CheckpointRecord.from_dict(d)
    assert rec.best == best and list(rec.to_dict()) == list(d) and rec.to_dict() == d
    run = RunRecord.read(os.path.join(tiny_run, RUN_FILE))
    made = CheckpointRecord.of_run(run, step=4, tag="best", weights="drafter.safetensors", best=best,
                                   sha256=d["sha256"])
    assert list(made.to_dict()) == list(d)


def test_export_provenance_round_trips_a_real_export(export_dir):
    path = os.path.join(export_dir, PROVENANCE_FILE)
    prov = ExportProvenance.read(path)
    assert_same_on_disk(prov, path)
    assert prov.target.model_type == "llama" and prov.capture.hidden_state_indices == [1, 3, 4]
    assert prov.model_safetensors_sha256 == C.file_sha256(os.path.join(export_dir, "model.safetensors"))


def test_unknown_keys_survive_a_round_trip(tiny_run, export_dir):
    """A newer writer's keys (or a bench's, like peer_specforge's `peer`) are kept, after the known ones."""
    for cls, path in ((RunRecord, os.path.join(tiny_run, RUN_FILE)), (CheckpointRecord, ckpt_record_path(tiny_run, 4)),
                      (ExportProvenance, os.path.join(export_dir, PROVENANCE_FILE))):
        d = dict(json.load(open(path)), peer={"steps": 3})
        rec = cls.from_dict(d, path)
        assert rec.extra == {"peer": {"steps": 3}} and rec.to_dict() == d and list(rec.to_dict()) == list(d)


def _del(key):
    def edit(d):
        *outer, last = key.split(".")
        for k in outer:
            d = d[k]
        del d[last]
    return edit


def _set(key, value):
    def edit(d):
        *outer, last = key.split(".")
        for k in outer:
            d = d[k]
        d[last] = value
    return edit


@pytest.mark.parametrize("cls, which, edit, match", [
    (RunRecord, "run", _del("drafter"), r"run\.json: lacks key 'drafter'"),
    (RunRecord, "run", _del("target"), r"run\.json: lacks key 'target'"),
    (RunRecord, "run", _del("capture.hidden_state_indices"), r"run\.json: lacks key 'capture\.hidden_state_indices'"),
    (RunRecord, "run", _set("target.num_hidden_layers", "6"),
     r"run\.json: key 'target\.num_hidden_layers' holds str '6', expected int"),
    (RunRecord, "run", _set("world_size", True), r"run\.json: key 'world_size' holds bool"),
    (RunRecord, "run", _set("format", "other"), r"run\.json: not an eagle3 training run \(format='other'\)"),
    (CheckpointRecord, "ckpt", _del("step"), r"eagle3_checkpoint\.json: lacks key 'step'"),
    (CheckpointRecord, "ckpt", _set("step", "4"), r"eagle3_checkpoint\.json: key 'step' holds str '4', expected int"),
    (CheckpointRecord, "ckpt", _set("sha256", []), r"eagle3_checkpoint\.json: key 'sha256' holds list"),
    (CheckpointRecord, "ckpt", _set("capture.hidden_state_indices", [1, "3", 4]),
     r"eagle3_checkpoint\.json: key 'capture\.hidden_state_indices' holds list .*expected list of integers"),
    (ExportProvenance, "prov", _del("engine"), r"eagle3_provenance\.json: lacks key 'engine'"),
    (ExportProvenance, "prov", _set("target", [6]), r"eagle3_provenance\.json: key 'target' is not a JSON object"),
    (ExportProvenance, "prov", _set("needs_disable_cuda_graph", "no"),
     r"eagle3_provenance\.json: key 'needs_disable_cuda_graph' holds str 'no', expected bool"),
    (ExportProvenance, "prov", _set("format_version", 2), r"eagle3_provenance\.json: not an eagle3-export v1"),
])
def test_from_dict_names_the_file_and_the_key(tiny_run, export_dir, tmp_path, cls, which, edit, match):
    src = {"run": os.path.join(tiny_run, RUN_FILE), "ckpt": ckpt_record_path(tiny_run, 4),
           "prov": os.path.join(export_dir, PROVENANCE_FILE)}[which]
    d = json.load(open(src))
    edit(d)
    path = str(tmp_path / os.path.basename(src))
    json.dump(d, open(path, "w"))
    with pytest.raises(C.ContractError, match=match) as e:
        cls.read(path)
    assert path in str(e.value)
    with pytest.raises(C.ContractError, match=match):  # from_dict alone names the file it is told
        cls.from_dict(d, os.path.basename(src))


def test_readers_refuse_a_malformed_record_naming_it(tiny_run, export_dir, tmp_path):
    """The export and the export's reader fail with the file and the key, not a KeyError deep inside."""
    from eagle3.export.sglang import export_drafter
    from eagle3.model.checkpoint import load_export
    run = tmp_path / "run"
    os.makedirs(run / "checkpoints" / "step00000004")
    shutil.copy(os.path.join(tiny_run, RUN_FILE), run)
    shutil.copy(os.path.join(tiny_run, "checkpoints", "step00000004", "drafter.safetensors"),
                run / "checkpoints" / "step00000004")
    d = json.load(open(ckpt_record_path(tiny_run, 4)))
    del d["target"]["hidden_size"]
    json.dump(d, open(ckpt_record_path(str(run), 4), "w"))
    with pytest.raises(C.ContractError, match=r"step00000004/eagle3_checkpoint\.json: lacks key 'target\.hidden_size'"):
        export_drafter(str(run), str(tmp_path / "out"))

    bad = str(tmp_path / "export")
    shutil.copytree(export_dir, bad)
    path = os.path.join(bad, PROVENANCE_FILE)
    d = json.load(open(path))
    del d["target"]["num_hidden_layers"]
    json.dump(d, open(path, "w"))
    with pytest.raises(C.ContractError, match=r"eagle3_provenance\.json: lacks key 'target\.num_hidden_layers'"):
        load_export(bad)


def test_find_checkpoint_lives_with_the_records(tiny_run):
    assert find_checkpoint(tiny_run) == (os.path.join(tiny_run, "checkpoints", "step00000004"), 4)
    assert find_checkpoint(tiny_run, 2)[1] == 2
    with pytest.raises(FileNotFoundError, match="no complete checkpoints/best"):
        find_checkpoint(tiny_run, "best")


def test_export_and_eval_do_not_import_the_trainer():
    code = ("import sys, eagle3.export.sglang, eagle3.eval.speculative; "
            "assert 'eagle3.train.trainer' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
