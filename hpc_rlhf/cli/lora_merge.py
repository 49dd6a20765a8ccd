"""Merge a LoRA adapter into its base model and write a plain HF model folder.

    hpc-rlhf lora-merge --base /models/llama --adapter /runs/x/model/adapter --output /runs/x/merged

The adapter is a peft folder (``adapter_config.json`` + ``adapter_model.safetensors``), as written by
``save_hf`` of a LoRA run under ``<model>/adapter``. The output (safetensors, config, tokenizer) loads with
``AutoModelForCausalLM.from_pretrained`` (``AutoModelForSequenceClassification`` for a critic / reward-model
adapter). ``--base`` defaults to the adapter's ``base_model_name_or_path``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpc-rlhf lora-merge", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default=None, help="local HF folder of the base model (default: from the adapter)")
    p.add_argument("--adapter", required=True, help="peft adapter folder")
    p.add_argument("--output", required=True, help="where the merged HF model is written")
    p.add_argument("--param_dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="dtype of the merged weights (the merge itself runs in this dtype)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the adapter's parent, then --base)")
    return p


def _adapter_config(adapter_dir: str) -> dict:
    path = os.path.join(adapter_dir, "adapter_config.json")
    if not os.path.isfile(path):
        raise SystemExit(f"lora-merge: no adapter_config.json in --adapter {adapter_dir}")
    with open(path) as f:
        return json.load(f)


def _save_tokenizer(candidates: list[str | None], output: str) -> None:
    from transformers import AutoTokenizer

    for path in candidates:
        if path and os.path.isfile(os.path.join(path, "tokenizer_config.json")):
            AutoTokenizer.from_pretrained(path).save_pretrained(output)
            return
    log.warning("lora-merge: no tokenizer found in %s; the output has none", [c for c in candidates if c])


def merge(base: str | None, adapter: str, output: str, param_dtype: str = "fp32", tokenizer: str | None = None) -> str:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cfg = _adapter_config(adapter)
    base = base or cfg.get("base_model_name_or_path")
    if not base:
        raise SystemExit("lora-merge: --base is required (the adapter does not name its base model)")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[param_dtype]
    if cfg.get("task_type") == "SEQ_CLS":
        model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    os.makedirs(output, exist_ok=True)
    merged.save_pretrained(output, safe_serialization=True)
    _save_tokenizer([tokenizer, os.path.dirname(os.path.abspath(adapter)), base], output)
    return output


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = merge(args.base, args.adapter, args.output, args.param_dtype, args.tokenizer)
    print(f"merged model written to {out}")


if __name__ == "__main__":
    main()
