"""Peak memory of one policy forward + backward vs response length: chunked vs full-logits log-probs.

    python benchmarks/logprob_memory.py                       # lengths 128 512 2048, both paths
    python benchmarks/logprob_memory.py --lengths 512 --path chunked

SmolLM2-135M shape (``benchmarks/smollm2_shape.py``, random init, fp32, CPU), 1 sample: a 32-token prompt
and a response of L tokens, ``hpc_rlhf.models.forward.policy_logprobs`` with ``chunked=True`` (LM head on
response tokens in vocabulary chunks) or ``chunked=False`` (``(1, L, 49152)`` logits, ``log_softmax``,
their gradient), then ``backward`` of the summed log-probs. Each measurement runs in a fresh process;
reported: the growth of the peak RSS over the RSS after the model was built (the weights and the
gradient buffers of the first backward are in both; the difference between the two paths is the
logits and their softmax/gradient copies).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPT_TOKENS = 32


def measure(length: int, path: str) -> dict:
    """In this process: build the model, run one forward + backward, return peak-RSS growth in MiB."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.smollm2_shape import SMOLLM2_135M
    from hpc_rlhf.models.forward import policy_logprobs

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).float()
    for p in model.parameters():  # allocate gradient buffers up front: both paths need them
        p.grad = torch.zeros_like(p)
    sequences = torch.randint(3, SMOLLM2_135M["vocab_size"], (1, PROMPT_TOKENS + length))
    mask = torch.ones_like(sequences)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.process_time()
    logprobs, _ = policy_logprobs(model, sequences, mask, length, chunked=path == "chunked")
    logprobs.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"length": length, "path": path, "peak_growth_mib": (peak - base) / 1024,
            "cpu_s": time.process_time() - started}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="*", default=[128, 512, 2048])
    p.add_argument("--path", nargs="*", choices=["chunked", "full"], default=["chunked", "full"])
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # child process: length path
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(int(args.one[0]), args.one[1])))
        return
    print("| response tokens | log-prob path | peak RSS growth MiB (forward + backward) | CPU s |")
    print("|---|---|---|---|")
    for length in args.lengths:
        for path in args.path:
            out = subprocess.run([sys.executable, __file__, "--one", str(length), path], capture_output=True,
                                 text=True, check=True).stdout.strip().splitlines()[-1]
            r = json.loads(out)
            print(f"| {length} | {path} | {r['peak_growth_mib']:.0f} | {r['cpu_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
