"""Serve a reward model over HTTP with OpenRLHF's ``/get_reward`` protocol.

    python -m hpc_rlhf.cli.serve_rm --reward_pretrain /ckpt/rm --port 5000 [--host 0.0.0.0]

Then point training at it: ``reward.remote_url=[http://<node>:5000/get_reward]`` (OpenRLHF's
``--remote_rm_url`` works the same). The default host is loopback; pass ``--host 0.0.0.0`` to serve other
nodes, and then require a key: ``HPC_RLHF_RM_API_KEY=<secret>`` in the server's and the trainer's environment
(every request, ``/health`` included, must then carry ``Authorization: Bearer <secret>``; the trainer sends it).
``GET /health`` answers once the model is loaded. SIGTERM / Ctrl-C: stop accepting, finish the
requests in flight (up to ``--graceful_timeout_s``), exit.

OpenRLHF's flag names work too (``--normalize_reward``, ``--bf16``, ``--flash_attn``,
``--attn_implementation``, ``--max_len``, ``--batch_size``, and the dotted ``--reward.model_name_or_path``,
``--data.max_len``, ``--ds.*`` forms); a flag with no counterpart here fails naming what to use instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

# guards and connection_limits import no fastapi / uvicorn, so --help works without the serve extra.
from hpc_rlhf.serving.connection_limits import DEFAULT_FIRST_REQUEST_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS
from hpc_rlhf.serving.guards import API_KEY_ENV, DEFAULT_MAX_PENDING, DEFAULT_REQUEST_TIMEOUT_S

log = logging.getLogger(__name__)

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}

# OpenRLHF's serve_rm flag -> ours (with the value, for switches that pick a value).
_RENAMED = {
    "--normalize_reward": ["--normalize"],
    "--reward.normalize_enable": ["--normalize"],
    "--bf16": ["--param_dtype", "bf16"],
    "--flash_attn": ["--attn_implementation", "flash_attention_2"],
    "--reward.model_name_or_path": ["--reward_pretrain"],
    "--ds.value_head_prefix": ["--value_head_prefix"],
    "--data.max_len": ["--max_len"],
    "--ds.param_dtype": ["--param_dtype"],
    "--ds.attn_implementation": ["--attn_implementation"],
}
# Switches that change nothing here: the server always pads and merges concurrent requests itself.
_IGNORED = {"--packing_samples", "--ds.packing_samples"}
_UNSUPPORTED = {
    "--load_in_4bit": "4-bit serving is not supported; serve with --param_dtype bf16",
    "--ds.load_in_4bit": "4-bit serving is not supported; serve with --param_dtype bf16",
    "--use_ms": "ModelScope downloads are not supported; download the model and pass its folder as --reward_pretrain",
    "--disable_fast_tokenizer": "the tokenizer is loaded from --reward_pretrain as saved; drop the flag",
    "--data.disable_fast_tokenizer": "the tokenizer is loaded from --reward_pretrain as saved; drop the flag",
    "--ds.experts_implementation": "not configurable here; drop the flag (transformers picks the MoE kernel)",
}


def translate_openrlhf_flags(argv: list[str]) -> list[str]:
    """OpenRLHF's ``serve_rm`` flags -> this server's; exits naming our equivalent for unsupported ones."""
    out: list[str] = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        if flag in _UNSUPPORTED:
            sys.exit(f"serve_rm: {flag} (OpenRLHF) is not supported: {_UNSUPPORTED[flag]}")
        if flag in _IGNORED:
            log.warning("serve_rm: %s has no effect here (concurrent requests are always merged into padded "
                        "batches; see --batch_size and --batch_wait_ms)", flag)
            continue
        if flag in _RENAMED:
            new = list(_RENAMED[flag])
            if eq and len(new) > 1:
                sys.exit(f"serve_rm: {flag} is a switch and takes no value; it means {' '.join(new)}")
            out += [f"{new[0]}={value}"] if eq else new
            continue
        out.append(arg)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpc_rlhf.cli.serve_rm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reward_pretrain", required=True, help="local HF folder of the reward model")
    p.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0: all interfaces)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--max_len", type=int, default=2048, help="tokens kept per query (left truncation)")
    p.add_argument("--batch_size", type=int, default=16, help="texts per forward; concurrent requests merge")
    p.add_argument("--batch_wait_ms", type=float, default=5.0,
                   help="how long a batch waits for more concurrent requests")
    p.add_argument("--normalize", action="store_true",
                   help="(score - reward_mean) / reward_std with both from the model's config.json")
    p.add_argument("--value_head_prefix", default="score", help="name of the value head in the checkpoint")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--param_dtype", default="auto", choices=["auto", "bf16", "fp32"],
                   help="auto: bf16 on GPU, fp32 on CPU")
    p.add_argument("--attn_implementation", default="auto",
                   choices=["auto", "eager", "sdpa", "flash_attention_2", "flash_attention_3"],
                   help="auto: flash attention on GPU when installed, else sdpa")
    p.add_argument("--api_key", "--api-key", default=None,
                   help=f"require 'Authorization: Bearer <key>' on every request (default: ${API_KEY_ENV} if set). "
                        f"A key given here is visible to other users of the node in ps; prefer ${API_KEY_ENV}")
    p.add_argument("--max_pending", type=int, default=DEFAULT_MAX_PENDING,
                   help="requests admitted at once (reading, queued, scoring); more get 503 with Retry-After")
    p.add_argument("--request_timeout_s", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                   help="one request, admission to answer: 408 while the body arrives, 504 once queued or scoring")
    p.add_argument("--max_connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="connections held at once; a new one past it is closed at once (idle ones count too)")
    p.add_argument("--first_request_timeout_s", type=float, default=DEFAULT_FIRST_REQUEST_TIMEOUT_S,
                   help="a connection that has not sent a request's headers within this time is closed")
    p.add_argument("--graceful_timeout_s", type=float, default=30.0,
                   help="on shutdown, how long requests in flight may take to finish")
    p.add_argument("--log_level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(translate_openrlhf_flags(sys.argv[1:] if argv is None else list(argv)))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # the serve extra (fastapi, uvicorn) is optional: --help and the flag checks work without it
        import uvicorn

        from hpc_rlhf.serving.connection_limits import limited_http_protocol
        from hpc_rlhf.serving.rm_server import RewardScorer, RewardServerError, create_app
    except ImportError as err:
        sys.exit(f"serve_rm needs fastapi and uvicorn ({err}); pip install fastapi uvicorn")

    try:
        scorer = RewardScorer(args.reward_pretrain, max_len=args.max_len, device=args.device,
                              normalize=args.normalize, batch_size=args.batch_size,
                              value_head_prefix=args.value_head_prefix, param_dtype=args.param_dtype,
                              attn_implementation=args.attn_implementation)
    except (RewardServerError, ValueError, OSError) as err:
        sys.exit(f"serve_rm: {err}")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.api_key:
        log.warning("serve_rm: --api_key is visible to every user of this node (ps); prefer $%s", API_KEY_ENV)
    if api_key is None and args.host not in _LOOPBACK:
        log.warning("serve_rm: serving on %s without an API key: anyone who can reach this node can query the "
                    "model; set $%s", args.host, API_KEY_ENV)
    try:
        app = create_app(scorer, max_wait_s=args.batch_wait_ms / 1000, api_key=api_key, max_pending=args.max_pending,
                         request_timeout_s=args.request_timeout_s)
    except ValueError as err:
        sys.exit(f"serve_rm: {err}")
    try:
        # uvicorn installs SIGTERM/SIGINT handlers: graceful drain, then the lifespan stops the batcher.
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=args.graceful_timeout_s,
                    http=limited_http_protocol(args.max_connections, args.first_request_timeout_s))
    except KeyboardInterrupt:  # uvicorn re-raises the captured SIGINT after its graceful shutdown
        sys.exit(130)


if __name__ == "__main__":
    main()
