"""gptlite_rope: the rotation against complex multiplication, relative positions, the cached decode
against the model's own full forward pass, training and reloading a checkpoint (tiny models)."""
import pytest
import torch
from conftest import TINY

import inference_utils as iu
from gptlite_rope import GPTlite_RoPE, apply_rope, rope_tables, train_rope
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
