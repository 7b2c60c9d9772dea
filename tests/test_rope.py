"""gptlite_rope: the rotation against complex multiplication, relative positions, the cached decode
against the model's own full forward pass, training and reloading a checkpoint (tiny models)."""
import pytest
import torch
from conftest import TINY

import inference_utils as iu
from gptlite_rope import GPTlite_RoPE, apply_rope, rope_tables
from lib.variant_checkpoints import train_rope
from lib import files, presets, training


@pytest.fixture
def tiny_rope():
    torch.manual_seed(0)
    model = GPTlite_RoPE(**TINY).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)  # peaked attention: a wrong position shows far above float error
    return model


def test_apply_rope_is_complex_multiplication():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 8)
    cos, sin = rope_tables(7, 8)
    # pair i of the two halves is the complex number x_i + j x_{i+D/2}, turned by angle m * 10000^(-2i/D)
    z = torch.complex(x[..., :4], x[..., 4:])
    angles = torch.arange(7.0)[:, None] * 10000.0 ** (-torch.arange(0, 8, 2) / 8)
    turned = z * torch.polar(torch.ones_like(angles), angles)
    expected = torch.cat([turned.real, turned.imag], dim=-1)
    torch.testing.assert_close(apply_rope(x, cos, sin), expected, atol=1e-5, rtol=0)


def test_rotated_scores_depend_only_on_the_offset():
    """q at m, k at n scores as q at m + s, k at n + s: why cache slots can be renumbered (StreamingLLM)."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    cos, sin = rope_tables(64, 16)

    def score(m, n):
        return (apply_rope(q, cos[m:m + 1], sin[m:m + 1]) * apply_rope(k, cos[n:n + 1], sin[n:n + 1])).sum()
    assert torch.allclose(score(9, 3), score(50, 44), atol=1e-4)
    assert not torch.allclose(score(9, 3), score(9, 5), atol=1e-2)  # another offset, another score


def test_cached_decode_equals_the_full_forward_pass(tiny_rope):
    x = torch.randint(65, (3, TINY["seqlen"]))
    assert training.cached_matches_full(tiny_rope, x, atol=1e-4)
    full, _ = tiny_rope(x)
    logits, cache = tiny_rope(x[:, :1])
    steps = [logits]
    for t in range(1, x.shape[1]):  # one token at a time from the first
        logits, cache = tiny_rope(x[:, t:t + 1], cache)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=0)


def test_keys_are_cached_before_rotation(tiny_rope):
    x = torch.randint(65, (1, 5))
    _, cache = tiny_rope(x)
    mha = tiny_rope.blocks[0].mha
    h = tiny_rope.blocks[0].ln1(tiny_rope.token_embedding(x))
    torch.testing.assert_close(cache[0][0], mha.split_heads(mha.key_proj(h)))


def test_positions_matter(tiny_rope):
    """Without a position table the rotation is the only position signal: it must change the output."""
    x = torch.randint(65, (1, 8))
    with torch.no_grad():
        tiny_rope.rope_sin.zero_()
        tiny_rope.rope_cos.fill_(1.0)
        unrotated, _ = tiny_rope(x)
    torch.manual_seed(0)
    fresh = GPTlite_RoPE(**TINY).eval()
    fresh.load_state_dict(tiny_rope.state_dict())
    assert not torch.allclose(fresh(x)[0], unrotated, atol=1e-3)


def test_more_tokens_than_the_window_is_a_clear_error(tiny_rope):
    with pytest.raises(ValueError, match="exceed seqlen=16"):
        tiny_rope(torch.zeros(1, 17, dtype=torch.long))
    _, cache = tiny_rope(torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="evict cache entries first"):
        tiny_rope(torch.zeros(1, 1, dtype=torch.long), cache)


def test_train_save_and_reload(real_data, tmp_path):
    preset = presets.Preset("tiny", **{k: v for k, v in TINY.items() if k != "vocab_size"}, batch_size=4, lr=1e-3, iters=2)
    model = train_rope(preset, real_data, "cpu", path=tmp_path / "rope.pt")
    ckpt = files.load_checkpoint(tmp_path / "rope.pt", config=preset.gptlite_kwargs(), vocab=real_data.vocab)
    assert "position_embedding.weight" not in ckpt["state_dict"]
    reloaded = GPTlite_RoPE(**ckpt["config"]).eval()
    reloaded.load_state_dict(ckpt["state_dict"])
    x = torch.randint(65, (2, 16))
    assert torch.equal(model(x)[0], reloaded(x)[0])


# ----------------------------------------------------------------------------------------------------
# The start-token model's data: documents (speaker turns) packed after a start token, position 0 always it.

import re  # noqa: E402

from lib.variant_checkpoints import document_batches, document_loss, load_start_token, start_token_id  # noqa: E402
from lib import corpus  # noqa: E402

TEXT = "tail of a turn\n\nA:\nab\n\nBB:\ncdef gh\n\nC:\ni\n\n\nD:\njklmn\n\nE:\nop\n\nF:\nqrstu\n\nG:\nvw\n"
START = 200  # a start token outside the text's ids (code points below 128)


def encoded(text):
    return torch.tensor([ord(c) for c in text])  # ids = code points here; "\n" is 10


def reference_documents(text):
    """The documents written out by hand: after each blank line, up to the next document's start."""
    starts = [m.end() for m in re.finditer(r"\n\n+(?=[^\n])", text)]
    return [text[s:e] for s, e in zip(starts, starts[1:] + [len(text)])]


