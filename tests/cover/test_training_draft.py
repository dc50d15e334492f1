"""Draft training: every recipe lowers its loss and saves a draft speculum's loaders read, whose
greedy speculative decoding equals plain decoding; EAGLE-3 trained on a predictable target
accepts deeply; TTT and the frozen-KV training forward match what inference computes; bad
targets, output folders and algorithms are refused with errors that name the cause."""

from __future__ import annotations

import json
import random
import string

import pytest
import torch
from conftest import tiny_config

from speculum.models.config import MoEConfig
from speculum.models.decoder import dense_batch
from speculum.models.draft import random_draft
from speculum.models.draft_loading import DraftTargetMismatch, save_random_draft
from speculum.models.frozen_kv import random_frozen_kv
from speculum.models.loading import CheckpointError, load_model, random_model, save_model
from speculum.models.tokenizer import byte_level_tokenizer, save_tokenizer
from speculum.runtime import cli
from speculum.runtime.engine import SpecOptions, engine_from_model
from speculum.runtime.generate import generate
from speculum.spec.paged import extend_batch
from speculum.state import PagedKV
from speculum.training import draft as training_draft
from speculum.training.data import TokenSplit
from speculum.training.draft import train_draft
from speculum.training.recipes import RECIPES, DraftOptions, recipe, run_target
from speculum.training.recipes.eagle3 import frequent_tokens, ttt_forward, ttt_mask
from speculum.training.recipes.frozen_kv_mtp import dense_forward, target_kv
from speculum.training.target import checkpoint_file

VOCAB = 258  # the byte-level tokenizer's ids; 256 is <s>, 257 is </s>
LETTERS = torch.arange(ord("a"), ord("z") + 1)


def cycle_target(hidden_size: int = 32, **changes):
    """A target whose greedy continuation is fully predictable: after a letter comes the next
    letter of the alphabet (``z`` wraps to ``a``), after any other token the same token again.

    Its layers are nearly silent (std 0.02), so the last token's embedding dominates the final
    hidden state; its lm_head row of token ``next(x)`` is the embedding of ``x``."""
    config = tiny_config(
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        num_layers=4,
        eos_token_ids=(257,),
        bos_token_id=256,
        tie_word_embeddings=False,
        **changes,
    )
    model = random_model(config, seed=1, std=0.02)
    following = torch.arange(VOCAB)
    following[LETTERS] = torch.roll(LETTERS, -1)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(
            0.0, 1.0, generator=torch.Generator().manual_seed(0)
        )
        model.lm_head.weight[following] = model.model.embed_tokens.weight.clone()
    return model


def write_target(folder, model):
    """``model`` and the byte-level tokenizer as a Hugging Face folder."""
    save_model(model, folder)
    save_tokenizer(byte_level_tokenizer(), folder)
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Four text files of random lowercase words (about 50 KB)."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    files = []
    for i in range(4):
        words = (
            "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 8)))
            for _ in range(2500)
        )
        path = root / f"doc{i}.txt"
        path.write_text(" ".join(words))
        files.append(path)
    return files


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """The cycle target's folder."""
    return write_target(tmp_path_factory.mktemp("target"), cycle_target())


def train(target_dir, corpus, out_dir, algorithm, steps, **options):
    """``train_draft`` at test sizes."""
    settings = {"batch_size": 8, "length": 64, "lr": 3e-3, "progress": False} | options
    return train_draft(
        target_dir=target_dir,
        algorithm=algorithm,
        out_dir=out_dir,
        steps=steps,
        files=corpus,
        **settings,
    )


def greedy(target, prompts, **engine_options):
    """Greedy completions of ``prompts`` (24 new tokens each)."""
    engine = engine_from_model(target, max_context=128, **engine_options)
    return [r.token_ids for r in generate(prompts, engine=engine, max_new_tokens=24)]


PROMPTS = [[256, *b"the quick brown fox"], [256, *b"jumps over"], [256, 120, 121]]


