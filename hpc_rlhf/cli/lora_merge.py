"""Merge a LoRA adapter into its base model and write a plain HF model folder.

    hpc-rlhf lora-merge --base /models/llama --adapter /runs/x/model/adapter --output /runs/x/merged

The adapter is a peft folder (``adapter_config.json`` + ``adapter_model.safetensors``), as written by
``save_hf`` of a LoRA run under ``<model>/adapter``. The output (safetensors, config, tokenizer) loads with
``AutoModelForCausalLM.from_pretrained`` (``AutoModelForSequenceClassification`` for a critic / reward-model
adapter). ``--base`` defaults to the adapter's ``base_model_name_or_path``.

A QLoRA adapter (``ds.lora.load_in_4bit``) was trained on the NF4-quantised base. Merged into the full-precision
base (the default, the usual practice) it gives a close but different model; ``--load_in_4bit`` merges it into
the dequantised 4-bit base instead, which reproduces the trained policy exactly (what the run's own
``<model>/`` export and its rollouts hold).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from hpc_rlhf.models.loading import load_causal_lm, load_value_model
from hpc_rlhf.models.lora import merged_named_tensors

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
    p.add_argument("--load_in_4bit", action="store_true",
                   help="QLoRA adapter: merge into the dequantised NF4 base it was trained on (needs bitsandbytes)")
    return p


def _adapter_config(adapter_dir: str) -> dict:
    path = os.path.join(adapter_dir, "adapter_config.json")
    if not os.path.isfile(path):
        raise SystemExit(f"lora-merge: no adapter_config.json in --adapter {adapter_dir}")
    with open(path) as f:
        return json.load(f)


def _save_tokenizer(candidates: list[str | None], output: str) -> None:
    for path in candidates:
        if path and os.path.isfile(os.path.join(path, "tokenizer_config.json")):
            AutoTokenizer.from_pretrained(path).save_pretrained(output)
            return
    log.warning("lora-merge: no tokenizer found in %s; the output has none", [c for c in candidates if c])


def _merge_into_dequantised_base(base: str, adapter: str, dtype, value_model: bool):
    """The plain model holding ``dequantise(NF4(W)) + scale * B @ A``: what the QLoRA run trained and served."""
    load = load_value_model if value_model else load_causal_lm
    trained = PeftModel.from_pretrained(load(base, dtype, load_in_4bit=True), adapter)
    model = load(base, dtype)
    model.load_state_dict(dict(merged_named_tensors(trained)), strict=True)
    return model


def merge(base: str | None, adapter: str, output: str, param_dtype: str = "fp32", tokenizer: str | None = None,
          load_in_4bit: bool = False) -> str:
    cfg = _adapter_config(adapter)
    base = base or cfg.get("base_model_name_or_path")
    if not base:
        raise SystemExit("lora-merge: --base is required (the adapter does not name its base model)")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[param_dtype]
    value_model = cfg.get("task_type") == "SEQ_CLS"
    if load_in_4bit:
        merged = _merge_into_dequantised_base(base, adapter, dtype, value_model)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=dtype) if value_model \
            else AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
        merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    os.makedirs(output, exist_ok=True)
    merged.save_pretrained(output, safe_serialization=True)
    _save_tokenizer([tokenizer, os.path.dirname(os.path.abspath(adapter)), base], output)
    return output


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = merge(args.base, args.adapter, args.output, args.param_dtype, args.tokenizer, args.load_in_4bit)
    print(f"merged model written to {out}")


if __name__ == "__main__":
    main()
