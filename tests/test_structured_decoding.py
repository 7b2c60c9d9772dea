"""Structured decoding: the grammar mask, constrained greedy decoding against a reference written here
(the full forward pass, one character at a time, the allowed set found by asking the engine to accept
each character), jump-forward identical, outputs accepted, the loss under the mask, bad input."""
import json
import re

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, renders_on_its_page

import inference_utils as iu
import main_structured_decoding as msd
from gptlite import GPTlite
from gptlite_kvcache import GPTlite_KVCache, generate_kvcache
from lib import corpus
from lib import structured_decoding as sd
from lib.errors import GPTliteError

VOCAB = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # tiny Shakespeare's 65
SPEAKERS = ["KING", "KATE", "GREMIO"]


@pytest.fixture
def models():
    """The same random weights, N(0, 0.5) as in conftest, in GPTlite and GPTlite_KVCache; a 64 window."""
    torch.manual_seed(0)
    config = {**TINY, "seqlen": 64}
    base = GPTlite(**config).eval()
    with torch.no_grad():
        for p in base.parameters():
            p.normal_(0.0, 0.5)
    cached = GPTlite_KVCache(**config).eval()
    cached.load_state_dict(base.state_dict())
    return base, cached


def grammars():
    return {"turn": sd.CharGrammar(sd.turn_grammar(SPEAKERS, max_lines=2, max_line_chars=8), VOCAB),
            "direction": sd.CharGrammar(sd.stage_direction_grammar(SPEAKERS), VOCAB),
            "reply": sd.CharGrammar(sd.reply_regex(SPEAKERS, max_chars=10), VOCAB, kind="regex")}


def allowed_reference(matcher):
    """The characters the engine accepts next, one at a time on a copy of the matcher (not the bitmask)."""
    return {i for i in range(len(VOCAB)) if matcher.fork().accept_token(i)}


@torch.inference_mode()
def reference_generate(base, prompt, grammar, max_chars):
    """Greedy constrained decoding by the full forward pass: argmax over the allowed characters."""
    matcher, out = grammar.matcher(), []
    while not matcher.is_terminated() and len(out) < max_chars:
        logits = base(torch.tensor([prompt + out]))[0, -1]  # [vocab]
        allowed = sorted(allowed_reference(matcher))
        out.append(allowed[int(logits[allowed].argmax())])
        assert matcher.accept_token(out[-1])
    return out


def test_mask_is_the_engines_allowed_set_at_every_step():
    g = grammars()["turn"]
    text = "KATE:\nAy me\nSo\n\n"
    matcher, bitmask = g.matcher(), g.new_bitmask()
    along = g.mask_logits_along(torch.zeros(len(text), len(VOCAB)), text)
    for j, c in enumerate(text):
        logits = g.mask_logits(matcher, torch.zeros(1, len(VOCAB)), bitmask)
        expected = allowed_reference(matcher)
        assert set((logits[0] == 0).nonzero().flatten().tolist()) == expected
        assert set((along[j] == 0).nonzero().flatten().tolist()) == expected
        assert torch.isinf(logits[0]).sum() == len(VOCAB) - len(expected)
        assert matcher.accept_string(c)
    assert matcher.is_terminated()
    assert {VOCAB[i] for i in allowed_reference(g.matcher())} == {"K", "G"}  # a speaker's first letter


