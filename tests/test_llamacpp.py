"""lib/llamacpp: GPTlite written as a GPT-2 GGUF file computes GPTlite's logits in llama.cpp's GPT-2 graph (GELU
MLP, no head bias, d_model / d_head heads), checked against an independent forward pass of that graph over the
tensors read back from the file; llama.cpp itself (optional, llama-cpp-python) decodes GPTlite's greedy tokens."""
import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from gptlite_kvcache import GPTlite_KVCache, generate_kvcache
from lib import llamacpp

gguf = pytest.importorskip("gguf")
needs_llama = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                 reason="llama-cpp-python is not installed (pip install -r requirements-llamacpp.txt)")
VOCAB = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # tiny Shakespeare's 65 characters


def model(n_heads=6, d_head=16, d_model=96, seed=0):
    torch.manual_seed(seed)
    m = GPTlite_KVCache(vocab_size=65, d_model=d_model, n_heads=n_heads, d_head=d_head, n_layers=2, dropout_p=0.0,
                        seqlen=32).eval()
    with torch.no_grad():  # biases and norms away from their initial zeros and ones, so that each is checked
        for name, p in m.named_parameters():
            if name.endswith("bias") or "ln" in name:
                p.add_(0.1 * torch.randn_like(p))
    return m


def read_back(path):
    """{name: float32 tensor in nn.Linear's [out, in] layout} and the hyperparameters, from the GGUF file."""
    reader = gguf.GGUFReader(path)
    tensors = {t.name: torch.from_numpy(t.data.copy()).float().reshape([int(n) for n in reversed(t.shape)])
               for t in reader.tensors}
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    return tensors, {"heads": field("gpt2.attention.head_count"), "layers": field("gpt2.block_count"),
                     "eps": field("gpt2.attention.layer_norm_epsilon")}


