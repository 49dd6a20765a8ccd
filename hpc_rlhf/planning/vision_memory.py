"""The vision tower of a vision-language model (Qwen2.5-VL, Qwen3-VL) in ``plan``: its weights and the memory of
one image at ``data.max_pixels``. Imports no torch: sizes come from ``config.json``'s ``vision_config``.

Parameter counts follow transformers' modules exactly (checked against the tiny models by a unit test):

* Qwen2.5-VL: a bias-free Conv3d patch embedding ``C * T_p * p^2 -> h``; per block two RMSNorms, ``qkv``
  (``h -> 3h``) and ``proj`` with biases, a gated MLP (gate, up ``h -> i``, down ``i -> h``, biases); the merger
  (RMSNorm over ``h``, then ``h m^2 -> h m^2 -> out`` with biases).
* Qwen3-VL: the patch embedding has a bias, a learned position embedding (``num_position_embeddings x h``); per
  block two LayerNorms (weight and bias), ``qkv`` / ``proj`` with biases, a plain MLP (``h -> i -> h``, biases);
  the merger (LayerNorm over ``h``) and one "deepstack" merger per ``deepstack_visual_indexes`` entry (LayerNorm
  over ``h m^2``).

Per image at ``max_pixels`` the tower runs on at most ``N = max_pixels / p^2`` patches (the processor rounds each
side to whole merged patches within the budget) and hands ``N / m^2`` tokens to the language model; those tokens are
part of ``data.prompt_max_len`` and so already in the language model's activation estimate.

Activations (training, no activation checkpointing) are an estimate: per block and patch the backward keeps about
``12h + 4i`` values with a gated MLP (``12h + 3i`` plain: norms' inputs, q/k/v before and after the rotary
embedding, attention output, projection, MLP input and intermediates), attention is assumed memory-efficient (flash /
SDPA: no ``N^2`` scores kept), plus the patch embedding's input and each merger's ``h m^2``-wide input and hidden
layer per merged token. The constants were fitted to the tensors autograd saves for the tiny models at 1024 patches
(a unit test keeps them within 15%); that they hold at real widths (h = 1280, i = 3420) is a hypothesis.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class VisionShape:
    """The vision tower's sizes (``config.json``'s ``vision_config``)."""

    family: str
    """``qwen2_5_vl`` (RMSNorm, gated MLP) or ``qwen3_vl`` (LayerNorm, plain MLP, position and deepstack)."""
    depth: int
    hidden_size: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    num_position_embeddings: int = 0
    num_deepstack_mergers: int = 0

    @classmethod
    def from_hf_config(cls, cfg: dict) -> VisionShape | None:
        """The tower of a vision-language ``config.json`` (None for a text-only model)."""
        vision = cfg.get("vision_config")
        if not isinstance(vision, dict) or cfg.get("image_token_id") is None:
            return None
        family = "qwen3_vl" if str(cfg.get("model_type", "")).startswith("qwen3") else "qwen2_5_vl"
        return cls(family=family, depth=int(vision["depth"]), hidden_size=int(vision["hidden_size"]),
                   intermediate_size=int(vision["intermediate_size"]),
                   out_hidden_size=int(vision.get("out_hidden_size") or vision["hidden_size"]),
                   patch_size=int(vision.get("patch_size", 14)),
                   temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
                   spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
                   in_channels=int(vision.get("in_channels", 3)),
                   num_position_embeddings=int(vision.get("num_position_embeddings") or 0),
                   num_deepstack_mergers=len(vision.get("deepstack_visual_indexes") or ()))

    @property
    def gated(self) -> bool:
        return self.family == "qwen2_5_vl"

    @property
    def patch_values(self) -> int:
        """Values of one flattened patch (a row of ``pixel_values``): ``C * T_p * p^2``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def _merger_params(self, norm_width: int) -> int:
        wide, out = self.hidden_size * self.spatial_merge_size ** 2, self.out_hidden_size
        norm = norm_width if self.gated else 2 * norm_width  # RMSNorm: weight; LayerNorm: weight + bias
        return norm + wide * wide + wide + wide * out + out

    @property
    def num_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        patch = self.patch_values * h + (0 if self.gated else h)
        attention = 3 * h * h + 3 * h + h * h + h
        mlp = 2 * (h * i + i) + i * h + h if self.gated else h * i + i + i * h + h
        norms = 2 * h if self.gated else 4 * h
        wide = h * self.spatial_merge_size ** 2
        return (patch + self.num_position_embeddings * h + self.depth * (attention + mlp + norms)
                + self._merger_params(h) + self.num_deepstack_mergers * self._merger_params(wide))

    @property
    def merger_params(self) -> int:
        """The projector into the language model's width (trainable under ``freeze_vision_tower``)."""
        wide = self.hidden_size * self.spatial_merge_size ** 2
        return self._merger_params(self.hidden_size) + self.num_deepstack_mergers * self._merger_params(wide)

    def patches_per_image(self, max_pixels: int) -> int:
        """Upper bound of one image's patches at ``max_pixels`` (the processor keeps the area within it)."""
        return max_pixels // self.patch_size ** 2

    def tokens_per_image(self, max_pixels: int) -> int:
        """Language-model tokens of one image at ``max_pixels``: its patches merged ``m x m``."""
        return self.patches_per_image(max_pixels) // self.spatial_merge_size ** 2

    def activation_bytes_per_image(self, max_pixels: int, bytes_per_value: int) -> int:
        """Estimated activations one image keeps for the backward (see the module docstring)."""
        n = self.patches_per_image(max_pixels)
        h, i = self.hidden_size, self.intermediate_size
        per_block = 12 * h + (4 if self.gated else 3) * i
        merged = n // self.spatial_merge_size ** 2
        wide = h * self.spatial_merge_size ** 2
        mergers = (1 + self.num_deepstack_mergers) * merged * 2 * wide
        return bytes_per_value * (n * self.patch_values + self.depth * n * per_block + mergers)

    def pixel_bytes_per_image(self, max_pixels: int) -> int:
        """The fp32 ``pixel_values`` of one image at ``max_pixels`` (what the step batch carries)."""
        return 4 * self.patches_per_image(max_pixels) * self.patch_values


