"""Inputs shared by the recurrent kernels' parity tests, on the CPU (Triton's interpreter,
``tests/cover/test_kernel_recurrent.py``) and on a GPU (``tests/gpu/test_kernel_recurrent_gpu.py``).

A case is one forward of ``q`` queries over a recurrent pool whose ring entries hold random
states (so every read of a parent's entry matters): a chain (prefill chunks, decode, draft
steps, chain verify) or a tree whose node ``i`` hangs under a random earlier node, or under a
token of an earlier forward when the mask's tail is longer than ``q``.
"""

from __future__ import annotations

import torch

from speculum.spec.recurrent import gated_delta_rule, mamba2_scan


def tree_mask(parents: list[list[int]], tail: int) -> torch.Tensor:
    """``[batch, q, tail]`` mask of queries at tail indices ``tail - q + i`` whose parent is
    ``parents[b][i]`` (a tail index, -1 for the committed prefix): each row allows itself,
    its parent and the parent's ancestors among the queries."""
    batch, q = len(parents), len(parents[0])
    offset = tail - q
    mask = torch.zeros(batch, q, tail, dtype=torch.bool)
    for b, row in enumerate(parents):
        for i, parent in enumerate(row):
            mask[b, i, offset + i] = True
            while parent >= 0:
                mask[b, i, parent] = True
                parent = row[parent - offset] if parent >= offset else -1
    return mask


def random_parents(gen, batch: int, q: int, offset: int, chain: bool) -> list[list[int]]:
    """Each query's parent tail index: the previous one (a chain), or a random earlier
    index or -1 (a tree)."""
    if chain:
        return [[offset + i - 1 for i in range(q)] for _ in range(batch)]
    ends = torch.arange(q) + offset
    return [[int(torch.randint(-1, int(e), (), generator=gen)) for e in ends] for _ in range(batch)]


def forward_case(gen, batch: int, q: int, chain: bool, channels: int, kernel: int, state, ring):
    """``(pool args, q_lens, mask, conv inputs)`` of one forward: ``state`` is the shape of
    one head block ``[head, a, b]``; ``ring`` entries per slot, with a spare slot no row
    names (which must stay untouched) and the padding slot 0."""
    offset = int(torch.randint(0, 3, (), generator=gen))
    tail = offset + q
    parents = random_parents(gen, batch, q, offset, chain)
    slots_total = batch + 2
    conv = torch.randn(slots_total, ring, channels, kernel - 1, generator=gen)
    ssm = torch.randn(slots_total, ring, *state, generator=gen) * 0.5
    slots = torch.randperm(slots_total - 1, generator=gen)[:batch] + 1
    prefix_lens = torch.randint(0, 2 * ring, (batch,), generator=gen)
    # A row with no committed prefix reads zeros for its first token.
    prefix_lens[0] = 0 if offset == 0 else prefix_lens[0]
    q_lens = torch.randint(1, q + 1, (batch,), generator=gen)
    q_lens[-1] = q
    mask = tree_mask(parents, tail)
    mixed = torch.randn(batch, q, channels, generator=gen)
    return (conv, ssm, slots, prefix_lens, q_lens, mask), mixed


def delta_rule_inputs(gen, batch: int, q: int, chain: bool, dims, ring: int, kernel: int = 4):
    """Arguments of ``speculum::gated_delta_rule`` (the pool's states random)."""
    k_heads, k_dim, v_heads, v_dim = dims
    channels = 2 * k_heads * k_dim + v_heads * v_dim
    pool, mixed = forward_case(
        gen, batch, q, chain, channels, kernel, (v_heads, k_dim, v_dim), ring
    )
    weight = torch.randn(channels, kernel, generator=gen) * 0.5
    gate = -torch.rand(batch, q, v_heads, generator=gen)
    beta = torch.rand(batch, q, v_heads, generator=gen)
    return (*pool, mixed, weight, gate, beta, list(dims))


def mamba2_inputs(gen, batch: int, q: int, chain: bool, dims, ring: int, kernel: int = 4):
    """Arguments of ``speculum::mamba2_scan`` (the pool's states random)."""
    heads, head_dim, groups, d_state = dims
    channels = heads * head_dim + 2 * groups * d_state
    pool, xbc = forward_case(
        gen, batch, q, chain, channels, kernel, (heads, head_dim, d_state), ring
    )
    weight = torch.randn(channels, kernel, generator=gen) * 0.5
    bias = torch.randn(channels, generator=gen) * 0.1
    dt = torch.rand(batch, q, heads, generator=gen) * 0.5
    A = -torch.rand(heads, generator=gen) * 2
    D = torch.randn(heads, generator=gen)
    return (*pool, xbc, weight, bias, dt, A, D, list(dims))


REFERENCES = {"gated_delta_rule": gated_delta_rule, "mamba2_scan": mamba2_scan}
INPUTS = {"gated_delta_rule": delta_rule_inputs, "mamba2_scan": mamba2_inputs}


def compare(kind: str, launcher, args, device: str, atol: float, rtol: float) -> None:
    """Run the reference on CPU copies and ``launcher`` on ``device`` copies of ``args``; the
    valid queries' outputs and every slot's states but the padding slot's must agree."""
    cpu = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    dev = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    expected = REFERENCES[kind](*cpu)
    got = launcher(*dev).cpu()
    q_lens = args[4]
    for b, n in enumerate(q_lens.tolist()):
        torch.testing.assert_close(got[b, :n], expected[b, :n], atol=atol, rtol=rtol)
    for ours, theirs in zip(dev[:2], cpu[:2]):
        torch.testing.assert_close(ours.cpu()[1:], theirs[1:], atol=atol, rtol=rtol)
