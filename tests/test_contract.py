import pytest

from eagle3 import contract as C
from eagle3 import presets


def test_default_rule_kimi_and_general():
    assert C.default_capture_indices(61) == [3, 31, 59]   # outputs of layers 2, 30, 58
    assert C.default_capture_indices(32) == [3, 17, 30]
    assert C.default_capture_indices(30) == [3, 16, 28]


@pytest.mark.parametrize("bad, msg", [([0, 3], "out of range"), ([3, 61], "out of range"), ([], "no capture"),
                                      ([3, 3], "repeat"), ([3.0], "integers")])
def test_validate_refuses(bad, msg):
    with pytest.raises(C.ContractError, match=msg):
        C.validate_indices(bad, 61)


def test_validate_sorts_ascending():
    assert C.validate_indices([59, 3, 31], 61) == [3, 31, 59]


def test_parse_indices():
    assert C.parse_indices("3, 31,59") == [3, 31, 59]
    with pytest.raises(C.ContractError):
        C.parse_indices("3,x")


def _manifest(indices=(3, 31, 59)):
    return C.DumpManifest(
        target=C.TargetInfo("/t", "DeepseekV3ForCausalLM", 61, 7168, 129280, "abc"),
        capture=C.CaptureSpec(list(indices)), tokenizer=C.TokenizerInfo("t", "c"), dtype="bfloat16",
        max_length=2048, tp_size=8, dp_size=1,
        shards=[C.ShardRecord("shard-00000.safetensors", 2, 10, 100, "ff")], skipped={"empty": 1})


def test_manifest_round_trip_and_totals():
    m = _manifest()
    d = m.to_dict()
    assert d["totals"] == {"shards": 1, "samples": 2, "tokens": 10, "bytes": 100, "skipped": 1}
    assert C.DumpManifest.from_dict(d).to_dict() == d


def test_manifest_refuses_bad_version_and_indices():
    d = _manifest().to_dict()
    with pytest.raises(C.ContractError, match="version"):
        C.DumpManifest.from_dict(dict(d, format_version=99))
    with pytest.raises(C.ContractError, match="out of range"):
        C.DumpManifest.from_dict(dict(d, capture={"hidden_state_indices": [0, 3], "convention": "x"}))
    with pytest.raises(C.ContractError, match="ascending"):
        C.DumpManifest.from_dict(dict(d, capture={"hidden_state_indices": [31, 3], "convention": "x"}))


def test_require_same_capture_names_every_difference():
    a, b = _manifest().identity(), _manifest((2, 30, 58)).identity()
    C.require_same_capture(a, a, "x", "y")
    with pytest.raises(C.ContractError, match=r"capture.hidden_state_indices: \[3, 31, 59\]"):
        C.require_same_capture(a, b, "dump A", "dump B")


def test_config_hash_ignores_location_and_dtype():
    base = {"hidden_size": 8, "num_hidden_layers": 2, "_name_or_path": "/a", "dtype": "float32"}
    assert C.config_hash(base) == C.config_hash(dict(base, _name_or_path="/b", dtype="bfloat16"))
    assert C.config_hash(base) != C.config_hash(dict(base, hidden_size=16))


@pytest.mark.parametrize("name", presets.available("targets"))
def test_target_presets_follow_the_default_rule(name):
    p = presets.load("targets", name)
    L = p["expect"]["num_hidden_layers"]
    assert C.validate_indices(p["dump"]["layers"], L) == C.default_capture_indices(L)


def test_kimi_preset_captures_3_31_59():
    assert presets.load("targets", "kimi-k2.5")["dump"]["layers"] == [3, 31, 59]


def test_layer_for_index_is_the_one_hf_index_to_layer_rule():
    assert [C.layer_for_index(k) for k in (1, 3, 31, 59)] == [0, 2, 30, 58]
    for bad in (0, -1, True, 2.0):
        with pytest.raises(C.ContractError):
            C.layer_for_index(bad)
    assert C.describe([3]) == "HF 3 (output of layer 2)"