def assert_decodes_like_plain(out_dir, target_dir, algorithm, num_steps=3):
    """The saved draft loads with speculum's loader and its greedy speculative decoding
    (a chain, and for EAGLE-family heads a tree) emits plain decoding's tokens."""
    target = load_model(target_dir)
    head = recipe(algorithm).load(out_dir, target)
    plain = greedy(target, PROMPTS)
    chain = SpecOptions(num_steps=num_steps)
    assert greedy(target, PROMPTS, algorithm=algorithm, draft=head, spec=chain) == plain
    if algorithm in ("eagle", "eagle3", "mtp"):
        tree = SpecOptions(num_steps=3, topk=2, num_draft_tokens=6)
        assert greedy(target, PROMPTS, algorithm=algorithm, draft=head, spec=tree) == plain


@pytest.mark.parametrize(
    "algorithm", ["eagle", "mtp", "standalone", "multi_layer_eagle", "frozen_kv_mtp"]
)
def test_training_lowers_the_loss_and_saves_a_loadable_draft(
    algorithm, target_dir, corpus, tmp_path
):
    out_dir = tmp_path / "draft"
    metrics = train(target_dir, corpus, out_dir, algorithm, steps=30)
    record = json.loads((out_dir / "training.json").read_text())
    (_, before), *_, (_, after) = record["heldout_history"]
    assert after < 0.8 * before
    assert metrics["heldout_loss"] == after
    assert 1.0 <= metrics["acceptance_length"] <= 4.0
    assert {"accept_rate_1", "accept_rate_2", "accept_rate_3"} <= set(metrics)
    assert (out_dir / "tokenizer.json").is_file()
    # Nothing of the run is left beside the finished folder.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]
    assert_decodes_like_plain(out_dir, target_dir, algorithm)


def test_training_a_draft_for_a_mixture_of_experts_target(corpus, tmp_path):
    """``train-draft`` on an MoE target (Qwen3-MoE: 4 experts, top 2, a dense layer): the
    target's forward runs through its experts, the (dense) draft learns, and its speculative
    decoding of the MoE target equals plain decoding."""
    moe = MoEConfig(
        num_experts=4, top_k=2, expert_intermediate_size=16, norm_topk_prob=True, dense_layers=(1,)
    )
    target = cycle_target(architecture="Qwen3MoeForCausalLM", qk_norm=True, moe=moe)
    target_dir = write_target(tmp_path / "moe-target", target)
    out_dir = tmp_path / "draft"
    metrics = train(target_dir, corpus, out_dir, "mtp", steps=30)
    (_, before), *_, (_, after) = json.loads((out_dir / "training.json").read_text())[
        "heldout_history"
    ]
    assert after < 0.8 * before
    assert metrics["acceptance_length"] >= 1.0
    assert_decodes_like_plain(out_dir, target_dir, "mtp")


def test_eagle3_on_a_predictable_target_accepts_deeply(target_dir, corpus, tmp_path):
    """The acceptance length counts the bonus token: a chain of 3 drafts emits at most 4."""
    out_dir = tmp_path / "eagle3"
    metrics = train(target_dir, corpus, out_dir, "eagle3", steps=150, draft_vocab_size=64)
    assert metrics["acceptance_length"] >= 3.0
    assert metrics["acceptance_length_tree"] >= metrics["acceptance_length"]
    assert metrics["heldout_acc_0"] > 0.9
    assert metrics["draft_vocab_size"] == 64
    config = json.loads((out_dir / "config.json").read_text())
    assert config["draft_vocab_size"] == 64
    head = recipe("eagle3").load(out_dir, load_model(target_dir))
    ids = head.target_ids.tolist()
    # The vocabulary is the corpus's tokens (letters, space, <s>, </s>) and, to fill it up,
    # the lowest other ids; EOS is always in it.
    assert ids == sorted(ids) and 257 in ids and set(LETTERS.tolist()) <= set(ids)
    assert_decodes_like_plain(out_dir, target_dir, "eagle3")


@pytest.mark.parametrize(
    ("algorithm", "options"),
    [("standalone", {"distill": False}), ("multi_layer_eagle", {"chain_hidden": False})],
)
def test_recipe_variants_lower_their_loss(algorithm, options):
    """The variants ``train_draft`` passes through: plain next-token training of a standalone
    draft, and multi-layer EAGLE layers that all read the target's hidden state."""
    target = cycle_target()
    chosen, settings = recipe(algorithm), DraftOptions(num_steps=2, **options)
    tokens = torch.randint(97, 123, (4000,), generator=torch.Generator().manual_seed(0))
    split = TokenSplit(train=tokens.numpy(), heldout=tokens[:500].numpy())
    head = chosen.build(target, settings, split)
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    windows = tokens[:256].view(8, 32)
    losses = []
    for _ in range(20):
        loss, _ = chosen.loss(head, target, windows, settings)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0]
    assert not any(p.requires_grad for p in target.parameters())


