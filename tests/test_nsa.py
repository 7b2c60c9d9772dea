"""NSA: the compression, the block selection and each branch against references written here (Python loops,
an explicit softmax per query), the dense limits of the selected and window branches, GPTlite's logits with
the gates fixed to the selected branch at full selection, the decode step against the whole-sequence
branches, the cost formula against the masks, clear errors."""
import math

import pytest
import torch
from conftest import TINY, random_gptlite

import gptlite_nsa
from gptlite import GPTlite
from lib import nsa

ATOL = 1e-6  # float32 attention outputs on random unit inputs


def random_qkv(S=37, B=2, H=2, D=8, seed=0):
    return torch.randn(3, B, H, S, D, generator=torch.Generator().manual_seed(seed))


def softmax_over(q, K, V, keys):
    """Exact attention of one query over the listed keys."""
    weights = torch.softmax(K[keys] @ q / math.sqrt(q.shape[-1]), dim=0)
    return weights @ V[keys]


def loop_compress(X, block):
    B, H, S, D = X.shape
    out = torch.zeros(B, H, S // block, D)
    for j in range(S // block):
        for i in range(block):
            out[:, :, j] += X[:, :, j * block + i]
        out[:, :, j] /= block
    return out


def loop_selection(Q, K, block, top_n):
    """{(b, h, t): sorted blocks}: own block, then block 0, then the whole past blocks by q . mean key."""
    B, H, S, D = Q.shape
    chosen = {}
    for b in range(B):
        for h in range(H):
            for t in range(S):
                q, own = Q[b, h, t], t // block
                whole = [j for j in range(own) if (j + 1) * block - 1 <= t]  # every past block is whole
                score = {j: (q @ K[b, h, j * block:(j + 1) * block].mean(0)).item() for j in whole}
                order = [own] + ([0] if own > 0 else []) + sorted((j for j in whole if j != 0), key=lambda j: -score[j])
                chosen[b, h, t] = sorted(order[:top_n])
    return chosen


def reference_selected(Q, K, V, block, top_n):
    B, H, S, D = Q.shape
    out, chosen = torch.zeros_like(Q), loop_selection(Q, K, block, top_n)
    for (b, h, t), blocks in chosen.items():
        keys = [s for j in blocks for s in range(j * block, min((j + 1) * block, t + 1))]
        out[b, h, t] = softmax_over(Q[b, h, t], K[b, h], V[b, h], keys)
    return out


def reference_compressed(Q, K, V, block):
    B, H, S, D = Q.shape
    out, Kc, Vc = torch.zeros_like(Q), loop_compress(K, block), loop_compress(V, block)
    for b in range(B):
        for h in range(H):
            for t in range(S):
                whole = [j for j in range(S // block) if (j + 1) * block - 1 <= t]
                if whole:
                    out[b, h, t] = softmax_over(Q[b, h, t], Kc[b, h], Vc[b, h], whole)
    return out


def reference_window(Q, K, V, window):
    B, H, S, D = Q.shape
    out = torch.zeros_like(Q)
    for b in range(B):
        for h in range(H):
            for t in range(S):
                out[b, h, t] = softmax_over(Q[b, h, t], K[b, h], V[b, h], list(range(max(0, t - window + 1), t + 1)))
    return out


def reference_dense(Q, K, V):
    S = Q.shape[-2]
    scores = (Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])).masked_fill(torch.ones(S, S).triu(1).bool(),
                                                                           float("-inf"))
    return torch.softmax(scores, dim=-1) @ V


@pytest.mark.parametrize("S, block", [(37, 8), (37, 5), (16, 4), (3, 4)])
def test_compression_is_the_mean_of_each_whole_block(S, block):
    X = random_qkv(S=S)[0]
    assert torch.allclose(gptlite_nsa.compress(X, block), loop_compress(X, block), atol=ATOL)


@pytest.mark.parametrize("block, top_n", [(8, 1), (8, 2), (8, 3), (5, 2), (5, 4), (4, 6)])
def test_block_selection_matches_the_loop(block, top_n):
    Q, K, _ = random_qkv(S=37)
    chosen = gptlite_nsa.select_blocks(Q, K, block, top_n)  # [B, H, S, nb]
    expected = loop_selection(Q, K, block, top_n)
    got = {key: chosen[key].nonzero().flatten().tolist() for key in expected}
    assert got == expected


@pytest.mark.parametrize("block, top_n", [(8, 1), (8, 2), (8, 3), (5, 2), (5, 4)])
def test_selected_branch_matches_the_explicit_softmax(block, top_n):
    Q, K, V = random_qkv(S=37)
    assert torch.allclose(gptlite_nsa.selected_attention(Q, K, V, block, top_n), reference_selected(Q, K, V, block, top_n),
                          atol=ATOL)


@pytest.mark.parametrize("block", [8, 5, 4])
def test_compressed_branch_matches_the_explicit_softmax(block):
    Q, K, V = random_qkv(S=37)
    out = gptlite_nsa.compressed_attention(Q, K, V, block)
    assert torch.allclose(out, reference_compressed(Q, K, V, block), atol=ATOL)
    assert out[:, :, :block - 1].abs().max() == 0  # no whole block yet: zeros


@pytest.mark.parametrize("window", [1, 4, 9])
def test_window_branch_matches_the_explicit_softmax(window):
    Q, K, V = random_qkv(S=37)
    assert torch.allclose(gptlite_nsa.window_attention(Q, K, V, window), reference_window(Q, K, V, window), atol=ATOL)


@pytest.mark.parametrize("block, top_n", [(8, 5), (8, 9), (5, 8), (37, 1)])
def test_selection_of_every_block_is_dense_attention(block, top_n):
    Q, K, V = random_qkv(S=37)
    assert torch.allclose(gptlite_nsa.selected_attention(Q, K, V, block, top_n), reference_dense(Q, K, V), atol=ATOL)


@pytest.mark.parametrize("window", [37, 100])
def test_window_of_the_whole_sequence_is_dense_attention(window):
    Q, K, V = random_qkv(S=37)
    assert torch.allclose(gptlite_nsa.window_attention(Q, K, V, window), reference_dense(Q, K, V), atol=ATOL)


def test_the_first_and_own_blocks_are_always_selected():
    Q, K, _ = random_qkv(S=37)
    chosen = gptlite_nsa.select_blocks(Q, K, 4, 2)  # [B, H, S, 10]
    own = torch.arange(37) // 4
    assert chosen[..., 0].all()
    assert chosen.gather(-1, own.view(1, 1, 37, 1).expand(2, 2, 37, 1)).all()
    assert (chosen.sum(-1) == torch.clamp(own + 1, max=2)).all()


def test_fixed_gates_at_full_selection_give_gptlites_logits():
    base = random_gptlite()
    idx = torch.randint(0, TINY["vocab_size"], (3, TINY["seqlen"]), generator=torch.Generator().manual_seed(1))
    model = nsa.nsa_from_dense(base, block_size=4, top_n=4, window=2).fix_gates((0, 1, 0))
    assert torch.equal(model(idx), base(idx))  # bit for bit
    sparse = nsa.nsa_from_dense(base, block_size=4, top_n=2, window=2).fix_gates((0, 1, 0))
    assert not torch.allclose(sparse(idx), base(idx), atol=1e-3)  # the check can fail


def test_learned_gates_mix_the_three_branches():
    base = random_gptlite()
    model = nsa.nsa_from_dense(base, block_size=4, top_n=2, window=3)
    mha = model.blocks[0].mha
    x = torch.randn(2, TINY["seqlen"], TINY["d_model"], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        mha.gate_proj.weight.normal_(0, 0.3)
        g = torch.sigmoid(mha.gate_proj(x)).view(2, TINY["seqlen"], 3, TINY["n_heads"]).permute(2, 0, 3, 1)[..., None]
        Q, K, V = (mha.split_heads(p(x)) for p in (mha.query_proj, mha.key_proj, mha.value_proj))
        out = (g[0] * reference_compressed(Q, K, V, 4) + g[1] * reference_selected(Q, K, V, 4, 2)
               + g[2] * reference_window(Q, K, V, 3))
        assert torch.allclose(mha(x), mha.out_proj(mha.merge_heads(out)), atol=1e-5)


def test_gates_start_favouring_the_selected_and_window_branches():
    model = nsa.nsa_from_dense(random_gptlite(), block_size=4, top_n=2, window=3)
    g = model.blocks[1].mha.gates(torch.randn(1, 5, TINY["d_model"]))  # [3, B, H, S, 1]
    assert torch.allclose(g[0], torch.tensor(0.0180), atol=1e-4) and torch.allclose(g[1:], torch.tensor(0.5))


def test_state_dict_is_gptlites_plus_the_gates():
    model = nsa.nsa_from_dense(random_gptlite(), block_size=4, top_n=2, window=3)
    extra = set(model.state_dict()) - set(GPTlite(**TINY).state_dict())
    assert extra == {f"blocks.{i}.mha.gate_proj.{w}" for i in range(TINY["n_layers"]) for w in ("weight", "bias")}


@pytest.mark.parametrize("n, block, top_n, window", [(37, 8, 2, 5), (40, 8, 3, 8), (7, 8, 2, 3), (64, 4, 16, 64)])
def test_decode_step_is_the_last_row_of_the_branches(n, block, top_n, window):
    Q, K, V = random_qkv(S=n)
    q = Q[:, :, -1:]
    out = nsa.nsa_decode(q, K, V, gptlite_nsa.compress(K, block), gptlite_nsa.compress(V, block), block, top_n, window)
    expected = (gptlite_nsa.compressed_attention(q, K, V, block) + gptlite_nsa.selected_attention(q, K, V, block, top_n)
                + gptlite_nsa.window_attention(q, K, V, window)) / 3
    assert torch.allclose(out, expected, atol=ATOL)
    assert torch.allclose(gptlite_nsa.selected_attention(q, K, V, block, top_n), reference_selected(Q, K, V, block, top_n)[
        :, :, -1:], atol=ATOL)  # one query at the end of the cache: the whole sequence's last row


@pytest.mark.parametrize("block, top_n, window", [(4, 1, 1), (4, 2, 3), (5, 3, 20), (16, 2, 8)])
def test_keys_read_counts_the_masks(block, top_n, window):
    S = 37
    Q, K, _ = random_qkv(S=S)
    selected = gptlite_nsa.selected_mask(gptlite_nsa.select_blocks(Q, K, block, top_n), block, S).sum(-1)  # [B, H, S]
    windowed = gptlite_nsa.window_mask(S, S, window).sum(-1)  # [S]
    compressed = (gptlite_nsa.compressed_scores(Q, K, block) > float("-inf")).sum(-1)  # [B, H, S]
    for t in range(S):
        assert nsa.keys_read(t, block, top_n, window) == (selected[0, 0, t].item(), windowed[t].item(),
                                                          compressed[0, 0, t].item())
        assert (selected[..., t] == selected[0, 0, t]).all() and (compressed[..., t] == compressed[0, 0, t]).all()
    flops, kv = nsa.attention_cost(S - 1, block, top_n, window, n_heads=2, d_head=8, n_layers=3)
    keys = sum(nsa.keys_read(S - 1, block, top_n, window))
    assert (flops, kv) == (3 * 2 * 8 * 4 * keys, 3 * 2 * 8 * 4 * 2 * keys)


@pytest.mark.parametrize("block_size, top_n, window, flag", [
    (0, 2, 4, "--nsa-block"), (4, 0, 4, "--nsa-top-n"), (4, 2, 0, "--nsa-window"), (2.5, 2, 4, "--nsa-block"),
    (True, 2, 4, "--nsa-block")])
def test_bad_settings_are_errors_naming_the_flag(block_size, top_n, window, flag):
    with pytest.raises(ValueError, match=flag):
        gptlite_nsa.check_nsa_args(block_size, top_n, window)
    with pytest.raises(ValueError, match=flag):
        gptlite_nsa.GPTlite_NSA(**TINY, block_size=block_size, top_n=top_n, window=window)


@pytest.mark.parametrize("block, top_n", [(8, 3), (4, 2), (5, 4)])
def test_selected_branch_matches_fla_naive_nsa_selection(block, top_n):
    """A second oracle: fla-core's naive_nsa_selection (one query at a time, gathered blocks) given this
    module's selection as block indices, -1 padding where fewer than top_n blocks exist."""
    naive = pytest.importorskip("fla.ops.nsa.naive").naive_nsa_selection
    Q, K, V = random_qkv(S=37)
    chosen = gptlite_nsa.select_blocks(Q, K, block, top_n)  # [B, H, S, nb]
    ranked = torch.where(chosen, torch.arange(chosen.shape[-1]), -1).sort(dim=-1, descending=True).values
    indices = ranked[..., :top_n].permute(0, 2, 1, 3).contiguous()  # [B, S, H, top_n], -1 last
    out = naive(*(x.transpose(1, 2) for x in (Q, K, V)), indices, block_size=block).transpose(1, 2)
    assert torch.allclose(gptlite_nsa.selected_attention(Q, K, V, block, top_n), out, atol=ATOL)