def test_document_starts_are_after_blank_lines():
    starts = corpus.document_starts(encoded(TEXT), 10).tolist()
    assert ["".join(TEXT[s:s + 2]) for s in starts] == ["A:", "BB", "C:", "D:", "E:", "F:", "G:"]
    assert [TEXT[s:e] for s, e in zip(starts, starts[1:] + [len(TEXT)])] == reference_documents(TEXT)


@pytest.mark.parametrize("seqlen", [5, 12, 30])
def test_every_sequence_is_the_start_token_then_documents_from_their_start(seqlen):
    tokens, docs = encoded(TEXT), reference_documents(TEXT)
    starts = corpus.document_starts(tokens, 10)
    x, y = corpus.document_batch(tokens, starts, START, 16, seqlen, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (16, seqlen)
    assert (x[:, 0] == START).all()  # position 0 is always the start token
    assert not (y == START).any()  # never a target ...
    assert torch.equal(y[:, :-1] == corpus.IGNORE, x[:, 1:] == START)  # ... its target position is ignored
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        seq = row_x + [row_y[-1] if row_y[-1] != corpus.IGNORE else START]
        pieces = "".join("|" if t == START else chr(t) for t in seq)[1:].split("|")
        first = next(i for i, d in enumerate(docs) if d.startswith(pieces[0]))  # its first document, from its start
        expected = "|".join(docs[first:])[:len(seq) - 1]
        assert "|".join(pieces) == expected


def test_document_batches_are_deterministic_by_seed():
    tokens = encoded(TEXT)
    starts = corpus.document_starts(tokens, 10)
    def draw(seed):
        return corpus.document_batch(tokens, starts, START, 8, 10, torch.Generator().manual_seed(seed))
    assert all(torch.equal(a, b) for a, b in zip(draw(3), draw(3)))
    assert not torch.equal(draw(3)[0], draw(4)[0])


def test_too_few_documents_for_a_sequence_is_a_clear_error():
    tokens = encoded(TEXT)
    starts = corpus.document_starts(tokens, 10)
    with pytest.raises(ValueError, match="shorter than 200 tokens"):
        corpus.document_sequence(tokens, starts, 5, START, 200)


def test_real_documents_are_speaker_turns(real_data):
    text = real_data.val_text
    starts = corpus.document_starts(real_data.val, real_data.vocab.index("\n")).tolist()
    assert len(starts) > 900 and all(text[s:text.index("\n", s)].endswith(":") for s in starts)
    x, y = document_batches(real_data, "val", seed=1)(4, 128)
    assert (x[:, 0] == start_token_id(real_data)).all() and not (y == start_token_id(real_data)).any()
    assert all(real_data.decode(row[1:3].tolist()).isupper() for row in x)  # "NAME:" follows the start token


def test_start_token_model_trains_saves_and_reloads(real_data, tmp_path):
    preset = presets.Preset("tiny", **{k: v for k, v in TINY.items() if k != "vocab_size"}, batch_size=4, lr=1e-3,
                            iters=2)
    model = load_start_token(preset, "cpu", real_data, iters=2, path=tmp_path / "start.pt")
    assert model.token_embedding.num_embeddings == len(real_data.vocab) + 1  # one row for the start token
    ckpt = files.load_checkpoint(tmp_path / "start.pt", vocab=real_data.vocab)
    assert ckpt["config"]["vocab_size"] == 66 and ckpt["meta"]["stamp"]["iters"] == 2
    assert "start token" in ckpt["meta"]["stamp"]["data"]
    reloaded = load_start_token(preset, "cpu", real_data, iters=2, path=tmp_path / "start.pt")  # loaded, not trained
    x = torch.cat([torch.tensor([[65]]), real_data.val[:15][None]], dim=1)
    assert torch.equal(model(x)[0], reloaded(x)[0])
    assert document_loss(model, real_data, n_batches=1, batch_size=2) == pytest.approx(
        document_loss(reloaded, real_data, n_batches=1, batch_size=2), abs=0)


def test_only_documents_followed_by_a_whole_sequence_are_drawn():
    tokens = encoded(TEXT)
    starts = corpus.document_starts(tokens, 10)
    x, _ = corpus.document_batch(tokens, starts, START, 64, 30, torch.Generator().manual_seed(0))
    firsts = {chr(t) for t in x[:, 1].tolist()}
    assert firsts <= {"A", "B", "C", "D"} and "A" in firsts  # E, F, G have under 31 characters after them
    with pytest.raises(ValueError, match="no document has 61 tokens"):
        corpus.document_batch(tokens, starts, START, 1, 60)
