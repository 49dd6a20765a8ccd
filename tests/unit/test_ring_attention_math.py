"""The block math of ring attention equals softmax attention over the concatenated keys (no process groups)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hpc_rlhf.models.ring_attention import (
    block_attention,
    block_attention_backward,
    block_mask,
    merge_blocks,
    ring_attention,
)
from hpc_rlhf.models.sequence_parallel import gather_from_sp, shard_for_sp


def _reference(q, k, v, mask=None):
    """Plain softmax attention with K/V heads repeated for GQA; mask (B|1, 1, Sq, Sk) True = attend."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ v


def test_block_attention_hand_checked():
    # One query, two keys with scores 0 and log(3) (scale 1): weights 1/4 and 3/4.
    q = torch.tensor([[[[1.0]]]])
    k = torch.tensor([[[[0.0], [math.log(3.0)]]]])
    v = torch.tensor([[[[10.0], [2.0]]]])
    out, lse = block_attention(q, k, v, scale=1.0)
    assert out.item() == pytest.approx(0.25 * 10 + 0.75 * 2)
    assert lse.item() == pytest.approx(math.log(4.0))
    # Merging the two keys as separate blocks gives the same.
    o1, l1 = block_attention(q, k[:, :, :1], v[:, :, :1], 1.0)
    o2, l2 = block_attention(q, k[:, :, 1:], v[:, :, 1:], 1.0)
    merged, merged_lse = merge_blocks(o1, l1, o2, l2)
    assert merged.item() == pytest.approx(4.0)
    assert merged_lse.item() == pytest.approx(math.log(4.0))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_merging_blocks_equals_softmax_over_concatenated_keys(causal, heads):
    torch.manual_seed(0)
    h, hk, s, n, d = *heads, 3, 4, 8
    q_all = torch.randn(2, h, n * s, d, dtype=torch.float64)
    k_all, v_all = torch.randn(2, hk, n * s, d, dtype=torch.float64), torch.randn(2, hk, n * s, d, dtype=torch.float64)
    full_mask = torch.ones(n * s, n * s, dtype=torch.bool).tril()[None, None] if causal else None
    expected = _reference(q_all, k_all, v_all, full_mask)
    scale = 1 / math.sqrt(d)
    for r in range(n):  # query chunk r, key blocks merged in ring order r, r-1, ...
        q = q_all[:, :, r * s : (r + 1) * s]
        out = lse = None
        for step in range(n):
            src = (r - step) % n
            if causal and src > r:
                continue
            mask = block_mask(None, None, s, s, diagonal=causal and src == r)
            sl = slice(src * s, (src + 1) * s)
            o, l = block_attention(q, k_all[:, :, sl], v_all[:, :, sl], scale, mask)
            out, lse = merge_blocks(out, lse, o, l)
        torch.testing.assert_close(out, expected[:, :, r * s : (r + 1) * s].float(), rtol=1e-5, atol=1e-6)


