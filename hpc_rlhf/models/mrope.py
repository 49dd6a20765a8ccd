"""Qwen-VL's 3-D rotary positions (M-RoPE) of one sequence, as a pure function of its tokens and image grids.

Text tokens get the position ``p`` on all three axes (temporal, height, width), counting on from the previous
token. An image's ``t x h x w`` merged tokens (``h = H / merge``, ``w = W / merge``) get ``(p + t_i, p + h_i,
p + w_i)`` for their cell ``(t_i, h_i, w_i)``; the next text token then continues at ``p + max(h, w)`` (the
temporal extent of a still image is 1). This is what transformers' ``Qwen2_5_VLModel.get_rope_index`` and
``Qwen3VLModel.get_rope_index`` compute for image (not video) inputs; tests compare the two. Being pure, it runs
on the controller, which has no model, and on the rows of any layout.
"""

from __future__ import annotations

import torch


def mrope_positions(input_ids: torch.Tensor, image_grid_thw: torch.Tensor, image_token_id: int,
                    spatial_merge_size: int) -> torch.Tensor:
    """(T,) token ids of one sequence (no padding) and its images' (I, 3) patch grids -> (T, 3) long positions.

    Consecutive ``image_token_id`` runs are matched to the grids in order; a run must hold exactly
    ``t * h * w / merge**2`` tokens (runs of two adjacent images are split by their sizes).
    """
    ids = input_ids.tolist()
    out = torch.empty(len(ids), 3, dtype=torch.long)
    grids = image_grid_thw.tolist()
    image, pos, i = 0, 0, 0
    while i < len(ids):
        if ids[i] != image_token_id:
            out[i] = pos
            pos += 1
            i += 1
            continue
        if image >= len(grids):
            raise ValueError(f"image token at position {i} but only {len(grids)} image grid(s) were given")
        t, h, w = (int(grids[image][0]), int(grids[image][1]) // spatial_merge_size,
                   int(grids[image][2]) // spatial_merge_size)
        count = t * h * w
        if ids[i:i + count] != [image_token_id] * count:
            raise ValueError(f"image {image} (grid {grids[image]}) needs {count} image tokens from position {i}")
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        out[i:i + count] = torch.stack([tt, hh, ww], dim=-1).reshape(-1, 3) + pos
        pos += max(h, w)
        i += count
        image += 1
    if image != len(grids):
        raise ValueError(f"{len(grids)} image grids but the sequence holds tokens of {image} image(s)")
    return out


def padded_mrope_positions(sequences: torch.Tensor, attention_mask: torch.Tensor,
                           grids: list[torch.Tensor | None], image_token_id: int,
                           spatial_merge_size: int) -> torch.Tensor:
    """(B, T) rows (any padding, marked by ``attention_mask``) -> (B, T, 3) long M-RoPE positions of their real
    tokens (0 on padding). ``grids[b]``: row b's (I_b, 3) image grids, or None for a text-only row."""
    out = torch.zeros(*sequences.shape, 3, dtype=torch.long)
    empty = torch.zeros(0, 3, dtype=torch.long)
    for b in range(sequences.shape[0]):
        real = attention_mask[b].bool()
        row_grid = grids[b]
        grid = row_grid if row_grid is not None else empty
        out[b, real] = mrope_positions(sequences[b, real], grid, image_token_id, spatial_merge_size)
    return out
