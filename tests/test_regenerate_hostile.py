"""Regeneration against broken and hostile servers (issue 30, items 2, 4 and the regenerate flags of 5): a real
HTTP server process on localhost (fake_openai_server.py --hostile MODE) answers badly; every bad answer is that
conversation's recorded error, workers never die, every request is bounded as a whole, a run that failed says so
with a non-zero result, text cut inside a character is not stored, and a directory that is refused is left as it
was found."""

import json
import os
import threading
import time

import pytest

from eagle3.records import REGENERATE_FILE
from eagle3.regenerate.files import CONFIG_FILE, CONVERSATIONS, ERRORS
from eagle3.regenerate.record import check_record
from test_regenerate import chats, fake_server, read_jsonl, regen  # noqa: F401 (fixture)


def bounded(fn, seconds: float):
    """fn() in a thread; fails the test (instead of hanging it) when fn has not returned within `seconds`."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s: the run hangs"
    if "error" in box:
        raise box["error"]
    return box["value"], time.monotonic() - t0


MALFORMED = ["not-json", "no-message", "list-content", "number-content", "string-usage", "no-choices"]


@pytest.mark.parametrize("mode", MALFORMED)
def test_every_malformed_answer_is_an_error_and_the_run_ends(chats, tmp_path, mode):  # noqa: F811
    """More conversations (10) than workers (2): before, one such answer killed a worker and the run hung in
    queue.join(), or ended 'complete' with conversations silently pending."""
    with fake_server("--hostile", mode) as url:
        rec, _ = bounded(lambda: regen(chats, tmp_path / "out", servers=[url], concurrency=2, retries=1,
                                       retry_backoff=0.0), 120)
    errors = read_jsonl(tmp_path / "out" / ERRORS)
    assert rec["counts"]["pending"] == 0 and rec["counts"]["conversations"] == 0
    assert len(errors) == rec["counts"]["read"] == 10
    assert all("malformed" in e["error"] or "not JSON" in e["error"] for e in errors), errors[0]
    assert rec["status"] == "failed"
    problem = check_record(rec)
    assert problem and "10 of 10 conversations failed" in problem


def test_some_bad_answers_among_good_ones_and_the_error_rate(chats, tmp_path):  # noqa: F811
    """Every 3rd request a list where text belongs: those conversations are errors (kind server: a rerun retries
    them), the rest written; under --max-error-rate the run is 'incomplete' (rerun to retry), over it 'failed'."""
    with fake_server("--hostile", "list-content", "--every", "3") as url:
        rec, _ = bounded(lambda: regen(chats, tmp_path / "out", servers=[url], concurrency=2, retries=0,
                                       max_error_rate=0.6), 120)
    convs = read_jsonl(tmp_path / "out" / CONVERSATIONS)
    errors = read_jsonl(tmp_path / "out" / ERRORS)
    assert len(convs) + len(errors) == 10 and errors and convs
    assert all(isinstance(m["content"], str) for c in convs for m in c["messages"])
    assert rec["status"] == "incomplete" and "rerun the same command to retry them" in check_record(rec)
    strict = dict(rec, max_error_rate=0.0)
    assert "conversations failed" in check_record(strict)
    with fake_server() as url:  # a rerun against a sound server retries exactly the failed ones
        again, _ = bounded(lambda: regen(chats, tmp_path / "out", servers=[url], retries=0, max_error_rate=0.6), 120)
    assert again["this_run"]["conversations"] == len(errors) and again["status"] == "complete"
    assert check_record(again) is None


def test_every_request_refused_ends_failed_not_complete(chats, tmp_path):  # noqa: F811
    with fake_server("--hostile", "refuse") as url:
        rec, _ = bounded(lambda: regen(chats, tmp_path / "out", servers=[url], retries=0), 120)
    assert rec["counts"]["conversations"] == 0 and rec["status"] == "failed"
    assert "HTTP 400" in read_jsonl(tmp_path / "out" / ERRORS)[0]["error"]
    assert "10 of 10" in check_record(rec)


def test_timeout_bounds_a_whole_request_and_the_probe(chats, tmp_path):  # noqa: F811
    """A server that sends its answer one byte a second: each read is quick, so the client's own timeout never
    fires; --timeout 2 must end each attempt after 2 s."""
    with fake_server("--hostile", "trickle") as url:
        rec, took = bounded(lambda: regen(chats, tmp_path / "out", servers=[url], num_samples=4, concurrency=4,
                                          retries=0, timeout=2.0), 60)
    assert took < 30 and rec["counts"]["errors"] == 4
    assert all("within --timeout 2 s" in e["error"] for e in read_jsonl(tmp_path / "out" / ERRORS))
    from eagle3.regenerate.server_client import ServerError
    with fake_server("--hostile", "trickle-models") as url:
        with pytest.raises(ServerError, match="no whole answer within 2 s"):
            bounded(lambda: regen(chats, tmp_path / "probe", servers=[url], timeout=2.0), 60)


def test_an_answer_cut_inside_a_character_is_not_stored_with_a_replacement_char(chats, tmp_path):  # noqa: F811
    with fake_server("--hostile", "cut-utf8") as url:
        rec, _ = bounded(lambda: regen(chats, tmp_path / "out", servers=[url], num_samples=2), 60)
    convs = read_jsonl(tmp_path / "out" / CONVERSATIONS)
    answers = [m["content"] for c in convs for m in c["messages"] if m["role"] == "assistant"]
    assert answers and all(a.endswith(" caf") and "\ufffd" not in a for a in answers)


def test_hf_engine_cuts_at_a_clean_token_boundary():
    """A byte-level tokenizer whose tokens split 'é' (2 bytes) in two: an answer cut after the first half."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from eagle3.regenerate.hf_engine import HFEngine
    byte = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(byte))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk)
    ids = tok.encode("café", add_special_tokens=False)
    assert len(ids) == 5  # c a f + the two bytes of é
    assert tok.decode(ids[:4]).endswith("\ufffd")
    eng = HFEngine.__new__(HFEngine)
    eng.tokenizer = tok
    assert eng.text(ids[:4], "length") == "caf"
    assert eng.text(ids, "length") == "café"


