"""Test targets that are "mostly Markov", and draft heads built to agree with them, so that
speculative rounds accept deep paths while the target still depends on its KV cache."""

from __future__ import annotations

import torch
from conftest import tiny_config

from speculum.models.block_draft import random_block_draft
from speculum.models.decoder import DecoderModel, SparseMoE
from speculum.models.draft import random_draft
from speculum.models.draft_loading import LAYOUTS
from speculum.models.loading import random_model
from speculum.models.multi_layer_eagle import random_multi_layer
from speculum.runtime import scheduler
from speculum.runtime.engine import NgramOptions, SpecOptions, engine_from_model
from speculum.runtime.generate import generate, run_to_completion
from speculum.spec.paged import causal_mask
from speculum.spec.tree import tree_mask
from speculum.state.tree import DraftTree

#: The draft layouts a head of any target family can be written in: ``qwen3-next-mtp`` holds
#: Qwen3-Next's own MTP layer only (tests/cover/test_qwen3_next_mtp.py covers it).
PORTABLE_LAYOUTS = sorted(name for name in LAYOUTS if name != "qwen3-next-mtp")


def markov_target(vocab: int, head_scale: float = 1.0, **changes: object) -> DecoderModel:
    """A random target whose next token is usually a fixed function of the last one.

    Its lm_head reads the embedding back through a permutation (scaled by ``head_scale``), so
    the residual stream's embedding term votes for ``perm^-1(last token)``; the random layers
    (std 0.18) add enough context that the vote is overruled now and then. A ``head_scale``
    below 1 keeps temperature-1 distributions away from one-hot. ``changes`` override fields
    of the config (another layer kind, say).
    """
    config = tiny_config(
        **{"vocab_size": vocab, "num_layers": 4, "tie_word_embeddings": False, **changes}
    )
    model = random_model(config, seed=5, std=0.18)
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0, generator=generator)
        perm = torch.randperm(vocab, generator=generator)
        model.lm_head.weight.copy_(head_scale * model.model.embed_tokens.weight[perm])
    return model


def agreeing_head(target: DecoderModel, algorithm: str, seed: int = 3):
    """An EAGLE-1 or MTP head that mostly predicts the target's Markov vote.

    Its input projection passes the token embedding through and its MLP adds nothing, so its
    logits are the target's ``lm_head`` applied to that embedding, plus small terms from the
    target's hidden state and from attention (kept small but non-zero, so that the features
    handed over by verify and the draft's own KV cache still matter).
    """
    head = random_draft(target, algorithm, seed=seed, std=0.3)
    if algorithm == "eagle":
        agree_(head.fc, head.layers[0])
    else:
        agree_(head.eh_proj, head.decoder)
    return head


def agreeing_multi_layer(target: DecoderModel, num_layers: int, seed: int = 3):
    """A multi-layer EAGLE head whose every MTP layer agrees as :func:`agreeing_head`'s."""
    head = random_multi_layer(target, num_layers, seed=seed, std=0.3)
    for layer in head.layers:
        agree_(layer.eh_proj, layer.decoder)
    return head


def agreeing_dspark(target, block_size: int = 5, scale: float = 50.0, seed: int = 3):
    """A DSPARK head whose Markov head predicts the target's Markov vote (the token ``v``
    whose ``lm_head`` row best matches the previous token's embedding): ``W1`` is the
    identity, ``W2`` the target's ``lm_head`` against its embedding, scaled up to dominate the
    random backbone, so rounds accept deep while the backbone, its context and its cache still
    run (and feed the confidence head)."""
    vocab = target.config.vocab_size
    head = random_block_draft(
        target, "dspark", seed=seed, std=0.3, block_size=block_size, markov_rank=vocab
    )
    embed, lm = target.model.embed_tokens.weight, target.lm_head.weight
    with torch.no_grad():
        head.markov_head.markov_w1.weight.copy_(torch.eye(vocab))
        votes = lm @ embed.T  # [next, previous]
        head.markov_head.markov_w2.weight.copy_(scale * votes / votes.abs().amax())
    return head


def agree_(projection: torch.nn.Linear, layer: torch.nn.Module) -> None:
    """Make a draft's input ``projection`` over ``[embedding; hidden]`` pass the embedding
    through (the hidden input damped), damp the decoder ``layer``'s attention output and
    silence its MLP, in place."""
    width = projection.out_features
    with torch.no_grad():
        projection.weight[:, :width] = torch.eye(width)
        projection.weight[:, width:] *= 0.1
        if projection.bias is not None:
            projection.bias.zero_()
        layer.self_attn.o_proj.weight.mul_(0.1)
        silence_mlp(layer.mlp)


def silence_mlp(mlp: torch.nn.Module) -> None:
    """Zero the output projections of a layer's MLP block, dense or mixture of experts (every
    expert, and the shared one), so that the block adds nothing to the residual stream."""
    with torch.no_grad():
        for name, param in mlp.named_parameters():
            if name.endswith(("down_proj.weight", "experts_down")):
                param.zero_()