def vision_params(cfg: dict) -> int:
    """Vision-tower parameters of a ``config.json`` (0 for a text-only model)."""
    shape = VisionShape.from_hf_config(cfg)
    return shape.num_params if shape is not None else 0


def _size(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB // 10 else f"{num_bytes / MIB:.2f} MiB"


def vision_lines(cfg: dict, max_pixels: int | None, micro_batch: int, bytes_per_value: int, frozen: bool,
                 role: str) -> list[str]:
    """``plan``'s lines about a vision-language model's tower (none for a text-only model).

    ``max_pixels``: ``data.max_pixels`` (None: the processor's own, unknown to plan: the per-image line then says
    so); ``micro_batch``: samples per training micro-batch (one image each assumed); ``bytes_per_value``: 2 for
    bf16, 4 for fp32.
    """
    shape = VisionShape.from_hf_config(cfg)
    if shape is None:
        return []
    weights = shape.num_params * bytes_per_value
    trained = (f"frozen except the projector ({shape.merger_params / 1e6:.2f}M params)" if frozen
               else "trained with the language model")
    lines = [f"  {role} vision tower ({shape.family}): {shape.num_params / 1e6:.2f}M params, {_size(weights)} of "
             f"weights, {trained}; counted in the role's params above"]
    if max_pixels is None:
        lines.append("  per image: set data.max_pixels to size it (the processor's own bound applies)")
        return lines
    act = shape.activation_bytes_per_image(max_pixels, bytes_per_value)
    pixels = _size(shape.pixel_bytes_per_image(max_pixels))
    lines.append(f"  per image at data.max_pixels={max_pixels}: <= {shape.patches_per_image(max_pixels)} patches -> "
                 f"{shape.tokens_per_image(max_pixels)} tokens (in data.prompt_max_len); vision activations "
                 f"~{_size(act)} (estimate, no checkpointing); pixel_values {pixels} fp32; one image per sample x "
                 f"{micro_batch} per micro-batch: ~{_size(act * micro_batch)} (not in the working set above)")
    return lines


VLLM_MULTIMODAL_LINE = ("  vLLM with images: GPU only (vLLM's CPU build cannot load Qwen-VL without torchvision, "
                        "docs/vlm.md); that its GPU path computes the trainer's image tokens and log-probs is a "
                        "hypothesis: nothing has run it")

# vLLM 0.32's default ``max_num_batched_tokens`` for its ``LLM`` class (the rollout engines build one and set none):
# 16384 on GPUs of >= 70 GiB other than the A100 (H100, H200), 8192 below (A100 included); ``EngineArgs``'s defaults.
VLLM_BATCHED_TOKENS_LARGE_GPU = 16384
VLLM_BATCHED_TOKENS_OTHER_GPU = 8192
# ``mm_processor_cache_gb``'s default: host memory per engine process for processed images (vLLM 0.32).
VLLM_PROCESSOR_CACHE_GIB = 4


def vllm_encoder_cache_tokens(shape: VisionShape, max_pixels: int, max_num_batched_tokens: int) -> int:
    """Tokens vLLM's multimodal encoder cache holds: ``max(max_num_batched_tokens, one image's tokens)``
    (``vllm.v1.core.encoder_cache_manager.compute_mm_encoder_budget``, vLLM 0.32)."""
    return max(max_num_batched_tokens, shape.tokens_per_image(max_pixels))


def vllm_encoder_cache_bytes(shape: VisionShape, max_pixels: int, max_num_batched_tokens: int,
                             bytes_per_value: int) -> int:
    """GPU bytes of vLLM's encoder cache when full: each cached image token is the vision output handed to the
    language model, ``out_hidden_size`` wide, times ``1 + deepstack`` levels for Qwen3-VL (vLLM concatenates the
    deepstack features to it), in the model dtype. vLLM fills it with dummy images during its memory profiling, so
    it comes out of ``vllm.gpu_memory_utilization`` (less KV cache), not on top."""
    width = shape.out_hidden_size * (1 + shape.num_deepstack_mergers)
    return vllm_encoder_cache_tokens(shape, max_pixels, max_num_batched_tokens) * width * bytes_per_value


def vllm_multimodal_lines(cfg: dict, max_pixels: int | None, bytes_per_value: int) -> list[str]:
    """``plan``'s lines about vLLM with a vision-language actor (none for a text model): the GPU-only caveat and an
    estimate of vLLM's multimodal caches at its default ``max_num_batched_tokens`` (read from vLLM 0.32's code; no
    GPU run has measured them)."""
    shape = VisionShape.from_hf_config(cfg)
    if shape is None:
        return []
    lines = [VLLM_MULTIMODAL_LINE]
    processor = (f"; its processor cache: up to {VLLM_PROCESSOR_CACHE_GIB} GiB of host memory per engine process "
                 "(mm_processor_cache_gb)")
    if max_pixels is None:
        lines.append("  vLLM multimodal encoder cache: set data.max_pixels to size it" + processor)
        return lines
    large, other = (_size(vllm_encoder_cache_bytes(shape, max_pixels, tokens, bytes_per_value))
                    for tokens in (VLLM_BATCHED_TOKENS_LARGE_GPU, VLLM_BATCHED_TOKENS_OTHER_GPU))
    lines.append(f"  vLLM multimodal encoder cache (estimate, GPU only, unmeasured): "
                 f"{vllm_encoder_cache_tokens(shape, max_pixels, VLLM_BATCHED_TOKENS_LARGE_GPU)} image tokens, "
                 f"~{large} on H100 / H200 (vLLM's default max_num_batched_tokens {VLLM_BATCHED_TOKENS_LARGE_GPU}; "
                 f"~{other} at {VLLM_BATCHED_TOKENS_OTHER_GPU} on A100 and smaller GPUs), within "
                 f"vllm.gpu_memory_utilization (less KV cache){processor}")
    return lines
