"""The visual part of one prompt, as the rollout engines and the step batch carry it.

Built once per prompt by the vision processor (``hpc_rlhf.data.vision_prompts``) and shared, by reference, by the
``n`` samples of that prompt: the request, each trajectory and the rows of the step batch point at the same
tensors, so an image is encoded once however many samples answer it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PromptVisual:
    """The images of one prompt after the model's image processor.

    The prompt's token ids hold ``image_grid_thw[i].prod() // spatial_merge_size**2`` consecutive
    ``image_token_id`` tokens for image ``i``, in image order; the vision tower turns ``pixel_values`` into one
    embedding per such token.
    """

    pixel_values: torch.Tensor
    """(N_patches, D) fp32: every image's flattened patches (D = channels x temporal patch x patch x patch)."""
    image_grid_thw: torch.Tensor
    """(I, 3) long: each image's patch grid (temporal, height, width), before the spatial merge."""
    image_token_id: int
    spatial_merge_size: int
    refs: tuple[str, ...] = ()
    """Each image's path or content hash (``ImageRef.describe``): what a rollout dump records, never the pixels."""
    images: tuple[Any, ...] = ()
    """The decoded RGB ``PIL.Image`` of each image, for engines that run the processor themselves (vLLM); empty
    when only the processed tensors travel."""
    pixel_bounds: tuple[int, int] | None = None
    """(min_pixels, max_pixels) the image processor resized to (vLLM's processor must use the same)."""

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    def num_image_tokens(self) -> int:
        """Image placeholder tokens this prompt's ids must hold."""
        return int(self.image_grid_thw.prod(dim=-1).sum()) // self.spatial_merge_size ** 2