def test_a_refused_directory_is_left_exactly_as_it_was(chats, tmp_path):  # noqa: F811
    """--out holding someone else's conversations.jsonl (its last line without a newline): before, its last line
    was cut ("dropped a cut-off last line") and a regenerate_config.json written, then the directory refused."""
    out = tmp_path / "theirs"
    out.mkdir()
    theirs = b'{"id": 1, "text": "their data"}\n{"id": 2, "text": "the last line, no newline"}'
    (out / CONVERSATIONS).write_bytes(theirs)
    with fake_server() as url:
        with pytest.raises(ValueError, match="not a regenerate record"):
            regen(chats, out, servers=[url])
    assert (out / CONVERSATIONS).read_bytes() == theirs
    assert sorted(os.listdir(out)) == [CONVERSATIONS] and not (out / CONFIG_FILE).exists()


@pytest.mark.parametrize("kw,match", [(dict(timeout=float("nan")), "--timeout nan must be a finite number"),
                                      (dict(timeout=0.0), "--timeout 0.0 must be"),
                                      (dict(retry_backoff=-1.0), "--retry-backoff -1.0 must be"),
                                      (dict(retries=-1), "--retries -1 must be >= 0"),
                                      (dict(max_error_rate=1.5), "--max-error-rate 1.5 must be in")])
def test_server_flags_are_checked_before_anything(chats, tmp_path, kw, match):  # noqa: F811
    with pytest.raises(ValueError, match=match):
        regen(chats, tmp_path / "out", servers=["http://127.0.0.1:9/v1"], **kw)
    assert not (tmp_path / "out").exists()


def test_record_of_a_failed_run_is_written(chats, tmp_path):  # noqa: F811
    with fake_server("--hostile", "number-content") as url:
        bounded(lambda: regen(chats, tmp_path / "out", servers=[url], num_samples=3, retries=0), 60)
    rec = json.loads((tmp_path / "out" / REGENERATE_FILE).read_text())
    assert rec["status"] == "failed" and rec["counts"]["errors"] == 3