def test_frequent_tokens_counts_ties_and_always_keeps_eos():
    tokens = torch.tensor([5, 5, 5, 2, 2, 7, 9, 9]).numpy()
    assert frequent_tokens(tokens, 3, 10).tolist() == [2, 5, 9]
    assert frequent_tokens(tokens, 3, 10, always=(8,)).tolist() == [2, 5, 8]
    assert frequent_tokens(tokens, 5, 10).tolist() == [0, 2, 5, 7, 9]  # ties: lower id first


def test_ttt_mask_sees_the_verified_prefix_and_its_own_ancestors():
    mask = ttt_mask(3, 3)
    step0 = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    own = torch.eye(3, dtype=torch.bool)
    none = torch.zeros(3, 3, dtype=torch.bool)
    expected = torch.cat(
        [
            torch.cat([step0, none, none], dim=1),
            torch.cat([step0, own, none], dim=1),
            torch.cat([step0, own, own], dim=1),
        ]
    )
    assert torch.equal(mask, expected)


def test_ttt_steps_equal_the_draft_chain_at_inference():
    """TTT step ``k`` at entry ``i`` is the head drafting ``k`` steps past entry ``i``: a
    causal run over entries ``0 .. i`` then ``k`` chained nodes, each fed its parent's output.
    In float64, so that the two summation orders agree far inside the tolerance."""
    target = cycle_target().double()
    head = random_draft(target, "eagle3", seed=2, std=0.3).double()
    windows = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))
    out = run_target(target, windows, head.capture_layers)
    features = head.target_features(out.final, out.captured)[:, :8]
    steps = ttt_forward(head, features, windows, 3)
    for i in (0, 4, 7):
        hidden = features[:, : i + 1]
        tokens = windows[:, 1 : i + 2]
        last = head(dense_batch(tokens), None, hidden)[:, -1:]
        torch.testing.assert_close(steps[0][:, i], last[:, 0], rtol=1e-4, atol=1e-5)
        for k in range(1, 3):
            if i + k + 1 >= windows.shape[1]:
                break
            hidden = torch.cat([hidden, last], dim=1)
            tokens = torch.cat([tokens, windows[:, i + k + 1 : i + k + 2]], dim=1)
            last = head(dense_batch(tokens), None, hidden)[:, -1:]
            torch.testing.assert_close(steps[k][:, i], last[:, 0], rtol=1e-4, atol=1e-5)


def test_frozen_kv_training_forward_equals_the_head_on_the_target_cache():
    target = cycle_target()
    head = random_frozen_kv(target, num_layers=2, source_layers=(0, 2), seed=4, std=0.3)
    windows = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(5))
    out = run_target(target, windows, (1,))
    n = windows.shape[1] - 1
    dense = dense_forward(
        head, target, target_kv(target, windows, out, (0, 2)), windows[:, 1:], out.final[:, :n]
    )
    pool = target.new_pool(8, 4)
    empty = PagedKV(
        page_table=torch.arange(1, 5)[None], seq_lens=torch.zeros(1, dtype=torch.int64), page_size=4
    )
    target(extend_batch(empty, windows, torch.tensor([windows.shape[1]])), pool)
    for i in (0, 3, n - 1):
        committed = PagedKV(
            page_table=empty.page_table, seq_lens=torch.tensor([i + 1]), page_size=4
        )
        batch = extend_batch(committed, windows[:, i + 1 : i + 2], torch.ones(1, dtype=torch.int64))
        paged = head(batch, pool, out.final[:, i : i + 1])
        torch.testing.assert_close(dense[:, i], paged[:, 0], rtol=1e-4, atol=1e-5)


def test_the_standalone_draft_loads_in_transformers(target_dir, corpus, tmp_path):
    transformers = pytest.importorskip("transformers")
    out_dir = tmp_path / "standalone"
    train(target_dir, corpus, out_dir, "standalone", steps=2)
    ours = recipe("standalone").load(out_dir, load_model(target_dir)).model
    assert ours.config.hidden_size == 16 and ours.config.num_layers == 2
    theirs = transformers.LlamaForCausalLM.from_pretrained(out_dir).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        expected = theirs(ids).logits
    torch.testing.assert_close(
        ours.logits(ours(dense_batch(ids), None)[0]), expected, atol=1e-4, rtol=1e-4
    )