def gpt2_gelu_logits(t, hp, ids):
    """llama.cpp's GPT-2 graph, written from its description: learned positions, pre-LayerNorm blocks with fused
    QKV of d_model / heads wide heads, a GELU MLP (tanh form), a head without bias. ids [S] -> logits [S, V]."""
    S, d = ids.shape[0], t["token_embd.weight"].shape[1]
    x = t["token_embd.weight"][ids] + t["position_embd.weight"][:S]  # [S, d]
    H = hp["heads"]
    D = d // H
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    for i in range(hp["layers"]):
        p = lambda name: t[f"blk.{i}.{name}"]  # noqa: E731
        h = F.layer_norm(x, (d,), p("attn_norm.weight"), p("attn_norm.bias"), hp["eps"])
        q, k, v = (h @ p("attn_qkv.weight").T + p("attn_qkv.bias")).split(d, dim=-1)
        q, k, v = (z.view(S, H, D).transpose(0, 1) for z in (q, k, v))  # [H, S, D]
        scores = (q @ k.transpose(1, 2) / math.sqrt(D)).masked_fill(~mask, float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(S, d)
        x = x + attn @ p("attn_output.weight").T + p("attn_output.bias")
        h = F.layer_norm(x, (d,), p("ffn_norm.weight"), p("ffn_norm.bias"), hp["eps"])
        x = x + F.gelu(h @ p("ffn_up.weight").T + p("ffn_up.bias"), approximate="tanh") @ p("ffn_down.weight").T \
            + p("ffn_down.bias")
    h = F.layer_norm(x, (d,), t["output_norm.weight"], t["output_norm.bias"], hp["eps"])
    return h @ t["output.weight"].T


@pytest.mark.parametrize("n_heads", [6, 5])  # 6 x 16 = d_model; 5 x 16 padded with a zero head (the gptlite case)
def test_gguf_in_gpt2_gelu_graph_gives_gptlite_logits(tmp_path, n_heads):
    m = model(n_heads=n_heads)
    path = llamacpp.write_gguf(m, VOCAB, str(tmp_path / "m.gguf"), source="test")
    tensors, hp = read_back(path)
    assert hp["heads"] == 6
    ids = torch.randint(0, 65, (32,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = m(ids[None])[0][0]  # [S, V]
    got = gpt2_gelu_logits(tensors, hp, ids)
    assert (got - want).abs().max().item() < 1e-4
    # without the scaling the same graph computes another model (GELU is not ReLU): the check above can fail
    unscaled = llamacpp.gguf_tensors(m, scale=1.0)
    bare = gpt2_gelu_logits({k: torch.from_numpy(v) for k, v in unscaled.items()}, {**hp, "eps": m.ln.eps}, ids)
    assert (bare - want).abs().max().item() > 1e-2


def test_read_config_and_bytes(tmp_path):
    m = model(n_heads=5)
    path = llamacpp.write_gguf(m, VOCAB, str(tmp_path / "m.gguf"), source="checkpoint abc")
    config, source, sizes = llamacpp.read_config(path)
    assert source == "checkpoint abc"
    assert config == {"context_length": 32, "embedding_length": 96, "block_count": 2, "feed_forward_length": 384,
                      "attention.head_count": 6, "vocab_size": 65}
    assert sizes["blk.0.attn_qkv.weight"] == 3 * 96 * 96 * 4
    weights, kv = llamacpp.bytes_per_token(sizes, config, context=10)
    # the blocks of a 6-head model (5 heads and the zero one), the final norm and head, one row of each embedding
    n_blocks = sum(p.numel() for p in model(n_heads=6).blocks.parameters())
    n_other = 2 * 96 + 65 * 96 + 2 * 96
    assert weights == 4 * (n_blocks + n_other)
    assert kv == 10 * 2 * 2 * 96 * 4
    assert not list(tmp_path.glob("*.tmp"))


def test_bad_inputs(tmp_path):
    m = model()
    with pytest.raises(ValueError, match="vocabulary has 64 characters"):
        llamacpp.write_gguf(m, VOCAB[:64], str(tmp_path / "x.gguf"))
    assert not list(tmp_path.iterdir())  # nothing written
    with pytest.raises(ValueError, match="do not pad"):
        llamacpp.check_portable(model(n_heads=7).config)
    path = llamacpp.write_gguf(m, VOCAB, str(tmp_path / "m.gguf"))
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(open(path, "rb").read()[:1000])
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        llamacpp.read_config(str(damaged))
    other = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(other), arch="gpt2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="not a GPTlite GGUF file"):
        llamacpp.read_config(str(other))
    with pytest.raises(ValueError, match="choose one of"):
        llamacpp.quantize(path, str(tmp_path / "q.gguf"), "q2_k")


@needs_llama
@pytest.mark.parametrize("n_heads", [6, 5])
def test_llamacpp_f32_greedy_tokens_equal_ours(tmp_path, n_heads):
    m = model(n_heads=n_heads, seed=2)
    path = llamacpp.write_gguf(m, VOCAB, str(tmp_path / "m.gguf"))
    llm = llamacpp.load(path, n_ctx=32, threads=2)
    prompt = torch.randint(0, 65, (2, 8), generator=torch.Generator().manual_seed(3))
    assert torch.equal(llamacpp.generate(llm, prompt, 20), generate_kvcache(m, prompt, 20, 32))


@needs_llama
def test_llamacpp_quantized_files(tmp_path):
    m = model(seed=4)
    src = llamacpp.write_gguf(m, VOCAB, str(tmp_path / "m.gguf"))
    for kind, type_name in (("q8_0", "Q8_0"), ("q4_0", "Q4_0")):
        dst = llamacpp.quantize(src, str(tmp_path / f"m-{kind}.gguf"), kind)
        reader = gguf.GGUFReader(dst)
        types = {t.name: t.tensor_type.name for t in reader.tensors}
        assert types["blk.0.ffn_up.weight"] == type_name and types["blk.0.attn_norm.weight"] == "F32"
        _, _, sizes = llamacpp.read_config(dst)
        # Q8_0: 34 bytes per 32 weights, Q4_0: 18
        assert sizes["blk.0.ffn_up.weight"] == 384 * 96 // 32 * (34 if kind == "q8_0" else 18)
        llm = llamacpp.load(dst, n_ctx=32, threads=2)
        tokens = llamacpp.generate(llm, torch.arange(8)[None], 4)
        assert tokens.shape == (1, 12) and tokens.max() < 65


@needs_llama
def test_probe_runs_llama_cpp_in_a_child_and_says_how_it_failed(tmp_path):
    good = llamacpp.write_gguf(model(), VOCAB, str(tmp_path / "m.gguf"))
    assert llamacpp.probe(good, 32, 2) is None
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(open(good, "rb").read()[:4096])  # a cut file: llama.cpp refuses it, the parent goes on
    line = llamacpp.probe(str(bad), 32, 2)
    assert line.startswith("llama.cpp failed to decode bad.gguf (exit status 1")


@needs_llama
def test_llamacpp_f32_logits_equal_ours(tmp_path):
    m = model(n_heads=5, seed=5)  # a padded head
    llm = llamacpp.load(llamacpp.write_gguf(m, VOCAB, str(tmp_path / "m.gguf")), n_ctx=32, threads=2)
    ids = torch.randint(0, 65, (20,), generator=torch.Generator().manual_seed(6))
    llm.reset()
    llm.eval(ids.tolist())
    with torch.no_grad():
        want = m(ids[None])[0][0, -1]
    assert (torch.from_numpy(llamacpp.last_logits(llm).copy()) - want).abs().max().item() < 1e-5