@pytest.mark.parametrize("name", ["turn", "direction", "reply"])
def test_constrained_decoding_matches_the_reference_and_jump_forward(models, name):
    base, cached = models
    g = grammars()[name]
    for seed in range(3):
        prompt = torch.randint(len(VOCAB), (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        expected = reference_generate(base, prompt, g, max_chars=40)
        masked = msd.constrained_generate(cached, torch.tensor([prompt]), g, 40, 64)
        jumped = msd.constrained_generate(cached, torch.tensor([prompt]), g, 40, 64, jump_forward=True)
        assert masked.tokens == expected
        assert jumped.tokens == expected  # forced characters are the ones masked decoding picks
        text = "".join(VOCAB[i] for i in expected)
        assert g.accepts(text)  # the grammar is complete: decoding stopped on its own
        assert masked.calls == len(expected)  # the prefill, then one call per character but the last
        assert jumped.calls < masked.calls  # every grammar here forces characters (names, ":\n", ".\n")
        if g.python_regex is not None:
            assert g.python_regex.fullmatch(text)


def test_unconstrained_decoding_is_generate_kvcache(models):
    _, cached = models
    prompt = torch.tensor([[20, 30, 40, 1]])
    stop = lambda ids: len(ids) >= 2 and ids[-1] == 0  # a newline after the first character
    out = msd.constrained_generate(cached, prompt, None, 30, 64, stop=stop)
    assert out.tokens == generate_kvcache(cached, prompt, len(out.tokens), 64)[0, 4:].tolist()
    assert len(out.tokens) == 30 or stop(out.tokens)
    assert out.calls == len(out.tokens)  # the prefill, then one forward pass per character but the last


def test_grammar_loss_renormalizes_over_the_allowed_characters(models):
    base, _ = models
    turn = "KATE:\nAy me\n\n"
    context = "So\nthe end of it\n\n" * 4
    val = torch.tensor([VOCAB.index(c) for c in context + turn])
    data = corpus.Data(vocab=VOCAB, train=val, val=val)
    task = msd.Task("turn", grammars()["turn"], r"\n\n", [(len(context), turn)])
    with torch.inference_mode():
        logits = base(val[None, -65:-1])[0, -len(turn):]  # [len, vocab]: the window that ends with the turn
    targets = val[-len(turn):]
    matcher, expected = task.grammar.matcher(), 0.0
    for j, c in enumerate(turn):
        allowed = sorted(allowed_reference(matcher))
        expected -= torch.log_softmax(logits[j, allowed], dim=-1)[allowed.index(int(targets[j]))].item()
        matcher.accept_string(c)
    assert msd.grammar_loss(base, task, data, 64, masked=True) == pytest.approx(expected / len(turn), abs=1e-5)
    assert msd.grammar_loss(base, task, data, 64, masked=False) == pytest.approx(
        F.cross_entropy(logits, targets).item(), abs=1e-5)
    assert msd.grammar_loss(base, msd.Task("none", task.grammar, "", []), data, 64, masked=True) is None


def test_grammar_characters_reads_literals_classes_and_escapes():
    printed = r'root ::= (("a\"b" [x-z\n] [^\n{] "\x41" [\-q]))'
    assert sd.grammar_characters(printed) == {"a", '"', "b", "x", "y", "z", "\n", "A", "-", "q"}


@pytest.mark.parametrize("source, kind", [('root ::= "KING" "{"', "ebnf"), ("root ::= [a-z{}]", "ebnf"),
                                          (r"KING: \{[a-z]+\}", "regex")])
def test_a_character_outside_the_vocabulary_is_refused(source, kind):
    with pytest.raises(ValueError, match=r"writes \['\{'.*outside GPTlite's vocabulary"):
        sd.CharGrammar(source, VOCAB, kind)


def test_bad_grammars_are_clear_errors():
    with pytest.raises(ValueError, match='does not parse: .*Rule "speaker" is not defined'):
        sd.CharGrammar("root ::= speaker", VOCAB)
    with pytest.raises(ValueError, match="kind must be 'ebnf' or 'regex'"):
        sd.CharGrammar("root ::= \"a\"", VOCAB, kind="json")
    with pytest.raises(ValueError, match="does not accept 'KX'"):
        grammars()["turn"].mask_logits_along(torch.zeros(3, len(VOCAB)), "KX:")


def test_xgrammars_cpu_kernel_writes_one_element_past_a_row_whose_last_character_is_allowed():
    """Why mask_logits unpacks XGrammar's bitmask in torch. With the pinned xgrammar (0.2.9), its CPU
    apply_token_bitmask_inplace, given a row whose last character (id 64, 'z') is allowed and the bitmask's
    padding bits (ids 65..95: 65 is not a multiple of 32) zero, as the matcher writes them, sets the element
    after the row to -inf: the next row's newline, or memory past the tensor. The same rows masked by
    mask_logits_along are right. If this test fails after an upgrade of xgrammar, the kernel was fixed:
    update lib/structured_decoding.py's mask_logits and docs/structured_decoding.md, which say so."""
    import xgrammar as xgr
    bitmask = xgr.allocate_token_bitmask(1, len(VOCAB))  # every bit set: all 96 ids allowed
    bitmask[0, 2] = 1  # ids 64 ('z') allowed, 65..95 (padding) not: what a matcher writes when 'z' may follow
    logits = torch.zeros(2, len(VOCAB))  # row 1: a guard after the masked row
    xgr.apply_token_bitmask_inplace(logits[:1], bitmask)
    assert torch.isfinite(logits[0]).all()  # the row itself is right
    assert logits[1, 0] == float("-inf") and torch.isfinite(logits[1, 1:]).all()  # one element past it

    bitmask[0, 2] = 0  # 'z' forbidden too: nothing written past the row
    logits = torch.zeros(2, len(VOCAB))
    xgr.apply_token_bitmask_inplace(logits[:1], bitmask)
    assert torch.isinf(logits[0, 64]) and torch.isfinite(logits[1]).all()

    # a matcher's own bitmask, rows where 'z' may follow: theirs spills into the next row, ours does not
    g, text = grammars()["turn"], "KATE:\nAy me\nSo\n\n"
    matcher, rows = g.matcher(), xgr.allocate_token_bitmask(len(text), len(VOCAB))
    for j, c in enumerate(text):
        matcher.fill_next_token_bitmask(rows, index=j)
        assert matcher.accept_string(c)
    z_allowed = [j for j in range(len(text)) if int(rows[j, 2]) & 1]
    assert z_allowed  # inside a line a lowercase letter may follow
    logits = torch.randn(len(text) + 1, len(VOCAB))  # the last row is a guard
    theirs, ours = logits.clone(), g.mask_logits_along(logits[:len(text)].clone(), text)
    xgr.apply_token_bitmask_inplace(theirs[:len(text)], rows)
    for j in range(len(text)):
        assert set(torch.isfinite(ours[j]).nonzero().flatten().tolist()) == allowed_reference_after(g, text[:j])
        spilled = j > 0 and j - 1 in z_allowed  # the previous row wrote into this row's newline
        assert torch.equal(theirs[j, 1:], ours[j, 1:])
        assert (theirs[j, 0] == float("-inf")) == (spilled or bool(torch.isinf(ours[j, 0])))
    assert (theirs[-1, 0] == float("-inf")) == (len(text) - 1 in z_allowed)  # past the last row


def allowed_reference_after(grammar, prefix):
    matcher = grammar.matcher()
    assert matcher.accept_string(prefix) if prefix else True
    return allowed_reference(matcher)


def shortest_by_bfs(grammar, max_depth):
    """The length of the shortest non-empty sentence, by a breadth-first walk over the characters the
    engine's bitmask allows after every prefix (every prefix kept: small grammars only); None if none
    up to max_depth."""
    import xgrammar as xgr
    frontier, bitmask = [grammar.matcher()], xgr.allocate_token_bitmask(1, len(VOCAB))
    for depth in range(1, max_depth + 1):
        following = []
        for matcher in frontier:
            matcher.fill_next_token_bitmask(bitmask)
            words = [int(w) & 0xFFFFFFFF for w in bitmask[0].tolist()]
            for token in (t for t in range(len(VOCAB)) if words[t // 32] >> (t % 32) & 1):
                child = matcher.fork()
                assert child.accept_token(token)
                if child.is_completed():
                    return depth
                following.append(child)
        frontier = following
    return None


SHORTEST = [  # (grammar, kind, the length of its shortest non-empty sentence, worked out by hand)
    ('root ::= "ab" | "c" "d" "e"', "ebnf", 2),
    ('root ::= x\nx ::= "a" x "b" | "c"', "ebnf", 1),
    ('root ::= "a"{3,5} "b"?', "ebnf", 3),
    ('root ::= "a"{2,} "b"{3}', "ebnf", 5),
    ('root ::= "" | "abc"', "ebnf", 3),  # the empty sentence does not count: decoding writes a character
    ('root ::= x y\nx ::= "" | "a"\ny ::= "" | "bb"', "ebnf", 1),
    ('root ::= [a-c]* "x"', "ebnf", 1),
    ('root ::= "q" r | "zzz"\nr ::= "q" root | "w"', "ebnf", 2),  # mutual recursion: "qw"
    ('root ::= "q" r\nr ::= "q" root | "ww"', "ebnf", 3),  # "qww"
    ("(ab|c)+d", "regex", 2),
    ("a{2,}b{0,2}", "regex", 2),
    ("[^\\x00-\\x60]{2}", "regex", 2),  # a negated class: the lower-case letters of the vocabulary
    ("(KING|KATE):\\n[A-Z]?[.!]", "regex", 7),  # "KING:\n."
]


@pytest.mark.parametrize("source, kind, length", SHORTEST)
def test_shortest_sentence_against_a_breadth_first_walk(source, kind, length):
    g = sd.CharGrammar(source, VOCAB, kind)
    assert g.min_chars == length and len(g.shortest) == length and g.accepts(g.shortest)
    assert shortest_by_bfs(g, length + 1) == length


def test_shortest_sentence_of_the_scripts_grammars():
    g = grammars()
    assert (g["turn"].min_chars, g["turn"].shortest) == (9, "KING:\n'\n\n")  # KING or KATE, a one-character line
    assert (g["direction"].min_chars, g["direction"].shortest) == (6, "Exit.\n")
    assert g["reply"].min_chars == len("KING:\nA.\n") and g["reply"].accepts(g["reply"].shortest)


@pytest.mark.parametrize("source, kind", [("", "regex"), ('root ::= ""', "ebnf"), ("()", "regex"),
                                          ("root ::= [^\\x00-\\x7f]", "ebnf"),  # all outside the vocabulary
                                          ("[^\\x00-\\x7f]+", "regex"), ('root ::= "KING" [^\\x00-\\x7f]', "ebnf"),
                                          ('root ::= x\nx ::= "a" x', "ebnf")])  # a rule that never ends
def test_a_grammar_without_a_non_empty_sentence_is_refused(source, kind):
    with pytest.raises(ValueError, match=f"the {kind} grammar .* has no non-empty sentence written with GPTlite's "
                                         "65 characters.*give it at least one sentence"):
        sd.CharGrammar(source, VOCAB, kind)


class NoModel:
    """A model that must not be called: the checks come before the prefill."""

    def __call__(self, *args, **kwargs):
        pytest.fail("the model was called: the error must come before the prefill")


def test_a_shortest_sentence_past_the_window_is_refused_before_the_prefill():
    turn = grammars()["turn"]  # shortest sentence: 9 characters
    with pytest.raises(GPTliteError, match=r"the grammar's shortest sentence \(9 characters, e.g. "
                                              r"\"KING:\\n'\\n\\n\"\) does not fit after a prompt of 60 characters in the model's window of "
                                              r"64: shorten the prompt to at most 56 characters"):
        msd.constrained_generate(NoModel(), torch.zeros(1, 60, dtype=torch.long), turn, 9, 64)


def test_max_chars_past_the_window_is_refused_before_the_prefill():
    for grammar in (None, grammars()["reply"]):
        with pytest.raises(GPTliteError, match=r"a prompt of 30 characters and max_chars=40 need 69 positions, past "
                                                  r"the model's window of 64: give max_chars of at most 35"):
            msd.constrained_generate(NoModel(), torch.zeros(1, 30, dtype=torch.long), grammar, 40, 64,
                                     stop=lambda ids: False)


def test_max_chars_below_the_shortest_sentence_is_refused_before_the_prefill():
    with pytest.raises(GPTliteError, match=r"max_chars=5 is shorter than the grammar's shortest sentence \(6 "
                                              r"characters, e.g. 'Exit.\\n'\): no output could be complete; give "
                                              r"max_chars of at least 6"):
        msd.constrained_generate(NoModel(), torch.zeros(1, 4, dtype=torch.long), grammars()["direction"], 5, 64)
    with pytest.raises(GPTliteError, match="max_chars must be an integer of at least 1"):
        msd.constrained_generate(NoModel(), torch.zeros(1, 4, dtype=torch.long), None, 0, 64, stop=lambda ids: True)


def test_a_cut_by_max_chars_says_the_output_is_incomplete(models):
    _, cached = models
    g, prompt = grammars()["turn"], torch.tensor([[20, 30, 40, 1]])
    whole = msd.constrained_generate(cached, prompt, g, 40, 64)
    text = "".join(VOCAB[i] for i in whole.tokens)
    assert whole.complete and g.accepts(text) and len(text) > 10
    cut = msd.constrained_generate(cached, prompt, g, 10, 64)
    assert cut.tokens == whole.tokens[:10]  # the same characters, stopped early
    assert not cut.complete and not g.accepts(text[:10])
    stop = lambda ids: ids[-1] == 0  # noqa: E731
    free = msd.constrained_generate(cached, prompt, None, 3, 64, stop=stop)
    assert free.complete == stop(free.tokens)


def test_an_unknown_speaker_is_refused_with_close_names():
    known = sd.corpus_speakers("PETRUCHIO:\nAy.\n\nKATHARINA:\nNo.\n\nPETRUCHIO:\nYes.\n\n")
    assert known == {"PETRUCHIO": 2, "KATHARINA": 1}
    sd.check_speakers(["KATHARINA"], known)
    with pytest.raises(ValueError, match="'PETRUCHO' never speaks.*did you mean PETRUCHIO"):
        sd.check_speakers(["KATHARINA", "PETRUCHO"], known)
    with pytest.raises(ValueError, match="at least one speaker"):
        sd.check_speakers([], known)


def test_corpus_turns_and_the_default_grammars_read_the_real_corpus(real_data):
    text = real_data.decode(real_data.val.tolist())
    turns = sd.corpus_turns(text)
    assert len(turns) > 500 and all(text[i:i + len(t)] == t and t.endswith("\n\n") for i, t in turns)
    speakers = [name for name, _ in sd.corpus_speakers(text).most_common(8)]
    turn = sd.CharGrammar(sd.turn_grammar(speakers, 2, 48), real_data.vocab)
    reply = sd.CharGrammar(sd.reply_regex(speakers, 48), real_data.vocab, kind="regex")
    accepted = [t for _, t in turns if turn.accepts(t)]
    assert accepted and all(t.split(":\n")[0] in speakers for t in accepted)
    for _, t in turns[:200]:  # the engine and Python's re agree on the regex grammar
        assert reply.accepts(t[:-1]) == bool(reply.python_regex.fullmatch(t[:-1]))


def test_script_runs_and_writes_json(real_data, tmp_path, capsys):
    out = tmp_path / "sd.json"
    msd.main(["--untrained", "--n-outputs", "1", "--repeats", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["rows"]] == list(msd.VARIANTS) * 3
    assert all(result["checks"].values())
    assert all(r["accepted"] == 1 for r in result["rows"] if r["variant"] != "unconstrained")
    assert "checks:" in capsys.readouterr().out
    renders_on_its_page("main_structured_decoding", result)


@pytest.mark.parametrize("argv, message", [
    (["--speakers", "PETRUCHO"], "did you mean PETRUCHIO"),
    (["--prompt-len", "100"], "exceed the window of 128"),
    (["--n-outputs", "0"], "at least 1"),
    (["--max-line-chars", "2"], "at least 4"),
])
def test_bad_flags_are_refused_before_any_work(real_data, argv, message, capsys):
    with pytest.raises(SystemExit):
        msd.main(["--untrained", *argv])
    assert re.search(message, capsys.readouterr().err)


def test_plot_changes_nothing_in_the_json_and_the_headline_is_in_it(real_data, tmp_path):
    results = []
    for plot in ([], ["--plot", str(tmp_path / "sd.png")]):
        msd.main(["--untrained", "--n-outputs", "1", "--repeats", "1", "--json", str(tmp_path / "sd.json")] + plot)
        results.append(json.loads((tmp_path / "sd.json").read_text()))
    assert results[0].keys() == results[1].keys()
    assert [r["variant"] for r in results[0]["rows"]] == [r["variant"] for r in results[1]["rows"]]
    assert results[0]["headline"]["technique"] == "structured decoding (XGrammar), jump-forward"
    assert results[0]["headline"]["figure"].startswith("play turns accepted: ")


def test_failed_checks_stop_before_anything_is_timed_or_written(real_data, tmp_path, monkeypatch):
    monkeypatch.setattr(msd, "check_outputs", lambda *args: {"outputs equal": False})
    runs, run_variant = [], msd.run_variant
    monkeypatch.setattr(msd, "run_variant", lambda *args: runs.append(args) or run_variant(*args))
    out = tmp_path / "sd.json"
    with pytest.raises(msd.harness.GPTliteError, match="checks failed: play turn"):
        msd.main(["--untrained", "--n-outputs", "1", "--repeats", "1", "--json", str(out)])
    assert len(runs) == 3 * len(msd.VARIANTS)  # the checked first run of each grammar and variant, no timed round
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--n-outputs", "--max-lines", "--max-line-chars"])
def test_huge_sizes_are_parser_errors_naming_the_flag_before_any_work(flag, capsys, monkeypatch):
    monkeypatch.setattr(msd.harness, "load_data", lambda path=None: pytest.fail("flags must be checked before the data"))
    with pytest.raises(SystemExit) as e:
        msd.main(["--untrained", "--device", "cpu", flag, "1000000000000"])
    assert e.value.code == 2
    assert flag in capsys.readouterr().err