def test_a_draft_of_another_target_is_refused(target_dir, corpus, tmp_path):
    out_dir = tmp_path / "draft"
    wider = cycle_target(hidden_size=48)
    save_random_draft(wider, "eagle3", out_dir)
    with pytest.raises(DraftTargetMismatch, match="different target.*hidden size.*--overwrite"):
        train(target_dir, corpus, out_dir, "eagle3", steps=1)
    # The same target's draft is not replaced by accident either; overwrite replaces both.
    metrics = train(target_dir, corpus, out_dir, "eagle3", steps=1, overwrite=True)
    assert metrics["acceptance_length"] >= 1.0
    with pytest.raises(ValueError, match="already holds a trained eagle3 draft for this target"):
        train(target_dir, corpus, out_dir, "eagle3", steps=1)


def test_a_target_of_another_vocabulary_is_refused(target_dir, corpus, tmp_path):
    other = random_model(tiny_config(vocab_size=64, num_layers=4), seed=0)
    out_dir = tmp_path / "mtp"
    save_random_draft(other, "mtp", out_dir)
    with pytest.raises(DraftTargetMismatch, match="vocabulary"):
        train(target_dir, corpus, out_dir, "mtp", steps=1)


def test_an_output_folder_of_other_contents_or_the_target_is_refused(target_dir, corpus, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="does not hold a mtp draft.*--overwrite"):
        train(target_dir, corpus, tmp_path, "mtp", steps=1)
    with pytest.raises(ValueError, match="the target's own folder"):
        train(target_dir, corpus, target_dir, "mtp", steps=1, overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_unknown_algorithm_and_missing_target_are_clear_errors(corpus, tmp_path):
    with pytest.raises(ValueError, match="no draft-training recipe for algorithm 'eagle4'.*"):
        recipe("eagle4")
    for name in RECIPES:
        assert recipe(name).name == name
    assert recipe("nextn").name == "mtp" and recipe("eagle2").name == "eagle"
    with pytest.raises(ValueError, match="eagle3, mtp, standalone"):
        train(tmp_path / "missing", corpus, tmp_path / "out", "eagle4", steps=1)
    with pytest.raises(CheckpointError, match="cannot load the target model.*does not exist"):
        train(tmp_path / "missing", corpus, tmp_path / "out", "eagle3", steps=1)


def test_an_interrupted_run_leaves_no_finished_looking_folder(
    target_dir, corpus, tmp_path, monkeypatch
):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(training_draft, "measure_acceptance", interrupted)
    out_dir = tmp_path / "draft"
    with pytest.raises(KeyboardInterrupt):
        train(target_dir, corpus, out_dir, "mtp", steps=2)
    assert not out_dir.exists()
    # Only the resumable checkpoint is left, in the work folder.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft.work"]


def test_cli_interrupted_while_measuring_resumes_after_training(
    target_dir, corpus, tmp_path, monkeypatch, capsys
):
    """Ctrl-C while acceptance is measured, after training: the message says the rerun resumes
    from the last step, and the rerun says so, does no update and saves the draft."""
    measure = training_draft.measure_acceptance

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(training_draft, "measure_acceptance", interrupted)
    out_dir = tmp_path / "draft"
    argv = ["train-draft", str(out_dir), "--target", str(target_dir), "--algorithm", "mtp"]
    argv += ["--steps", "3", "--batch-size", "4", "--length", "32", "--files", *map(str, corpus)]
    assert cli.main(argv) == 130
    err = capsys.readouterr().err
    assert "training a mtp draft" in err and "measuring acceptance" in err
    checkpoint = checkpoint_file(out_dir)
    assert err.endswith(
        "speculum: interrupted; rerun the same command to resume from step 3 of 3 (the "
        f"checkpoint in {checkpoint})\n"
    )
    monkeypatch.setattr(training_draft, "measure_acceptance", measure)
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert f"resuming from step 3 of 3 ({checkpoint})" in err
    assert "3/3 [" in err  # the bar starts where the run stopped: no update is left
    assert json.loads((out_dir / "training.json").read_text())["options"]["steps"] == 3
    assert not checkpoint.exists()
