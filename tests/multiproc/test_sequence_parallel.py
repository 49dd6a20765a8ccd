"""Ring attention and sequence-parallel Llama forward/backward on 2 and 4 gloo ranks equal the unsplit ones."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.multiproc.spawn import run_on_ranks

pytestmark = pytest.mark.slow
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _sdpa(q, k, v, mask):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _check_ring(sp_group, seed: int, segments: torch.Tensor | None, causal: bool = True) -> None:
    """Every rank builds the same full q, k, v; its chunk through the ring must match SDPA on the whole."""
    from hpc_rlhf.models.ring_attention import ring_attention

    n, r = dist.get_world_size(sp_group), dist.get_rank(sp_group)
    torch.manual_seed(seed)
    b, h, hk, s, d = 2, 4, 2, 3, 8
    q_all = torch.randn(b, h, n * s, d, requires_grad=True)
    k_all = torch.randn(b, hk, n * s, d, requires_grad=True)
    v_all = torch.randn(b, hk, n * s, d, requires_grad=True)
    weights = torch.randn(b, h, n * s, d)
    order = torch.ones(n * s, n * s, dtype=torch.bool)
    order = order.tril()[None, None] if causal else order[None, None]
    mask, valid = order, torch.ones(b, n * s, dtype=torch.bool)
    if segments is not None:
        same = (segments[:, :, None] == segments[:, None, :]) & (segments[:, None, :] >= 0)
        valid = segments >= 0
        mask = order & same[:, None] | torch.eye(n * s, dtype=torch.bool)  # pads see themselves: no NaN rows
    expected = _sdpa(q_all, k_all, v_all, mask) * valid[:, None, :, None]
    (expected * weights).sum().backward()

    sl = slice(r * s, (r + 1) * s)
    q, k, v = (x.detach()[:, :, sl].clone().requires_grad_(True) for x in (q_all, k_all, v_all))
    local_seg = None if segments is None else segments[:, sl]
    out = ring_attention(q, k, v, sp_group, causal=causal, segment_ids=local_seg)
    out = out * valid[:, None, sl, None]
    torch.testing.assert_close(out, expected.detach()[:, :, sl], **TOL)
    (out * weights[:, :, sl]).sum().backward()
    for got, full in ((q, q_all), (k, k_all), (v, v_all)):
        torch.testing.assert_close(got.grad, full.grad[:, :, sl], **TOL)


def _ring_attention_ranks(rank: int, world_size: int) -> bool:
    whole = dist.new_group(list(range(world_size)))
    pairs = [dist.new_group(p) for p in ([0, 2], [1, 3])] if world_size == 4 else []
    n = world_size
    _check_ring(whole, seed=0, segments=None)
    # Packed samples crossing chunk boundaries, plus padding.
    seg = torch.tensor([[0] * 2 + [1] * (3 * n - 3) + [-1], [-1] * 2 + [0] * (3 * n - 2)])
    _check_ring(whole, seed=1, segments=seg)
    _check_ring(whole, seed=4, segments=seg, causal=False)
    if pairs:  # rings of non-consecutive global ranks: the p2p peers are mapped through the group
        _check_ring(pairs[rank % 2], seed=2 + rank % 2, segments=None)
    return True


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    return LlamaForCausalLM(config).float().eval()


def _llama_ranks(rank: int, world_size: int) -> bool:
    from hpc_rlhf.models.forward import position_ids_from_mask
    from hpc_rlhf.models.logprobs import logprobs_from_logits
    from hpc_rlhf.models.sequence_parallel import (
        gather_from_sp,
        sequence_parallel_attention,
        shard_for_sp,
        sp_token_logprobs,
    )

    group = dist.new_group(list(range(world_size)))
    model = _tiny_llama()
    params = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(1)
    t = 4 * world_size + 3  # not a multiple of the ring size: the shards get padded
    ids = torch.randint(1, 64, (3, t))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left-padded prompt
    mask[1, -2:] = 0  # right-padded response
    mask[2, :1] = 0
    mask[2, -1:] = 0
    ids = ids * mask
    # Weight of the logprob at column c (predicting token c+1): only where both tokens are real.
    valid = (mask[:, :-1] * mask[:, 1:]).bool()
    coef = torch.rand(3, t - 1) * valid
    coef = coef / valid.sum()  # normalised by the GLOBAL token count

    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    ref_lp = logprobs_from_logits(logits[:, :-1], ids[:, 1:])
    model.zero_grad()
    (ref_lp * coef).sum().backward()
    ref_grads = [p.grad.clone() for p in params]
    weights = torch.cat([coef, torch.zeros(3, 1)], 1)  # (B, T): column t weighs the logprob of token t+1

    for pack in (False, True):
        shard = shard_for_sp(ids, mask, sp_rank=rank, sp_size=world_size, pack=pack)
        for mode in ("local", "replicated", "checkpointed"):
            model.zero_grad()
            if mode == "checkpointed":  # recomputed layers run the ring again during backward
                if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
                    model.activation_checkpointing_enable({"use_reentrant": False})
                else:
                    model.gradient_checkpointing_enable({"use_reentrant": False})
                model.train()
            with sequence_parallel_attention(model, group, shard, backend="ring") as backend:
                assert backend == "ring"
                local_lp = sp_token_logprobs(model, shard)
                full_lp = gather_from_sp(local_lp, shard, group)
                torch.testing.assert_close(full_lp[:, :-1][valid], ref_lp[valid].detach(), **TOL)
                if mode == "replicated":  # every rank: the same loss on the gathered logprobs
                    loss = (full_lp * weights).sum()
                else:  # each rank: its own tokens, normalised by the global count
                    loss = (local_lp * shard.local(weights)).sum()
                loss.backward()  # inside the block: needed when layers are recomputed
            assert model.config._attn_implementation == "sdpa"  # restored
            for p in params:  # what the engine's gradient reduction must do across the sp group: SUM
                dist.all_reduce(p.grad, group=group)
            for p, ref in zip(params, ref_grads, strict=True):
                torch.testing.assert_close(p.grad, ref, **TOL)
        # Leaving the block before backward would let the recomputed layers skip the ring: refused.
        with pytest.raises(RuntimeError, match="inside the `with` block"):
            with sequence_parallel_attention(model, group, shard, backend="ring"):
                sp_token_logprobs(model, shard)
        for module in model.modules():
            if hasattr(module, "gradient_checkpointing"):
                module.gradient_checkpointing = False
        model.eval()
    _check_policy_entropy(rank, world_size, group, model, ids, mask)
    _check_values(rank, world_size, group, ids, mask)
    return True


def _check_policy_entropy(rank, world_size, group, model, ids, mask) -> None:
    """The actor's sequence-parallel forward gives the unsplit response log-probs and entropy, padded and packed,
    and a logged entropy (``entropy_grad=False``) comes back detached."""
    from hpc_rlhf.models.forward import policy_logprobs
    from hpc_rlhf.models.micro_forward import SequenceParallel, forward_scope

    num_actions = 4
    action = mask[:, -num_actions:].bool()
    rows = {"sequences": ids, "attention_mask": mask, "action_mask": action}
    ref_lp, ref_ent = policy_logprobs(model, ids, mask, num_actions, 0.8, with_entropy=True)
    for packed in (False, True):
        with forward_scope(model, rows, packed=packed, sp=SequenceParallel(group, rank, world_size)) as fwd:
            lp, ent = fwd.policy_logprobs(0.8, with_entropy=True, entropy_grad=False)
        assert lp.requires_grad and not ent.requires_grad
        torch.testing.assert_close(lp[action], ref_lp[action].detach(), **TOL)
        torch.testing.assert_close(ent[action], ref_ent[action].detach(), **TOL)


def _check_values(rank, world_size, group, ids, mask) -> None:
    """Critic values (score head on every hidden state) gathered from the chunks equal token_values, and
    reward-model scores (the value at each row's last real token) equal sequence_scores."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from hpc_rlhf.models.forward import sequence_scores, token_values
    from hpc_rlhf.models.micro_forward import SequenceParallel, forward_scope
    from hpc_rlhf.models.sequence_parallel import (
        gather_from_sp,
        sequence_parallel_attention,
        shard_for_sp,
        sp_token_values,
    )

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, num_labels=1)
    critic = LlamaForSequenceClassification(config).eval()
    with torch.no_grad():
        ref = token_values(critic, ids, mask)
        shard = shard_for_sp(ids, mask, sp_rank=rank, sp_size=world_size, pack=True)
        with sequence_parallel_attention(critic, group, shard):
            values = gather_from_sp(sp_token_values(critic, shard), shard, group)
    torch.testing.assert_close(values[mask.bool()], ref[mask.bool()], **TOL)
    with torch.no_grad():
        expected = sequence_scores(critic, ids, mask)
        for packed in (False, True):
            sp = SequenceParallel(group, rank, world_size)
            with forward_scope(critic, {"sequences": ids, "attention_mask": mask}, packed=packed, sp=sp) as fwd:
                torch.testing.assert_close(fwd.sequence_scores(), expected, **TOL)


