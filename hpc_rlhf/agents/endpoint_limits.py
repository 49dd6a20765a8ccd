"""The agents' endpoint's limits in one place: images per request, pixels per image, per request and per episode
(``openai_images``), and its server's connection bounds (``hpc_rlhf.serving.connection_limits``).

The defaults are the module constants; the config's ``rollout.agent_*`` keys default to them (``config.rollout``
imports them from here, so this module imports no torch, PIL or uvicorn, and nothing of the config), and
``RolloutConfig.endpoint_limits`` turns a ``rollout`` section into the :class:`EndpointLimits` the executor builds its
endpoint with.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc_rlhf.serving.connection_limits import DEFAULT_FIRST_REQUEST_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS

DEFAULT_MAX_IMAGES = 32  # image content parts of one request
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096  # width x height of one image, read from its header before decoding
DEFAULT_MAX_REQUEST_PIXELS = 64 * 1024 * 1024  # new images of one request (4 images of 4096x4096)
DEFAULT_MAX_EPISODE_PIXELS = 128 * 1024 * 1024  # distinct images of one episode (~380 MiB decoded RGB)


@dataclass(frozen=True)
class EndpointLimits:
    """Keyword arguments of ``OpenAIEndpoint`` (same names); each field's config key is in
    ``RolloutConfig.endpoint_limits``."""

    max_images: int = DEFAULT_MAX_IMAGES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS
    max_episode_pixels: int = DEFAULT_MAX_EPISODE_PIXELS
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    first_request_timeout_s: float = DEFAULT_FIRST_REQUEST_TIMEOUT_S


__all__ = ["DEFAULT_MAX_EPISODE_PIXELS", "DEFAULT_MAX_IMAGES", "DEFAULT_MAX_IMAGE_PIXELS", "DEFAULT_MAX_REQUEST_PIXELS",
           "EndpointLimits"]