def draw_correction_biases_(model, seed: int) -> None:
    """Give the routers non-zero ``e_score_correction_bias`` (``random_model`` zeroes biases),
    so that they change which experts are chosen."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3, generator=generator)


def pipeline_engine(target, pipeline: tuple, tree: tuple[int, int, int], **limits):
    """An engine over ``target`` for ``pipeline`` = ``(algorithm, draft, spec)``, where
    ``spec`` is ``SpecOptions`` fields or ``"tree"`` for the drawn ``(num_steps, topk,
    num_draft_tokens)``; n-gram stores nothing across requests; ``limits`` are
    ``engine_from_model``'s other options (``max_context`` 48 unless given)."""
    algorithm, draft, spec = pipeline
    if spec == "tree":
        spec = dict(zip(("num_steps", "topk", "num_draft_tokens"), tree, strict=True))
    return engine_from_model(
        target,
        algorithm=algorithm,
        draft=draft,
        spec=SpecOptions(**spec),
        ngram=NgramOptions(store_tokens=0) if algorithm == "ngram" else None,
        **({"max_context": 48} | limits),
    )


def assert_sampled_snapshot_replays(engine, steps: int = 3, max_new_tokens: int = 16) -> None:
    """A snapshot of three seeded sampled requests taken after ``steps`` steps on ``engine``,
    restored, replays bit for bit what the original state went on to emit."""
    state = scheduler.new_state(engine)
    rids = []
    for seed, prompt in enumerate([[4, 2, 8], [1] * 7, [15, 3, 3, 9]]):
        sampling = scheduler.Sampling(temperature=1.0, top_p=0.9, seed=seed)
        state, rid = scheduler.add_request(
            engine, state, prompt, sampling=sampling, max_new_tokens=max_new_tokens
        )
        rids.append(rid)
    for _ in range(steps):
        state, _ = scheduler.step(engine, state)
    snap = scheduler.take_snapshot(engine, state)
    _, finished = run_to_completion(engine, state)
    first = [finished[rid].output for rid in rids]
    _, finished = run_to_completion(engine, scheduler.restore(engine, snap))
    assert [finished[rid].output for rid in rids] == first


def transformers_greedy(hf, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy ``generate`` tokens of ``hf`` after each prompt, one at a time."""
    return [
        hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        for p in prompts
    ]


def assert_greedy_equals_transformers(hf, target: DecoderModel) -> None:
    """Plain greedy decoding of ``target`` through the scheduler (chunked prefill, a batch of
    prompts of several lengths) emits transformers' ``generate`` tokens of ``hf``, token for
    token."""
    engine = engine_from_model(target, page_size=4, max_context=64, prefill_budget=7)
    prompts = [[3, 17, 42, 5], [9] * 11, [1, 2]]
    results = generate(prompts, engine=engine, max_new_tokens=16, ignore_eos=True)
    for prompt, result in zip(prompts, results, strict=True):
        expected = hf.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0
        )[0, len(prompt) :]
        assert list(result.token_ids) == expected.tolist()


def assert_tree_states_follow_paths(run, parents: list[int], prefix: int, pools) -> None:
    """Over a draft tree of ``parents``, a recurrent layer's output and candidate conv and
    recurrent states at each node are exactly what running its path (root to node) as a chain
    after the same committed state gives: a node's state follows its path, never a sibling's.

    ``pools()`` gives fresh, equal ``(conv, ssm)`` states of one layer (``[slot, ring, ...]``);
    ``run(conv, ssm, mask, nodes)`` runs the layer's scan at slot 1 after ``prefix`` committed
    tokens over the inputs of ``nodes`` under ``mask`` and returns its outputs.
    """
    n = len(parents)
    tree = DraftTree(
        tokens=torch.zeros(1, n, dtype=torch.int64),
        parents=torch.tensor([parents]),
        depths=torch.zeros(1, n, dtype=torch.int64),
    )
    conv, ssm = pools()
    ring = conv.shape[1]
    out = run(conv, ssm, tree_mask(tree), list(range(n)))
    for node in range(n):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        chain_conv, chain_ssm = pools()
        chain = run(chain_conv, chain_ssm, causal_mask(1, len(path)), path)
        assert torch.equal(out[:, node], chain[:, -1])
        tree_entry, chain_entry = (prefix + node) % ring, (prefix + len(path) - 1) % ring
        assert torch.equal(ssm[1, tree_entry], chain_ssm[1, chain_entry])
        assert torch.equal(conv[1, tree_entry], chain_conv[1, chain_entry])


def assert_pipeline_equals_plain(engine_for, name: str, prompts, tree, **limits) -> None:
    """Greedy decoding of ``prompts`` (10 new tokens) on ``engine_for(name, tree, **limits)``
    emits exactly the tokens of ``engine_for("plain", tree, **limits)``."""
    ours = generate(prompts, engine=engine_for(name, tree, **limits), max_new_tokens=10)
    plain = generate(prompts, engine=engine_for("plain", tree, **limits), max_new_tokens=10)
    assert [r.token_ids for r in ours] == [r.token_ids for r in plain]
