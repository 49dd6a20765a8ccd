"""Ring attention: exact causal attention over a sequence split across the ranks of an sp group.

Layout. The sequence dimension of a batch is cut into ``sp_size`` contiguous, equal chunks in sp-rank
order: sp rank ``r`` holds global positions ``[r * S, (r + 1) * S)`` of every row (``S`` = local length;
see ``hpc_rlhf.models.sequence_parallel.shard_for_sp`` which pads the batch to a multiple of ``sp_size``).
Each rank passes its ``q, k, v`` of shape (B, H, S, D) / (B, Hk, S, D); ``H`` a multiple of ``Hk`` (GQA).

Algorithm (Liu et al. 2023, "Ring Attention with Blockwise Transformers", arXiv:2310.01889; the merge is
the online softmax of FlashAttention, Dao et al. 2022). Forward: ``sp_size`` steps; at step ``t`` rank
``r`` holds the K/V block of rank ``r - t`` (mod n), attends its local queries to it, and merges the block
output into its running output with the log-sum-exp trick, while the block moves one rank further round
the ring (``batch_isend_irecv``; the next transfer overlaps the current block's compute). Causal: a block
from a later rank is skipped, the own block is lower-triangular, earlier blocks are full; packed rows and
padding are handled by per-token ``segment_ids`` that travel with K/V (a query attends a key only when
both carry the same segment id >= 0). Backward (custom ``autograd.Function``): K/V go round the ring again
together with a dK/dV accumulator; each rank adds its contribution for the block it holds, and after
``n`` hops the accumulator arrives back at the block's owner. dQ stays local.

Memory: each rank holds its own K/V, one in-flight K/V block and (backward) one dK/dV block, i.e.
O(S) not O(n * S). The all-gather alternative (Llama 3 style, what ``ring-flash-attn``'s
``llama3_flash_attn_varlen_func`` does on GPU, chunked over ``heads_k_stride`` kv heads) holds the whole
sequence's K/V for ``heads_k_stride`` heads at once: fewer, larger messages, O(n * S) K/V memory.

Load balance: with the contiguous split under a causal mask the last rank computes n blocks and the
first one; a zigzag split would even it out. This module is the exact CPU / any-backend reference and
fallback; on GPU use the flash-attn path in ``sequence_parallel``.

The block math (``block_attention``, ``merge_blocks``, ``block_attention_backward``, ``block_mask``)
is pure and testable without process groups.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = [
    "block_attention",
    "block_attention_backward",
    "block_mask",
    "merge_blocks",
    "ring_attention",
]


# ----------------------------------------------------------------------------------------- pure math
def _grouped(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(B, H, S, D) -> (B, Hk, G, S, D) where G = H // Hk (query heads sharing one kv head)."""
    b, h, s, d = x.shape
    if h % num_kv_heads:
        raise ValueError(f"{h} query heads is not a multiple of {num_kv_heads} kv heads")
    return x.view(b, num_kv_heads, h // num_kv_heads, s, d)


def block_mask(q_segment_ids: torch.Tensor | None, k_segment_ids: torch.Tensor | None, q_len: int, k_len: int,
               diagonal: bool, device: torch.device | None = None) -> torch.Tensor | None:
    """Which (query, key) pairs of one block may attend. True = attend.

    Args:
        q_segment_ids: (B, Sq) int; -1 marks padding. ``None``: every token is in segment 0.
        k_segment_ids: (B, Sk) int, same convention.
        diagonal: the block sits on the causal diagonal (queries and keys share positions): lower
            triangle only. Off-diagonal earlier blocks are fully visible, later ones never computed.
    Returns:
        (B or 1, 1, Sq, Sk) bool, or ``None`` when nothing is masked.
    """
    mask = None
    if diagonal:
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()[None, None]
    if q_segment_ids is not None or k_segment_ids is not None:
        if q_segment_ids is None or k_segment_ids is None:
            raise ValueError("segment ids must be given for both queries and keys, or neither")
        same = (q_segment_ids[:, :, None] == k_segment_ids[:, None, :]) & (k_segment_ids[:, None, :] >= 0)
        same = same[:, None]
        mask = same if mask is None else mask & same
    return mask


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` on one K/V block, with its log-sum-exp.

    Args:
        q: (B, H, Sq, D); k, v: (B, Hk, Sk, D) with H % Hk == 0 (GQA without repeating K/V).
        mask: bool, broadcastable to (B, 1, Sq, Sk); True = attend.
    Returns:
        out (B, H, Sq, D) fp32 normalised within the block (zero for rows with no visible key) and
        lse (B, H, Sq) fp32, ``-inf`` for those rows.
    """
    b, h, sq, _ = q.shape
    qg = _grouped(q.float(), k.shape[1])
    scores = torch.einsum("bhgqd,bhkd->bhgqk", qg, k.float()) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse)[..., None])
    out = torch.einsum("bhgqk,bhkd->bhgqd", probs, v.float())
    return out.reshape(b, h, sq, v.shape[-1]), lse.reshape(b, h, sq)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """Replace -inf (rows that see no key) by 0 so exp(score - lse) stays 0 instead of NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def merge_blocks(out_a: torch.Tensor | None, lse_a: torch.Tensor | None, out_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two block results over disjoint key sets into the result over their union.

    ``lse = log(exp(lse_a) + exp(lse_b))``; ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``.
    Shapes: out (B, H, S, D), lse (B, H, S). ``out_a=None`` starts the accumulation.
    """
    if out_a is None or lse_a is None:
        return out_b, lse_b
    lse = torch.logaddexp(lse_a, lse_b)
    ref = _finite(lse)
    out = out_a * torch.exp(lse_a - ref)[..., None] + out_b * torch.exp(lse_b - ref)[..., None]
    return out, lse


def block_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                             delta: torch.Tensor, lse: torch.Tensor, scale: float,
                             mask: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the *full* attention output w.r.t. ``q`` and one K/V block.

    With P = exp(scale * q k^T - lse) (``lse`` of the full row, so P is the block's slice of the full
    softmax): dV = P^T dO, dS = P * (dO V^T - delta), dQ = scale * dS K, dK = scale * dS^T Q, where
    ``delta = rowsum(dO * O)`` over the full output O.

    Args:
        q, dout: (B, H, Sq, D); k, v: (B, Hk, Sk, D); delta, lse: (B, H, Sq).
    Returns:
        dq (B, H, Sq, D), dk and dv (B, Hk, Sk, D), fp32; dk/dv summed over the query heads of a group.
    """
    b, h, sq, d = q.shape
    hk = k.shape[1]
    qg, dog = _grouped(q.float(), hk), _grouped(dout.float(), hk)
    scores = torch.einsum("bhgqd,bhkd->bhgqk", qg, k.float()) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.exp(scores - _finite(lse).view(b, hk, h // hk, sq)[..., None])
    dv = torch.einsum("bhgqk,bhgqd->bhkd", probs, dog)
    dprobs = torch.einsum("bhgqd,bhkd->bhgqk", dog, v.float())
    dscores = probs * (dprobs - delta.view(b, hk, h // hk, sq)[..., None])
    dq = torch.einsum("bhgqk,bhkd->bhgqd", dscores, k.float()) * scale
    dk = torch.einsum("bhgqk,bhgqd->bhkd", dscores, qg) * scale
    return dq.reshape(b, h, sq, d), dk, dv


# ----------------------------------------------------------------------------------------- the ring
class _Ring:
    """Neighbour exchange on an sp group: send to rank+1, receive from rank-1 (group ranks)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError(f"global rank {dist.get_rank()} is not a member of the sp group it runs ring attention on")
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size) if group else (self.rank + 1) % self.size
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size) if group else (self.rank - 1) % self.size

    def start(self, tensors: list[torch.Tensor], tag: int) -> _Exchange:
        """Post the sends of ``tensors`` to the next rank and receives of same-shaped ones from the previous."""
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = []
        for i, (t, r) in enumerate(zip(sent, received, strict=True)):
            ops.append(dist.P2POp(dist.isend, t, self.next, self.group, tag + i))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group, tag + i))
        return _Exchange(dist.batch_isend_irecv(ops), sent, received)


class _Exchange:
    """Posted sends/receives; ``sent`` stays referenced until they complete."""

    def __init__(self, requests: list, sent: list[torch.Tensor], received: list[torch.Tensor]):
        self.requests, self.sent, self.received = requests, sent, received

    def wait(self) -> list[torch.Tensor]:
        for req in self.requests:
            req.wait()
        self.sent = []
        return self.received


_KV_TAG, _DKV_TAG = 100, 200


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, segment_ids, group, causal, scale):
        ring = _Ring(group)
        seq = q.shape[2]
        out = lse = None
        kv = torch.stack([k, v])
        seg = segment_ids
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            pending = None
            if step + 1 < ring.size:
                pending = ring.start([kv] if seg is None else [kv, seg], _KV_TAG)
            if not (causal and src > ring.rank):
                mask = block_mask(segment_ids, seg, seq, seq, diagonal=causal and src == ring.rank, device=q.device)
                block_out, block_lse = block_attention(q, kv[0], kv[1], scale, mask)
                out, lse = merge_blocks(out, lse, block_out, block_lse)
            if pending is not None:
                kv, *rest = pending.wait()
                seg = rest[0] if rest else None
        ctx.save_for_backward(q, k, v, out, lse, segment_ids)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, segment_ids = ctx.saved_tensors
        ring = _Ring(ctx.group)
        seq = q.shape[2]
        delta = (dout.float() * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        kv, seg = torch.stack([k, v]), segment_ids
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            pending = None
            if step + 1 < ring.size:
                pending = ring.start([kv] if seg is None else [kv, seg], _KV_TAG)
            if not (ctx.causal and src > ring.rank):
                mask = block_mask(segment_ids, seg, seq, seq, diagonal=ctx.causal and src == ring.rank,
                                  device=q.device)
                dq_b, dk_b, dv_b = block_attention_backward(q, kv[0], kv[1], dout, delta, lse, ctx.scale, mask)
                dq += dq_b
                dkv[0] += dk_b
                dkv[1] += dv_b
            if ring.size > 1:
                # The accumulator of block ``src`` moves on with it; after n hops it is home.
                (dkv,) = ring.start([dkv], _DKV_TAG).wait()
            if pending is not None:
                kv, *rest = pending.wait()
                seg = rest[0] if rest else None
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sp_group: dist.ProcessGroup | None,
                   causal: bool = True, softmax_scale: float | None = None,
                   segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Exact (causal) softmax attention of this rank's query chunk over the whole ring's keys.

    Args:
        q: (B, H, S, D) queries of this rank's contiguous sequence chunk (sp rank r: positions
            ``[r*S, (r+1)*S)``); k, v: (B, Hk, S, D), H % Hk == 0. Every rank of the group must call
            this with the same B, S and head counts.
        sp_group: the sequence-parallel group (``RoleGroups.sp_group``); ``None`` means the default
            group; a group of one rank is plain attention.
        segment_ids: (B, S) int of this chunk: tokens attend only keys of the same id; -1 = padding
            (attends nothing, is attended by nothing; its output row is 0). ``None``: one segment.
    Returns:
        (B, H, S, D) in ``q``'s dtype; differentiable w.r.t. q, k, v (gradients for K/V computed on
        other ranks are sent back to their owner during backward, so every rank must run backward).
    """
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"expected q (B,H,S,D) and k, v (B,Hk,S,D) of the same chunk; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if segment_ids is not None:
        segment_ids = segment_ids.to(device=q.device, dtype=torch.long).contiguous()
    return _RingAttention.apply(q, k, v, segment_ids, sp_group, causal, scale)
