"""Block-draft training: the dense training forward of anchored blocks equals the paged block
forward inference runs, and a few CPU steps of ``train-draft --algorithm dflash|dspark`` lower
the loss and save a draft that loads back and decodes exactly like plain decoding."""

from __future__ import annotations

import json

import pytest
import torch
from test_training_draft import assert_decodes_like_plain, corpus, cycle_target, target_dir, train

from speculum.models.block_draft import random_block_draft
from speculum.runtime.engine import engine_from_model
from speculum.runtime.generate import generate
from speculum.spec.block import block_batch
from speculum.spec.paged import extend_batch
from speculum.state import PagedKV
from speculum.training.draft import target_continuations
from speculum.training.recipes import run_target
from speculum.training.recipes.dflash import block_mask, dense_block_forward

__all__ = ["corpus", "target_dir"]  # fixtures shared with test_training_draft


def test_the_block_mask_sees_earlier_context_and_its_own_block():
    mask = block_mask(torch.tensor([[1, 3]]), 4, 2)[0].int()
    assert mask.tolist() == [
        [1, 0, 0, 0, 1, 1, 0, 0],
        [1, 0, 0, 0, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 1, 1],
        [1, 1, 1, 0, 0, 0, 1, 1],
    ]


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_the_dense_training_forward_is_the_paged_block_forward(algorithm):
    """Every anchored block of the dense forward equals the head run over the paged cache
    after writing the context of the tokens before its anchor."""
    target = cycle_target()
    head = random_block_draft(target, algorithm, seed=2, std=0.2, block_size=4)
    windows = torch.randint(97, 123, (2, 12), generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([[1, 5, 9], [2, 3, 10]])
    out = run_target(target, windows, head.capture_layers)
    dense = dense_block_forward(head, head.context(out.captured), windows, anchors)
    for row in range(2):
        for m, anchor in enumerate(anchors[row].tolist()):
            pool = head.new_pool(6, 4)
            table = torch.tensor([[1, 2, 3, 4]])
            empty = PagedKV(page_table=table, seq_lens=torch.tensor([0]), page_size=4)
            prefix = extend_batch(empty, windows[row : row + 1, :anchor], torch.tensor([anchor]))
            captured = tuple(c[row : row + 1, :anchor] for c in out.captured)
            head.write_context(prefix, pool, captured)
            kv = PagedKV(page_table=table, seq_lens=torch.tensor([anchor]), page_size=4)
            root = windows[row, anchor : anchor + 1]
            paged = head(block_batch(kv, root, 4, head.config.mask_token_id), pool)
            torch.testing.assert_close(dense[row, m], paged[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_training_lowers_the_loss_and_saves_a_loadable_draft(
    algorithm, target_dir, corpus, tmp_path
):
    out_dir = tmp_path / "draft"
    metrics = train(target_dir, corpus, out_dir, algorithm, steps=30, block_size=4)
    record = json.loads((out_dir / "training.json").read_text())
    (_, before), *_, (_, after) = record["heldout_history"]
    assert after < 0.8 * before
    assert metrics["heldout_loss"] == after
    drafts = 3 if algorithm == "dflash" else 4
    assert 1.0 <= metrics["acceptance_length"] <= drafts + 1
    assert record["options"]["block_size"] == 4
    assert json.loads((out_dir / "config.json").read_text())["block_size"] == 4
    if algorithm == "dspark":
        assert 0.0 <= metrics["heldout_tv_0"] <= 1.0 and "heldout_confidence_error_0" in metrics
    assert_decodes_like_plain(out_dir, target_dir, algorithm)


def test_on_policy_data_is_the_targets_greedy_continuation_of_corpus_prompts():
    target = cycle_target()
    corpus = torch.randint(97, 123, (500,), generator=torch.Generator().manual_seed(4)).numpy()
    sequences = target_continuations(target, corpus, 3, 16, seed=0).reshape(3, 17)
    assert (sequences[:, -1] == 257).all()  # EOS after each
    engine = engine_from_model(target, max_context=32)
    prompts = [row[:4].tolist() for row in sequences]
    assert all(" ".join(map(str, p)) in " ".join(map(str, corpus.tolist())) for p in prompts)
    greedy = generate(prompts, engine=engine, max_new_tokens=12, ignore_eos=True)
    assert [list(r.token_ids) for r in greedy] == [row[4:16].tolist() for row in sequences]