def test_segments_and_padding_mask():
    """Packed samples attend only themselves; padding (-1) is invisible; fully masked rows give 0."""
    torch.manual_seed(1)
    seg = torch.tensor([[0, 0, 1, 1, 1, -1]])
    q, k, v = torch.randn(1, 2, 6, 4), torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4)
    mask = block_mask(seg, seg, 6, 6, diagonal=True)
    out, lse = block_attention(q, k, v, 0.5, mask)
    for lo, hi in ((0, 2), (2, 5)):
        alone = _reference(q[:, :, lo:hi] * math.sqrt(4) * 0.5, k[:, :, lo:hi], v[:, :, lo:hi],
                           torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()[None, None])
        torch.testing.assert_close(out[:, :, lo:hi], alone, rtol=1e-5, atol=1e-6)
    assert torch.isneginf(lse[:, :, 5]).all() and (out[:, :, 5] == 0).all()
    # Merging a fully masked block with a fully masked block stays finite.
    merged, merged_lse = merge_blocks(out, lse, out, lse)
    assert torch.isfinite(merged).all() and torch.isneginf(merged_lse[:, :, 5]).all()


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_block_backward_matches_autograd(heads):
    torch.manual_seed(2)
    h, hk, s, n, d = *heads, 3, 2, 5
    q = torch.randn(1, h, s, d, dtype=torch.float64, requires_grad=True)
    k_all = torch.randn(1, hk, n * s, d, dtype=torch.float64, requires_grad=True)
    v_all = torch.randn(1, hk, n * s, d, dtype=torch.float64, requires_grad=True)
    # q is the last chunk: causal over both blocks (full earlier block, triangular own block).
    mask = torch.ones(s, n * s, dtype=torch.bool)
    mask[:, s:] = torch.ones(s, s, dtype=torch.bool).tril()
    out = _reference(q, k_all, v_all, mask[None, None])
    dout = torch.randn_like(out)
    out.backward(dout)
    scale = 1 / math.sqrt(d)
    blocks = [(slice(0, s), None), (slice(s, 2 * s), block_mask(None, None, s, s, diagonal=True))]
    o = l = None
    for sl, m in blocks:
        bo, bl = block_attention(q.detach(), k_all.detach()[:, :, sl], v_all.detach()[:, :, sl], scale, m)
        o, l = merge_blocks(o, l, bo, bl)
    delta = (dout.float() * o).sum(-1)
    dq = 0
    for sl, m in blocks:
        dq_b, dk_b, dv_b = block_attention_backward(q.detach(), k_all.detach()[:, :, sl], v_all.detach()[:, :, sl],
                                                    dout, delta, l, scale, m)
        dq = dq + dq_b
        torch.testing.assert_close(dk_b, k_all.grad[:, :, sl].float(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(dv_b, v_all.grad[:, :, sl].float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dq, q.grad.float(), rtol=1e-4, atol=1e-5)


def test_single_rank_ring_is_plain_attention():
    """A ring of one: no communication, equals SDPA, gradients too (default group of a 1-rank world)."""
    import socket

    import torch.distributed as dist

    owner = not dist.is_initialized()
    if owner:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        torch.manual_seed(3)
        q = torch.randn(2, 4, 6, 8, requires_grad=True)
        k = torch.randn(2, 2, 6, 8, requires_grad=True)
        v = torch.randn(2, 2, 6, 8, requires_grad=True)
        out = ring_attention(q, k, v, None, causal=True)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
        for g, rg in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, rg, rtol=1e-5, atol=1e-5)
    finally:
        if owner:
            dist.destroy_process_group()


@pytest.mark.parametrize("pack", [False, True])
def test_shard_for_sp_round_trip(pack):
    """Sharding then concatenating the chunks (a stand-in for the all_gather) restores the batch."""
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 0]])
    mask = (ids != 0).long()
    shards = [shard_for_sp(ids, mask, sp_rank=r, sp_size=3, pack=pack) for r in range(3)]
    assert all(s.local_len == shards[0].local_len for s in shards)
    joined = torch.cat([s.input_ids for s in shards], 1)
    one = shards[0]
    whole = dataclasses.replace(one, sp_size=1)  # gather_from_sp without communication
    torch.testing.assert_close(gather_from_sp(joined, whole, None) * mask, ids * mask)
    labels = gather_from_sp(torch.cat([s.labels for s in shards], 1), whole, None)
    # Every real token except the last of its row is labelled with its successor.
    assert labels[0, 2:4].tolist() == [6, 7] and labels[1, :3].tolist() == [9, 10, 11]
    positions = gather_from_sp(torch.cat([s.position_ids for s in shards], 1), whole, None)
    assert positions[0, 2:].tolist() == [0, 1, 2] and positions[1, :4].tolist() == [0, 1, 2, 3]
    if pack:
        assert one.cu_seqlens.tolist() == [0, 3, 7, 9] and one.pad_len == 2
        assert torch.cat([s.segment_ids for s in shards], 1).tolist() == [[0, 0, 0, 1, 1, 1, 1, -1, -1]]
    else:
        assert one.pad_len == 1 and one.local(mask).shape == (2, 2)


def test_ring_flash_backend_refuses_an_unpacked_shard():
    import types

    from hpc_rlhf.models import sequence_parallel as sp

    shard = shard_for_sp(torch.ones(1, 4, dtype=torch.long), sp_rank=0, sp_size=1, pack=False)
    model = types.SimpleNamespace(config=types.SimpleNamespace(num_attention_heads=4, _attn_implementation="sdpa"))
    with (pytest.raises(ValueError, match="ring_flash backend needs a packed shard"),
          sp.sequence_parallel_attention(model, None, shard, backend="ring_flash")):
        pass
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="token_index exists only for a packed shard"):
        gather_from_sp(torch.zeros(1, 4), dataclasses.replace(shard, packed=True), None)


def test_ring_flash_backend_fails_clearly_without_the_package():
    import importlib.util
    import types

    from hpc_rlhf.models import sequence_parallel as sp

    if importlib.util.find_spec("ring_flash_attn") is not None:
        pytest.skip("ring-flash-attn is installed here")
    shard = shard_for_sp(torch.ones(1, 4, dtype=torch.long), sp_rank=0, sp_size=1, pack=True)
    model = types.SimpleNamespace(config=types.SimpleNamespace(
        num_key_value_heads=2, num_attention_heads=4, _attn_implementation="sdpa"))
    with pytest.raises(ImportError, match="ring-flash-attn is not installed"):
        with sp.sequence_parallel_attention(model, None, shard, backend="ring_flash"):
            pass
    assert model.config._attn_implementation == "sdpa"
    assert sp.resolve_backend("auto", shard, torch.device("cpu")) == "ring"
    with pytest.raises(RuntimeError, match="sequence_parallel_attention"):
        sp.ring_attention_forward(torch.nn.Module(), *(torch.zeros(1, 1, 2, 2),) * 3, None)
