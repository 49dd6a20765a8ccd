"""GPU path of sequence parallelism: ring-flash-attn's Llama-3 varlen attention behind ``hpc_ring_flash``.

Needs CUDA, flash-attn and ring-flash-attn (docs/gpu.md, section Install): skipped when they are not
installed, failed when they are installed but do not import. One GPU: a ring of one rank (checks the packing,
cu_seqlens and the transformers wiring against SDPA). Two or more GPUs: a real ring over NCCL, logprobs and
summed parameter gradients against the unsplit model. On either, the attention output and its input gradients
against the exact reference ring (``hpc_rlhf.models.ring_attention``, the CPU backend) on the same shards.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flash-attn kernels)"),
]

# bf16 flash kernels vs. SDPA: logprobs agree to a few 1e-2, gradients to a few percent.
LP_TOL = {"rtol": 0.0, "atol": 5e-2}


def _needs_ring_flash_attn() -> None:
    """Skip when the packages are not installed; FAIL when they are but the import does not work (e.g. a
    transformers release that ring-flash-attn's adapter does not import under), so a broken GPU stack cannot
    pass as "skipped"."""
    import importlib.util

    from hpc_rlhf.models.ring_flash_import import ring_flash_attn_status

    for module, dist in (("flash_attn", "flash-attn"), ("ring_flash_attn", "ring-flash-attn")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{dist} is not installed (docs/gpu.md, section Install)")
    status = ring_flash_attn_status()
    if not status.usable:
        pytest.fail(status.reason)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _batch(device: torch.device, t: int):
    torch.manual_seed(1)
    ids = torch.randint(1, 64, (3, t), device=device)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, -2:] = 0
    return ids * mask, mask


def _tiny_llama(device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()


def _compare(rank: int, world_size: int, head_stride: int) -> None:
    import torch.distributed as dist

    from hpc_rlhf.models.forward import position_ids_from_mask
    from hpc_rlhf.models.logprobs import logprobs_from_logits
    from hpc_rlhf.models.sequence_parallel import (
        gather_from_sp,
        sequence_parallel_attention,
        shard_for_sp,
        sp_token_logprobs,
    )

    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.new_group(list(range(world_size)))
    model = _tiny_llama(device)
    ids, mask = _batch(device, 8 * world_size + 3)
    valid = (mask[:, :-1] * mask[:, 1:]).bool()
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    ref = logprobs_from_logits(logits[:, :-1], ids[:, 1:])
    (ref * valid).sum().backward()
    ref_grads = [p.grad.float().clone() for p in model.parameters()]
    model.zero_grad()

    shard = shard_for_sp(ids, mask, sp_rank=rank, sp_size=world_size, pack=True)
    with sequence_parallel_attention(model, group, shard, backend="auto", head_stride=head_stride) as backend:
        assert backend == "ring_flash"
        local = sp_token_logprobs(model, shard)
    full = gather_from_sp(local, shard, group)
    torch.testing.assert_close(full[:, :-1][valid], ref[valid].detach(), **LP_TOL)
    weights = torch.cat([valid.float(), torch.zeros(3, 1, device=device)], 1)
    (local * shard.local(weights)).sum().backward()
    for p, ref_grad in zip(model.parameters(), ref_grads, strict=True):
        grad = p.grad.float()
        dist.all_reduce(grad, group=group)
        rel = (grad - ref_grad).norm() / ref_grad.norm().clamp(min=1e-6)
        assert rel < 5e-2, f"relative gradient error {rel:.3g}"


def _compare_with_reference_ring(rank: int, world_size: int, head_stride: int) -> None:
    """ring-flash-attn's kernel vs. the exact reference ring on the same packed shard: outputs and q/k/v grads."""
    import torch.distributed as dist

    from hpc_rlhf.models.ring_attention import ring_attention
    from hpc_rlhf.models.ring_flash_import import load_ring_flash_attn
    from hpc_rlhf.models.sequence_parallel import shard_for_sp

    rfa = load_ring_flash_attn()
    device = torch.device("cuda", torch.cuda.current_device())
    group = dist.new_group(list(range(world_size)))
    ids, mask = _batch(device, 8 * world_size + 3)
    shard = shard_for_sp(ids, mask, sp_rank=rank, sp_size=world_size, pack=True)
    torch.manual_seed(10 + rank)  # each rank its own chunk of q, k, v
    heads, kv_heads, dim, local = 4, 2, 64, shard.local_len
    q = torch.randn(local, heads, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(local, kv_heads, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(local, kv_heads, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    cu_q, cu_k, max_q, max_k, k_slice = rfa.llama3_flash_attn_prepare_cu_seqlens(shard.cu_seqlens, True, rank,
                                                                                  world_size)
    fast = rfa.llama3_flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, heads_k_stride=head_stride,
                                             local_k_slice=k_slice, dropout_p=0.0, causal=True, group=group)
    # The reference works in fp32 on (B, H, S, D); the tail padding (segment -1) is left out of the comparison.
    ref_inputs = [x.detach().float().transpose(0, 1).unsqueeze(0).requires_grad_() for x in (q, k, v)]
    ref = ring_attention(*ref_inputs, group, causal=True, segment_ids=shard.segment_ids)[0].transpose(0, 1)
    real = (shard.segment_ids[0] >= 0)
    torch.testing.assert_close(fast.float()[real], ref[real], rtol=0.0, atol=2e-2)
    weights = torch.randn_like(ref) * real[:, None, None]
    (fast.float() * weights).sum().backward()
    (ref * weights).sum().backward()
    for name, x, x_ref in zip("qkv", (q, k, v), ref_inputs, strict=True):
        grad_ref = x_ref.grad[0].transpose(0, 1)
        rel = (x.grad.float() - grad_ref).norm() / grad_ref.norm().clamp(min=1e-6)
        assert rel < 5e-2, f"d{name}: relative error {rel:.3g} against the reference ring"


def _entry(rank: int, world_size: int, port: int, head_stride: int, check=_compare) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        check(rank, world_size, head_stride)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("head_stride", [1, 2])
def test_ring_flash_single_gpu_matches_sdpa(head_stride):
    _needs_ring_flash_attn()
    torch.multiprocessing.spawn(_entry, args=(1, _free_port(), head_stride), nprocs=1, join=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a ring over NCCL needs 2 GPUs")
def test_ring_flash_two_gpus_matches_unsplit():
    _needs_ring_flash_attn()
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    torch.multiprocessing.spawn(_entry, args=(2, _free_port(), 1), nprocs=2, join=True)


@pytest.mark.parametrize("world_size", [1, 2])
def test_ring_flash_kernel_matches_the_reference_ring(world_size):
    _needs_ring_flash_attn()
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    torch.multiprocessing.spawn(_entry, args=(world_size, _free_port(), 1, _compare_with_reference_ring),
                                nprocs=world_size, join=True)
