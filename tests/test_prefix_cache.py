"""Prefix caching: the post's shared prefix and the PrefixCache store give exactly the tokens of
generation without them; the block hash chain; LRU eviction; the fallback past the window."""
import pytest
import torch
from conftest import TINY, renders_on_its_page

from gptlite_kvcache import StaticKVCache, generate_kvcache
from lib import harness, training
from lib.prefix_cache import PrefixCache, chain_keys, fork_static_cache

SEQLEN = TINY["seqlen"]  # 16
BS = 4  # blocks of 4 tokens: several blocks fit the tiny model's 16-token window


def random_tokens(*shape, seed=1):
    return torch.randint(TINY["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


def reference(model, prompt, n_tokens):
    """Generation without any prefix reuse, on the window generate_kvcache accepts."""
    return generate_kvcache(model, prompt[None, -SEQLEN:], n_tokens, SEQLEN)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_post_experiment_same_tokens_and_the_shared_cache_is_never_modified(tiny_models, kind):
    _, model = tiny_models
    prefix, requests = random_tokens(2, 8), [random_tokens(2, 4, seed=s) for s in (2, 3, 4)]
    if kind == "dynamic":
        _, shared = model(prefix)
        before = [(k.clone(), v.clone()) for k, v in shared]
    else:
        shared = StaticKVCache.for_model(model, 2)
        generate_kvcache(model, prefix, 1, SEQLEN, kv_cache=shared)  # fills the prefix, then one token
        shared.n_tokens = prefix.shape[1]  # keep only the prefix's entries
        before = (shared.keys.clone(), shared.values.clone())
    for request in requests:  # 8 + 4 + 6 new tokens run past the 16-token window: still identical
        cache = shared if kind == "dynamic" else fork_static_cache(shared)
        tokens = generate_kvcache(model, request, 6, SEQLEN, kv_cache=cache)  # the request, then its tokens
        expected = generate_kvcache(model, torch.cat([prefix, request], dim=1), 6, SEQLEN)
        assert torch.equal(tokens, expected[:, prefix.shape[1]:])
    if kind == "dynamic":
        assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(shared, before))
    else:
        assert torch.equal(shared.keys, before[0]) and torch.equal(shared.values, before[1])
        assert shared.n_tokens == prefix.shape[1]


def test_the_posts_listing_one_request_at_a_time_equals_the_full_prompt(tiny_models):
    from main_prefix_cache import no_prefix_caching, prefix_caching
    _, model = tiny_models
    prefix, requests = random_tokens(1, 7), [random_tokens(n, seed=n) for n in (3, 5, 2)]
    with torch.no_grad():
        cached = prefix_caching(model, prefix, requests, 5, SEQLEN)
        plain = no_prefix_caching(model, prefix, requests, 5, SEQLEN)
    for request, c, p in zip(requests, cached, plain):
        assert c.shape == (1, len(request) + 5) and torch.equal(c[0, :len(request)], request)
        assert torch.equal(p[:, :7], prefix) and torch.equal(c, p[:, 7:])
        # independent reference: one token at a time, re-encoding the whole prompt each step
        sequence = torch.cat([prefix[0], request])
        for _ in range(5):
            sequence = torch.cat([sequence, model(sequence[None])[0][0, -1].argmax()[None]])
        assert torch.equal(p[0], sequence)


def test_a_static_prefix_cache_used_in_place_would_be_modified(tiny_models):
    """Why fork_static_cache exists: without the copy the first request overwrites the shared slots."""
    _, model = tiny_models
    prefix = random_tokens(1, 8)
    shared = StaticKVCache.for_model(model, 1)
    model(prefix, kv_cache=shared)
    fork = fork_static_cache(shared)
    assert torch.equal(fork.keys[:, :, :, :8], shared.keys[:, :, :, :8]) and fork.n_tokens == 8
    keys = shared.keys.clone()
    generate_kvcache(model, random_tokens(1, 4, seed=5), 3, SEQLEN, kv_cache=shared)
    assert not torch.equal(shared.keys, keys)


def test_store_reuses_the_longest_prefix_and_gives_identical_tokens(tiny_models):
    _, model = tiny_models
    store = PrefixCache(model, block_size=BS, capacity_tokens=64)
    system = random_tokens(9)  # two full blocks and one token
    for i, question in enumerate(random_tokens(3, 3, seed=7)):
        prompt = torch.cat([system, question])  # 12 tokens: 3 blocks, at most 2 reusable (one left to prefill)
        out = store.generate(prompt, 3, SEQLEN)
        assert torch.equal(out.tokens, reference(model, prompt, 3))
        assert out.hit_tokens == (0 if i == 0 else 2 * BS) and not out.fallback
    stats = store.stats()
    assert stats["requests"] == 3 and stats["hit_tokens"] == 16 and stats["prompt_tokens"] == 36
    assert stats["hit_rate"] == pytest.approx(16 / 36) and stats["evictions"] == 0
    assert stats["cache_bytes"] == store.nbytes == len(store) * TINY["n_layers"] * 2 * TINY["n_heads"] * BS * TINY["d_head"] * 4


def test_multi_turn_conversation_prefills_only_the_new_message(tiny_models):
    _, model = tiny_models
    store = PrefixCache(model, block_size=BS, capacity_tokens=64)
    prompt, n_answer = random_tokens(3), 4
    hits = []
    for turn, message in enumerate(random_tokens(3, 3, seed=11)):
        if turn > 0:
            prompt = torch.cat([conversation, message])
        out = store.generate(prompt, n_answer, SEQLEN)
        assert torch.equal(out.tokens, reference(model, prompt, n_answer)), f"turn {turn}"
        conversation = out.tokens[0]  # the prompt (its last seqlen tokens) and the answer
        hits.append(out.hit_tokens)
    # turn 2 prompt: 3 + 4 + 3 = 10 tokens; the store holds turn 1's prompt and answer but its last
    # token (6 tokens: 1 block); turn 3 prompt: 17 > 16 tokens, the window is kept: fallback
    assert hits == [0, BS, 0]
    assert store.stats()["fallbacks"] == 1 and store.stats()["requests"] == 3 and store.stats()["lookups"] == 2


def test_generated_tokens_are_stored_and_hit_on_the_next_turn(tiny_models):
    _, model = tiny_models
    store = PrefixCache(model, block_size=BS, capacity_tokens=64)
    prompt = random_tokens(5)
    first = store.generate(prompt, 7, SEQLEN).tokens[0]  # prompt + answer; the cache holds 5 + 6 = 11 tokens
    assert len(store) == 2 and torch.equal(first[:5], prompt)
    follow_up = torch.cat([first, random_tokens(2, seed=3)])  # 14 tokens
    out = store.generate(follow_up, 2, SEQLEN)
    assert out.hit_tokens == 2 * BS  # the second block is made of generated tokens
    assert torch.equal(out.tokens, reference(model, follow_up, 2))


def test_hash_chain_same_prefix_same_chain_and_an_early_difference_misses_every_later_block(tiny_models):
    tokens = random_tokens(16).tolist()
    keys = chain_keys(tokens, BS)
    assert len(keys) == 4 and keys == chain_keys(list(tokens), BS) and len(set(keys)) == 4
    assert chain_keys(tokens + [1, 2], BS) == keys  # a partial block has no key
    changed = [tokens[0], (tokens[1] + 1) % 65] + tokens[2:]
    assert all(a != b for a, b in zip(keys, chain_keys(changed, BS)))
    # the same block of tokens after another parent is another block
    assert chain_keys(tokens[4:8], BS)[0] != keys[1]

    _, model = tiny_models
    store = PrefixCache(model, block_size=BS, capacity_tokens=64)
    prompt = torch.tensor(tokens[:13])
    store.generate(prompt, 2, SEQLEN)
    assert store.generate(prompt, 2, SEQLEN).hit_tokens == 3 * BS
    other = torch.tensor(changed[:13])
    out = store.generate(other, 2, SEQLEN)
    assert out.hit_tokens == 0 and torch.equal(out.tokens, reference(model, other, 2))
    later = torch.tensor(tokens[:12] + [(tokens[12] + 1) % 65])  # differs in the last token only
    assert store.generate(later, 2, SEQLEN).hit_tokens == 3 * BS


def fill(store, tokens):
    """Insert a chain as a finished request would, and release it."""
    _, cache = store.model(torch.tensor(tokens)[None])
    store.release(store.insert(tokens, cache))


def test_lru_evicts_least_recently_used_unreferenced_blocks_first_and_never_one_in_use(tiny_models):
    _, model = tiny_models
    store = PrefixCache(model, block_size=BS, capacity_tokens=4 * BS)
    a, b, c = (random_tokens(2 * BS, seed=s).tolist() for s in (20, 21, 22))
    fill(store, a)
    fill(store, b)
    assert len(store) == 4
    store.release(store.lookup(a))  # a is now more recent than b
    fill(store, c)  # needs 2 blocks: b's go, leaf first
    assert store.stats()["evictions"] == 2
    assert len(store.lookup(b, touch=False)) == 0
    assert [len(store.lookup(x)) for x in (a, c)] == [2, 2]  # held now: referenced
    d = random_tokens(2 * BS, seed=23).tolist()
    chain = store.insert(d, model(torch.tensor(d)[None])[1])
    assert chain == [] and store.stats()["not_stored"] == 2  # every block in use: d is not stored
    assert len(store) == 4 and store.stats()["evictions"] == 2


def test_lru_evicts_a_leaf_before_its_parent(tiny_models):
    _, model = tiny_models
    store = PrefixCache(model, block_size=BS, capacity_tokens=3 * BS)
    a, b = random_tokens(2 * BS, seed=30).tolist(), random_tokens(BS, seed=31).tolist()
    fill(store, a)
    fill(store, b)
    fill(store, random_tokens(BS, seed=32).tolist())  # evicts a's second block, not its first
    assert len(store.lookup(a, touch=False)) == 1


def test_update_false_leaves_the_store_as_it_was(tiny_models):
    _, model = tiny_models
    store = PrefixCache(model, block_size=BS, capacity_tokens=64)
    prompt = random_tokens(12)
    store.generate(prompt, 2, SEQLEN)
    fill(store, random_tokens(BS, seed=9).tolist())
    order, stats = list(store.blocks), store.stats()
    out = store.generate(torch.cat([prompt[:9], random_tokens(3, seed=4)]), 2, SEQLEN, update=False)
    assert out.hit_tokens == 2 * BS
    assert list(store.blocks) == order and store.stats() == stats
    assert all(block.ref_count == 0 for block in store.blocks.values())


def test_bad_input_is_a_clear_error(tiny_models):
    _, model = tiny_models
    with pytest.raises(ValueError, match="block_size"):
        PrefixCache(model, block_size=0)
    with pytest.raises(ValueError, match="capacity_tokens"):
        PrefixCache(model, block_size=16, capacity_tokens=8)
    store = PrefixCache(model, block_size=BS)
    with pytest.raises(ValueError, match="one request at a time"):
        store.generate(random_tokens(2, 5), 2)
    with pytest.raises(ValueError, match="seqlen"):
        store.generate(random_tokens(5), 2, seqlen=SEQLEN + 1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        store.generate(torch.tensor([1, 2, 99]), 2)
    with pytest.raises(ValueError, match="n_tokens"):
        store.generate(random_tokens(5), 0)
    assert store.stats()["requests"] == 0


# ----------------------------------------------------------------------------------------------------
# main_prefix_cache.py end to end on random weights, and its flags.

def test_main_prefix_cache_runs_checks_and_saves_json_and_plot(real_data, tmp_path, capsys, monkeypatch):
    import json

    import inference_utils as iu
    import main_prefix_cache

    # the standard evaluation (20 batches of 32 x 128) takes seconds and has its own tests; the script
    # only reports it, the same for every row
    monkeypatch.setattr(training, "validation_loss", lambda model, data: 4.2)
    out_json, out_png = tmp_path / "pc.json", tmp_path / "pc.png"
    main_prefix_cache.main(["--untrained", "--device", "cpu", "--prefix-len", "32", "--request-len", "8",
                            "--n-tokens", "4", "--batch-sizes", "1", "2", "--n-requests", "3", "--turns", "3",
                            "--repeats", "1", "--json", str(out_json), "--sweep", "--plot", str(out_png)])
    printed = capsys.readouterr().out
    assert "fallback to plain generation (no reuse), counted (fallbacks: 1)" in printed and "meaningless" in printed
    result = json.loads(out_json.read_text())
    rows = result["rows"]
    assert result["script"] == "main_prefix_cache.py" and result["untrained"]
    assert all(r["same_tokens"] == "yes" for r in rows)
    assert [r["workload"] for r in rows] == (["post, 32+8"] * 6 + ["system prompt + question"] * 2
                                             + ["one early token differs"] * 2
                                             + [f"multi-turn, turn {t}" for t in (1, 2, 3) for _ in range(2)])
    post = [r for r in rows if r["workload"] == "post, 32+8" and r["variant"] != "no prefix cache"]
    assert all(r["hit_tokens"] == 32 and r["prompt_tokens"] == 40 for r in post)
    assert [r["hit_tokens"] for r in rows if r["variant"] == "PrefixCache store"] == [32, 0, 0, 0, 16]
    # turn 2: 8 + 4 + 8 = 20 tokens; the store holds turn 1's 8 + 3 = 11 tokens: no full block of 16
    # turn 3: 32 tokens; the store holds turn 2's 20 + 3 = 23: one block (16), at most 1 of the 31 reusable
    assert result["multi_turn_stats"]["hit_tokens"] == 16 and result["system_prompt_stats"]["hit_tokens"] == 32
    assert all(r["kv_cache_mb"] is None for r in rows if r["variant"] == "no prefix cache")
    assert all(r["ttft_ms"] > 0 and r["peak_mem_mb"] > 0 for r in rows)
    assert set(result["ttft_sweep"]) == {"1", "2"} and result["ttft_sweep"]["2"]["prefix_len"][-1] == 120
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["headline"]["technique"] == "prefix caching, 32-token prefix + 8-token requests"
    assert result["headline"]["figure"].startswith("TTFT without / with the post's cache: ")
    assert "at batch 2, " in result["headline"]["figure"] and "store" in result["headline"]["figure"]
    renders_on_its_page("main_prefix_cache", result)


SMALL = ["--untrained", "--device", "cpu", "--prefix-len", "16", "--request-len", "8", "--n-tokens", "2",
         "--batch-sizes", "1", "--n-requests", "2", "--turns", "2", "--repeats", "1"]


def test_main_prefix_cache_plot_never_changes_the_json(real_data, tmp_path, monkeypatch):
    import json

    import main_prefix_cache
    monkeypatch.setattr(training, "validation_loss", lambda model, data: 4.2)
    main_prefix_cache.main(SMALL + ["--sweep", "--json", str(tmp_path / "a.json")])
    main_prefix_cache.main(SMALL + ["--sweep", "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")])
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    assert a.keys() == b.keys() and a["ttft_sweep"].keys() == b["ttft_sweep"].keys()
    timed = ("ttft_ms", "tpot_ms", "tokens_per_s", "peak_mem_mb", "ttft_speedup")
    assert [{k: v for k, v in r.items() if k not in timed} for r in a["rows"]] == \
        [{k: v for k, v in r.items() if k not in timed} for r in b["rows"]]
    assert a["multi_turn_stats"] == b["multi_turn_stats"] and a["ttft_sweep"]["1"]["prefix_len"] == \
        b["ttft_sweep"]["1"]["prefix_len"]


def test_main_prefix_cache_tokens_that_differ_stop_it_before_anything_is_timed_or_written(real_data, tmp_path,
                                                                                          monkeypatch):
    import inference_utils as iu
    import main_prefix_cache
    right = main_prefix_cache.generate_kvcache

    def wrong(model, prompt, n, seqlen, kv_cache=None):  # a cache bug: from a cache, the last token is off by one
        tokens = right(model, prompt, n, seqlen, kv_cache=kv_cache).clone()
        if kv_cache is not None:
            tokens[:, -1] = (tokens[:, -1] + 1) % model.fc_out.out_features
        return tokens
    monkeypatch.setattr(main_prefix_cache, "generate_kvcache", wrong)
    monkeypatch.setattr(iu, "compare_generation", lambda *a, **k: pytest.fail("nothing is timed after a failed check"))
    with pytest.raises(harness.GPTliteError, match="checks failed: the post's listing"):
        main_prefix_cache.main(SMALL + ["--json", str(tmp_path / "r.json")])
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("flags, flag", [(["--batch-sizes", "1000000000000"], "--batch-sizes"),
                                         (["--n-requests", "1000000000000"], "--n-requests"),
                                         (["--turns", "1000000000000"], "--turns"),
                                         (["--n-tokens", "1000000000000"], "--n-tokens")])
def test_main_prefix_cache_size_flags_beyond_the_machine_are_parser_errors(flags, flag, capsys, monkeypatch):
    import main_prefix_cache
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_prefix_cache.main(["--untrained", "--device", "cpu", "--preset", "cpu"] + flags)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {flag}:" in err and "give a smaller value" in err


@pytest.mark.parametrize("flags", [["--prefix-len", "0"], ["--prefix-len", "120", "--request-len", "16"],
                                   ["--n-tokens", "1"], ["--turns", "1"], ["--n-requests", "1"],
                                   ["--batch-sizes", "2", "2"], ["--block-size", "0"], ["--block-size", "256"],
                                   ["--capacity-tokens", "8"], ["--repeats", "0"], ["--plot", "x.txt"], ["--bogus"],
                                   ["--plot", "p.png"]])
def test_main_prefix_cache_bad_flags_are_errors_before_any_work(flags, capsys, monkeypatch):
    import inference_utils as iu
    import main_prefix_cache
    monkeypatch.setattr(harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        main_prefix_cache.main(["--untrained", "--device", "cpu"] + flags)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err
