"""GPU path of sequence parallelism: ring-flash-attn's Llama-3 varlen attention behind ``hpc_ring_flash``.

Needs CUDA, flash-attn and ring-flash-attn (the ``gpu`` extra). One GPU: a ring of one rank (checks the
packing, cu_seqlens and the transformers wiring against SDPA). Two or more GPUs: a real ring over NCCL,
logprobs and summed parameter gradients against the unsplit model.
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
    pytest.importorskip("flash_attn", reason="flash-attn is not installed (pip install 'hpc-rlhf[gpu]')")
    pytest.importorskip("ring_flash_attn", reason="ring-flash-attn is not installed (pip install 'hpc-rlhf[gpu]')")


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


def _entry(rank: int, world_size: int, port: int, head_stride: int) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        _compare(rank, world_size, head_stride)
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
