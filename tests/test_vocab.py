"""The draft vocabulary is the top-V_d assistant tokens by (-count, id), ascending, with docs/design.md §5's d2t/t2d."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dspark_hf.assets import smollm2_path
from dspark_hf.cache import HiddenStateCache, build_cache
from dspark_hf.cli import main
from dspark_hf.corpora import chatterbot_conversations
from dspark_hf.tokenization import tokenize_conversations
from dspark_hf.vocab import (
    build_draft_vocab,
    count_assistant_tokens,
    full_draft_vocab,
    load_draft_vocab,
    save_draft_vocab,
)


def test_top_tokens_by_count_then_id():
    counts = torch.tensor([0, 5, 3, 5, 0, 1, 3, 0])  # V_t = 8
    d2t, t2d = build_draft_vocab(counts, 4)
    ids = torch.arange(4) + d2t
    assert ids.tolist() == [1, 2, 3, 6]  # counts 5,5 then the tie 3,3 -> both; ascending
    assert d2t.dtype == torch.int64 and d2t.tolist() == [1, 1, 1, 3]
    assert t2d.dtype == torch.bool and t2d.nonzero().flatten().tolist() == [1, 2, 3, 6]
    d2t, _ = build_draft_vocab(counts, 3)
    assert (torch.arange(3) + d2t).tolist() == [1, 2, 3]  # the 3-3 tie goes to the smaller id


def test_pads_with_the_smallest_unused_ids():
    counts = torch.tensor([0, 0, 7, 0, 0, 2])
    d2t, t2d = build_draft_vocab(counts, 4)
    assert (torch.arange(4) + d2t).tolist() == [0, 1, 2, 5]
    assert int(t2d.sum()) == 4


def test_errors_and_full_mode():
    with pytest.raises(ValueError, match="draft_vocab_size=9 is larger than the vocabulary \\(8 tokens\\)"):
        build_draft_vocab(torch.ones(8), 9)
    d2t, t2d = full_draft_vocab(8)
    assert d2t.tolist() == [0] * 8 and t2d.all()
    assert torch.equal(build_draft_vocab(torch.ones(8), 8)[0], d2t)


def test_save_and_load(tmp_path):
    d2t, t2d = build_draft_vocab(torch.tensor([3, 0, 2, 9, 1]), 3)
    path = tmp_path / "vocab" / "draft_vocab.safetensors"
    save_draft_vocab(path, d2t, t2d)
    loaded = load_draft_vocab(path)
    assert torch.equal(loaded[0], d2t) and torch.equal(loaded[1], t2d)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         intermediate_size=64, vocab_size=len(tokenizer))).eval()
    convs = chatterbot_conversations()[:30]
    directory = tmp_path_factory.mktemp("cache")
    build_cache(model, tokenizer, convs, directory, [1, 2], shard_size=8, progress=False)
    return tokenizer, convs, directory


def test_counts_from_cache_equal_counts_from_tokenized_data(setup):
    tokenizer, convs, directory = setup
    samples = tokenize_conversations(tokenizer, convs)
    from_cache = count_assistant_tokens(HiddenStateCache(directory))
    from_data = count_assistant_tokens(samples, vocab_size=len(tokenizer))
    assert torch.equal(from_cache, from_data)
    assert int(from_cache.sum()) == sum(int(s["loss_mask"].sum()) for s in samples)
    assert from_cache[tokenizer.convert_tokens_to_ids("<|im_end|>")] == 30  # one end-of-turn per reply


def test_cli(setup, tmp_path, capsys):
    _, _, directory = setup
    out = tmp_path / "v.safetensors"
    assert main(["vocab", "--cache", str(directory), "--draft-vocab-size", "1000", "--output", str(out)]) == 0
    d2t, t2d = load_draft_vocab(out)
    assert d2t.shape == (1000,) and t2d.shape == (49152,) and int(t2d.sum()) == 1000
    assert "coverage 1.0000" in capsys.readouterr().out  # 1000 > distinct assistant tokens in 30 replies
    assert main(["vocab", "--cache", str(directory), "--full", "--output", str(out)]) == 0
    assert load_draft_vocab(out)[1].all()
    assert main(["vocab", "--cache", str(directory), "--draft-vocab-size", "60000", "--output", str(out)]) == 1
    error = capsys.readouterr().err.strip()
    assert "larger than the vocabulary" in error and "\n" not in error