def _check_moe_router(rank, world_size, group) -> None:
    """An MoE actor under sequence parallelism: each rank routes its chunk. The load-balancing loss and the routing
    statistics reduced over the group equal the unsplit forward's (transformers' own loss function there), and the
    gradients summed over the group equal the unsplit gradients, padded and packed; with routing replay, each rank
    replays its chunk's recorded routes: the log-probs, ``moe/route_mismatch`` and the gradients are the unsplit
    replayed forward's."""
    from hpc_rlhf.algos.moe import not_recorded
    from hpc_rlhf.models.micro_forward import SequenceParallel, forward_scope
    from hpc_rlhf.models.moe import load_balancing_loss, routing_statistics
    from tests.unit.test_moe import _moe_model

    model = _moe_model()
    torch.manual_seed(3)
    t, num_actions = 4 * world_size + 3, 4
    ids = torch.randint(1, 32, (3, t))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, -2:] = 0
    ids = ids * mask
    action = mask[:, -num_actions:].bool()
    # recorded routes: 2 distinct experts of 4 per (token, layer), unrecorded on padding
    routes = torch.rand(3, t, 2, 4).argsort(dim=-1)[..., :2].to(torch.uint8)
    routes[~mask.bool()] = not_recorded(torch.uint8)
    for replay in (False, True):
        rows = {"sequences": ids, "attention_mask": mask, "action_mask": action,
                **({"routed_experts": routes} if replay else {})}
        params = [p for p in model.parameters() if p.requires_grad]
        model.zero_grad()
        with forward_scope(model, rows, replay=replay) as fwd:
            lp, _ = fwd.policy_logprobs(with_router=True)
            expected = load_balancing_loss(model, fwd.router_logits)
            expected_stats = routing_statistics(fwd.router_logits, 2, fwd.recorded_routes)
            (expected + lp[action].sum()).backward()
        expected_lp = lp.detach()
        params = [p for p in params if p.grad is not None]
        assert any(p.grad.abs().sum() > 0 for p in params)
        expected_grads = [p.grad.clone() for p in params]
        assert ("moe/route_mismatch" in expected_stats) == replay
        for packed in (False, True):
            model.zero_grad()
            sp = SequenceParallel(group, rank, world_size)
            with forward_scope(model, rows, packed=packed, sp=sp, replay=replay) as fwd:
                lp, _ = fwd.policy_logprobs(with_router=True)
                aux = load_balancing_loss(model, fwd.router_logits, sp_group=group)
                stats = routing_statistics(fwd.router_logits, 2, fwd.recorded_routes, sp_group=group)
                (aux + lp[action].sum()).backward()  # replicated: each rank back-propagates through its chunk
            torch.testing.assert_close(aux.detach(), expected.detach(), **TOL)
            torch.testing.assert_close(lp[action].detach(), expected_lp[action], **TOL)
            assert stats.keys() == expected_stats.keys()
            for key, value in expected_stats.items():
                assert stats[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
            for p, ref in zip(params, expected_grads, strict=True):
                dist.all_reduce(p.grad, group=group)
                # sums of O(1) log-prob gradients over up to 4 chunks in another order: fp32 rounding ~1e-5
                torch.testing.assert_close(p.grad, ref, rtol=1e-4, atol=1e-4)


def _all_checks(rank: int, world_size: int) -> bool:
    # torch was imported before spawn.py set OMP_NUM_THREADS: without this, 4 ranks x 2 threads on 2 cores
    # spin against each other and the test is ~10x slower.
    torch.set_num_threads(1)
    if not (_ring_attention_ranks(rank, world_size) and _llama_ranks(rank, world_size)):
        return False
    _check_moe_router(rank, world_size, dist.new_group(list(range(world_size))))
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_attention_and_sp_llama_match_unsplit(world_size):
    """One spawn per world size (process start-up dominates): ring attention vs SDPA, then the model."""
    assert all(run_on_ranks(_all_checks, world_size))
