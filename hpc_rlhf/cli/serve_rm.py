"""Serve a reward model over HTTP with OpenRLHF's ``/get_reward`` protocol.

    python -m hpc_rlhf.cli.serve_rm --reward_pretrain /ckpt/rm --port 5000 [--host 0.0.0.0]

Then point training at it: ``reward.remote_url=[http://<node>:5000/get_reward]`` (OpenRLHF's
``--remote_rm_url`` works the same). The default host is loopback; pass ``--host 0.0.0.0`` to serve other
nodes. ``GET /health`` answers once the model is loaded. SIGTERM / Ctrl-C: stop accepting, finish the
requests in flight (up to ``--graceful_timeout_s``), exit.
"""

from __future__ import annotations

import argparse
import logging
import sys


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
    p.add_argument("--graceful_timeout_s", type=float, default=30.0,
                   help="on shutdown, how long requests in flight may take to finish")
    p.add_argument("--log_level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvicorn

        from hpc_rlhf.serving.rm_server import RewardScorer, RewardServerError, create_app
    except ImportError as err:
        sys.exit(f"serve_rm needs fastapi and uvicorn ({err}); pip install fastapi uvicorn")

    try:
        scorer = RewardScorer(args.reward_pretrain, max_len=args.max_len, device=args.device,
                              normalize=args.normalize, batch_size=args.batch_size,
                              value_head_prefix=args.value_head_prefix, param_dtype=args.param_dtype)
    except (RewardServerError, ValueError, OSError) as err:
        sys.exit(f"serve_rm: {err}")
    app = create_app(scorer, max_wait_s=args.batch_wait_ms / 1000)
    try:
        # uvicorn installs SIGTERM/SIGINT handlers: graceful drain, then the lifespan stops the batcher.
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=args.graceful_timeout_s)
    except KeyboardInterrupt:  # uvicorn re-raises the captured SIGINT after its graceful shutdown
        sys.exit(130)


if __name__ == "__main__":
    main()
