"""GRPO, same workload, hpc_rlhf vs TRL's ``GRPOTrainer``: time per step, throughput, memory, reward.

    python benchmarks/grpo_vs_trl.py                 # everything: prepare, TRL, hpc_rlhf 1 and 2 ranks, table
    python benchmarks/grpo_vs_trl.py --only hpc1     # one row (trl | hpc1 | hpc2), reusing the prepared model
    python benchmarks/grpo_vs_trl.py --profile       # + cProfile of hpc_rlhf on 1 rank (top functions)
    python benchmarks/grpo_vs_trl.py --shape smollm2-135m --only trl hpc1   # the real-shape workload below

What is compared (one invocation, nothing downloaded):

* model: a char-level Llama built by ``hpc_rlhf.models.tiny.build_tiny_model`` (hidden 256, 4 layers,
  ~3.2M parameters), warm-started by a short supervised run on ``a+b=`` -> `` so a+b=c.`` so that
  rewards start near 0.25 and both learners have something to improve (both read the same folder);
* prompts: ``a+b=`` with operands 0..19 (``steps x prompts`` rows, labels ``a+b``). TRL gets them in the
  exact order hpc_rlhf's ``PromptStream`` visits them (``shuffle_dataset=False``), so step k of both sees
  the same 16 prompts;
* reward: ``examples/reward_funcs/arithmetic.py`` (exact match of the last integer), adapted to TRL's
  ``(prompts, completions, **kwargs)`` signature with the ``label`` column passed through;
* GRPO: 16 prompts x 8 samples, 16 new tokens max, temperature 1, lr 1e-4 constant, AdamW (0.9, 0.999),
  no weight decay, grad clip 1.0, beta = 0 (no reference model), eps clip 0.2, group std normalisation,
  one optimizer step per rollout batch (TRL: num_iterations=1, per_device_train_batch_size=32,
  gradient_accumulation_steps=steps_per_generation=4 -> generation batch 128 = one optimizer step, so TRL
  also skips the old-logprob forward), loss = token mean over the whole 128-sample batch (TRL
  ``loss_type="dapo"``, its default; hpc_rlhf ``algo.loss_agg_mode=token_mean``, its default).

Metrics per run: median wall seconds per step over steps 2..N (and the best one: on a shared machine the
least disturbed step), rollout tokens/s (generated tokens /
generation seconds), training tokens/s (non-pad prompt+response tokens of the step's batch / seconds of
the training forward+backward+optimizer phase), peak RSS summed over the process tree (polled every
0.1 s), mean reward over the last 5 steps, total CPU seconds of the run (all processes), and the 1-minute
load average during the run (the machine may be shared: a load above the core count inflates wall
times).

``--shape smollm2-135m``: a SmolLM2-135M-shaped Llama (30 layers, hidden 576, 9 / 3 heads, intermediate
1536, vocabulary 49152, tied embeddings; random init) with a byte-level BPE tokenizer trained locally
(``benchmarks/smollm2_shape.py``), prompts wrapped by its ChatML template on both sides (hpc_rlhf
``data.apply_chat_template=true``, TRL conversational prompts), 4 prompts x 4 samples, 32 new tokens max,
a frozen reference model with the k3 KL loss, beta 0.04 (TRL ``beta=0.04``; hpc_rlhf ``algo.kl.use_loss``,
``estimator=k3``), the shaped arithmetic reward (``arithmetic_shaped.py``: a random model still earns its
digit-fraction term), one micro-batch of 16 rows per forward on both sides. No warm-up SFT.

GPU section (``--gpu`` forces it, default: when CUDA is present): a Qwen2-0.5B-like ``LlamaConfig``
model built in memory; rollout tokens/s of hpc_rlhf's transformers engine, weight-sync seconds per GB
(actor state dict -> rollout engine, the colocated path) and one GRPO-like step time. Skipped, saying
why, without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REWARD_DIR = ROOT / "examples/reward_funcs"
MODEL_SIZES = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
               "num_key_value_heads": 4}
MAX_OPERAND = 19
# Per-shape workload defaults; a flag given on the command line wins.
SHAPES = {
    "tiny": {"prompts": 16, "samples": 8, "max_new_tokens": 16, "micro": 32, "steps": 20, "beta": 0.0,
             "chat": False, "reward": "arithmetic.py", "trl_grad_ckpt": True},
    "smollm2-135m": {"prompts": 4, "samples": 4, "max_new_tokens": 32, "micro": 16, "steps": 8, "beta": 0.04,
                     "chat": True, "reward": "arithmetic_shaped.py", "trl_grad_ckpt": False},
}


def response_text(a: int, b: int) -> str:
    return f" so {a}+{b}={a + b}."


# ------------------------------------------------------------------------------------------ prepare
def prepare(args) -> dict:
    """Build + warm-start the model (cached), write the prompt file and TRL's ordered copy of it."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpc_rlhf.models.tiny import build_tiny_model

    work = Path(args.work_dir)
    model_dir = work / "model_sft"
    if args.shape == "smollm2-135m":
        from benchmarks.smollm2_shape import build_smollm2_135m

        model_dir = build_smollm2_135m(work / "model_smollm2_135m", seed=args.seed)
    elif not (model_dir / "config.json").is_file():
        init = build_tiny_model(work / "model_init", seed=args.seed, **MODEL_SIZES)
        tok = AutoTokenizer.from_pretrained(init)
        model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
        torch.manual_seed(args.seed)
        rng = random.Random(args.seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        started = time.time()
        for step in range(args.sft_steps):
            ids, plens = [], []
            for _ in range(64):
                a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
                p = tok(f"{a}+{b}=")["input_ids"]
                ids.append(p + tok(response_text(a, b))["input_ids"] + [tok.eos_token_id])
                plens.append(len(p))
            width = max(map(len, ids))
            x = torch.full((64, width), tok.pad_token_id)
            labels = torch.full((64, width), -100)
            mask = torch.zeros(64, width, dtype=torch.long)
            for i, (s, pl) in enumerate(zip(ids, plens)):
                x[i, : len(s)] = torch.tensor(s)
                mask[i, : len(s)] = 1
                labels[i, pl : len(s)] = torch.tensor(s[pl:])
            loss = model(input_ids=x, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step % 50 == 0:
                print(f"[prepare] warm-start step {step} loss {loss.item():.3f} ({time.time() - started:.0f}s)",
                      flush=True)
        tmp = work / "model_sft.tmp"
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(model_dir)
    # prompts: exactly steps x prompts rows -> one episode; hpc_rlhf's visiting order for TRL
    n = args.steps * args.prompts
    rng = random.Random(args.seed + 1)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
        rows.append({"input": f"What is {a}+{b}?" if args.chat else f"{a}+{b}=", "label": str(a + b)})
    prompts = work / f"prompts_{n}.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    order = np.random.default_rng([args.seed, 0]).permutation(n).tolist()  # PromptStream._episode_order(0)
    ordered = work / f"prompts_{n}_hpc_order.jsonl"
    ordered.write_text("".join(json.dumps(rows[i]) + "\n" for i in order))
    return {"model": str(model_dir), "prompts": str(prompts), "prompts_ordered": str(ordered)}


# ------------------------------------------------------------------------------------------ process monitor
class TreeMonitor:
    """Peak of the summed RSS of a process and all its descendants; mean 1-min load average."""

    def __init__(self, pid: int, period: float = 0.1, progress: Path | None = None):
        import psutil

        self.root = psutil.Process(pid)
        self.period = period
        self.peak = 0
        # CPU seconds (user+sys, whole tree) each time ``progress`` gains a line (= a step ended)
        self.progress, self.lines, self.cpu_marks = progress, 0, []
        self.loads: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import psutil

        tick = 0
        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
                total, cpu = 0, 0.0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                        t = p.cpu_times()
                        cpu += t.user + t.system
                    except psutil.Error:
                        pass
                self.peak = max(self.peak, total)
                if self.progress is not None and self.progress.exists():
                    lines = self.progress.read_text().count("\n")
                    if lines > self.lines:
                        self.lines = lines
                        self.cpu_marks.append(cpu)
            except psutil.Error:
                pass
            if tick % 10 == 0:
                self.loads.append(os.getloadavg()[0])
            tick += 1
            self._stop.wait(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run_monitored(cmd: list[str], log_path: Path, env: dict | None = None, progress: Path | None = None,
                  cwd: Path = ROOT) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=env)
        with TreeMonitor(proc.pid, progress=progress) as mon:
            rc = proc.wait()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc != 0:
        tail = log_path.read_text()[-4000:]
        raise RuntimeError(f"{' '.join(cmd)} failed (rc={rc}); log {log_path}:\n{tail}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    step_cpu = [b - a for a, b in zip(mon.cpu_marks, mon.cpu_marks[1:])]
    return {"peak_rss_mb": mon.peak / 2**20, "cpu_s": cpu, "wall_s": time.time() - started, "step_cpu_s": step_cpu,
            "load": statistics.mean(mon.loads) if mon.loads else float("nan")}


# ------------------------------------------------------------------------------------------ hpc_rlhf
def hpc_overrides(args, assets, out_dir: Path) -> list[str]:
    return [
        f"actor.pretrain={assets['model']}", "actor.build_tiny=false", f"actor.learning_rate={args.lr}",
        "actor.lr_warmup_ratio=0.0", "actor.min_lr_ratio=1.0", "actor.adam_betas=[0.9,0.999]",
        "actor.weight_decay=0.0", "actor.max_norm=1.0",
        f"reward.reward_func_path={REWARD_DIR / args.reward}",
        "rollout.backend=transformers", f"rollout.n_samples_per_prompt={args.samples}",
        f"rollout.rollout_batch_size={args.prompts}", f"rollout.micro_rollout_batch_size={args.micro}",
        f"rollout.generate_max_len={args.max_new_tokens}", "rollout.temperature=1.0",
        "algo.advantage_estimator=group_norm", f"algo.kl.init_coef={args.beta}",
        *(["algo.kl.use_loss=true", "algo.kl.estimator=k3"] if args.beta > 0 else []),  # GRPO's KL: TRL's k3 loss
        "algo.loss_agg_mode=token_mean", f"data.apply_chat_template={str(args.chat).lower()}",
        "algo.eps_clip_low=0.2", "algo.eps_clip_high=0.2",
        f"train.max_steps={args.steps}", "train.num_episodes=1", "train.max_epochs=1",
        f"train.train_batch_size={args.prompts * args.samples}", f"train.micro_train_batch_size={args.micro}",
        f"train.output_dir={out_dir}", f"train.seed={args.seed}",
        f"data.prompt_data=[{assets['prompts']}]", "data.synthetic_task=null", "data.input_key=input",
        "data.label_key=label", f"data.prompt_max_len={64 if args.chat else 16}",
        "logger.use_tensorboard=false",
        *args.hpc_extra,
    ]


def run_hpc(args, assets, nproc: int, tag: str, profile: bool = False, source: Path = ROOT) -> dict:
    """hpc_rlhf on ``nproc`` ranks; ``source``: the source tree it runs from (another checkout for an A/B)."""
    out_dir = Path(args.work_dir) / tag
    port = str(29500 + random.randint(0, 2000))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", port]
    if profile:
        launcher += ["--no-python", sys.executable, "-m", "cProfile", "-o", str(out_dir / "rank.prof")]
        out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [*launcher, "-m", "hpc_rlhf.cli.train_ppo", "--config", "configs/grpo_tiny_cpu.yaml",
           *hpc_overrides(args, assets, out_dir)]
    print(f"[{tag}] $ {' '.join(cmd[2:])}", flush=True)
    metrics_file = out_dir / "metrics.jsonl"
    if metrics_file.exists():
        metrics_file.unlink()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source), os.environ.get("PYTHONPATH", "")])}
    proc = run_monitored(cmd, Path(args.work_dir) / f"{tag}.log", env=env, progress=metrics_file, cwd=source)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    prompt_tokens = mean_prompt_tokens(assets, args.chat)
    steps = []
    for r in rows:
        train_tokens = r["num_trained_samples"] * (prompt_tokens + r["response_length"])
        steps.append({"step_s": r["timing/step"], "gen_s": r["timing/generation"], "train_s": r["timing/train"],
                      "rollout_tok_s": r["rollout_tokens_per_s"], "train_tok_s": train_tokens / r["timing/train"],
                      "reward": r["reward"], "response_length": r["response_length"],
                      "other_s": r["timing/step"] - r["timing/generation"] - r["timing/train"]
                      - r.get("timing/make_experience", 0.0),
                      "phases": {k[len("timing/"):]: v for k, v in r.items() if k.startswith("timing/")},
                      "ref_old_s": r.get("timing/make_experience", 0.0)})
    name = f"hpc_rlhf {nproc} rank{'s' if nproc > 1 else ''}" + (f" ({source})" if source != ROOT else "")
    return {"name": name, "steps": steps, **proc}


def mean_prompt_tokens(assets, chat: bool) -> float:
    """Mean prompt length in tokens, as the model sees it (chat-templated when ``chat``)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(assets["model"])
    rows = [json.loads(x) for x in Path(assets["prompts"]).read_text().splitlines()]
    if chat:
        lengths = [len(tok.apply_chat_template([{"role": "user", "content": r["input"]}], tokenize=True,
                                               add_generation_prompt=True)["input_ids"]) for r in rows]
    else:
        lengths = [len(tok(r["input"], add_special_tokens=False)["input_ids"]) for r in rows]
    return sum(lengths) / len(rows)


# ------------------------------------------------------------------------------------------ TRL
def trl_reward_for(reward_file: Path):
    """The hpc_rlhf reward function in ``reward_file`` behind TRL's reward signature (plain or conversational)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_reward", reward_file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def text(x):  # conversational prompts / completions are lists of messages
        return x if isinstance(x, str) else "".join(m["content"] for m in x)

    def trl_reward(prompts, completions, label, **kwargs):
        prompts, completions = [text(p) for p in prompts], [text(c) for c in completions]
        queries = [p + c for p, c in zip(prompts, completions)]
        return mod.reward_func(queries, prompts, label, responses=completions)["rewards"].tolist()

    return trl_reward


def trl_worker(spec_path: str) -> None:
    """Runs in its own process: TRL GRPOTrainer on CPU, per-step timings to a jsonl."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    a = argparse.Namespace(**spec["args"])
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(x) for x in Path(spec["assets"]["prompts_ordered"]).read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["input"]}] if a.chat else r["input"],
                                  "label": r["label"]} for r in rows])
    tok = AutoTokenizer.from_pretrained(spec["assets"]["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["assets"]["model"], dtype=torch.float32)
    per_device = a.micro
    gas = a.prompts * a.samples // per_device
    config = GRPOConfig(
        output_dir=str(out), use_cpu=True, bf16=False, fp16=False, report_to=[], save_strategy="no",
        logging_steps=1, disable_tqdm=True, seed=a.seed, data_seed=a.seed, shuffle_dataset=False,
        max_steps=a.steps, learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=0.9, adam_beta2=0.999, weight_decay=0.0, max_grad_norm=1.0,
        per_device_train_batch_size=per_device, gradient_accumulation_steps=gas, steps_per_generation=gas,
        num_iterations=1, num_generations=a.samples, max_completion_length=a.max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, beta=a.beta, epsilon=0.2, loss_type="dapo", scale_rewards="group",
        use_vllm=False, dataloader_num_workers=0, log_completions=False,
        # TRL turns activation checkpointing on by default; the real-shape workload turns it off, as hpc_rlhf's
        # default (actor.gradient_checkpointing=false): same FLOPs on both sides.
        gradient_checkpointing=a.trl_grad_ckpt,
    )

    timings: dict[str, float] = {"gen": 0.0, "score": 0.0, "ref": 0.0, "old": 0.0}
    scoring = [False]

    class Timed(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
            # inside _generate_and_score_completions: the reference forward or the old-logprob forward
            t = time.perf_counter()
            try:
                return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
            finally:
                if scoring[0]:
                    timings["ref" if model is self.ref_model else "old"] += time.perf_counter() - t

        def _generate(self, prompts):  # generation + reward + decoding (TRL scores inside _generate's caller)
            t = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                timings["gen"] += time.perf_counter() - t

        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            scoring[0] = True
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                scoring[0] = False
                timings["score"] += time.perf_counter() - t

    log_rows: list[dict] = []

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.last = None

        def on_train_begin(self, args, state, control, **kw):
            self.last = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            # TRL merges its metrics (reward, num_tokens, ...) before the callbacks see them; on_log of
            # a step comes right after its on_step_end. One line per finished step (the monitor counts them).
            if logs and "reward" in logs and log_rows and "logs" not in log_rows[-1]:
                log_rows[-1]["logs"] = dict(logs)
                with open(out / "steps.jsonl", "a") as f:
                    f.write(json.dumps(log_rows[-1]) + "\n")

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            step_s = now - self.last
            self.last = now
            row = {"step": state.global_step, "step_s": step_s, "gen_s": timings["gen"],
                   "make_batch_s": timings["score"], "ref_s": timings["ref"], "old_s": timings["old"]}
            timings.update(gen=0.0, score=0.0, ref=0.0, old=0.0)
            log_rows.append(row)

    cb = StepTimer()
    trainer = Timed(model=model, reward_funcs=trl_reward_for(REWARD_DIR / a.reward), args=config, train_dataset=dataset,
                    processing_class=tok, callbacks=[cb])
    trainer.train()


def run_trl(args, assets) -> dict:
    out = Path(args.work_dir) / "trl"
    spec = Path(args.work_dir) / "trl_spec.json"
    plain_args = {k: v for k, v in vars(args).items() if k not in ("hpc_extra", "baseline_source")}
    spec.write_text(json.dumps({"args": plain_args, "assets": assets, "out": str(out)}))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(spec)]
    print(f"[trl] $ {' '.join(cmd[1:])}", flush=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    if (out / "steps.jsonl").exists():
        (out / "steps.jsonl").unlink()
    proc = run_monitored(cmd, Path(args.work_dir) / "trl.log", env=env, progress=out / "steps.jsonl")
    rows = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    steps, prev_tokens = [], 0.0
    for r in rows:
        logs = r.get("logs", {})
        tokens = logs.get("num_tokens", 0.0) - prev_tokens
        prev_tokens = logs.get("num_tokens", prev_tokens)
        length = logs.get("completions/mean_length", float("nan"))
        gen_tokens = length * args.prompts * args.samples
        train_s = r["step_s"] - r["make_batch_s"]
        steps.append({"step_s": r["step_s"], "gen_s": r["gen_s"], "train_s": train_s,
                      "rollout_tok_s": gen_tokens / max(r["gen_s"], 1e-9), "train_tok_s": tokens / max(train_s, 1e-9),
                      "reward": logs.get("reward", float("nan")), "response_length": length,
                      "other_s": r["make_batch_s"] - r["gen_s"] - r["ref_s"] - r["old_s"],
                      "ref_old_s": r["ref_s"] + r["old_s"],
                      "phases": {"generation": r["gen_s"], "ref_forward": r["ref_s"], "old_logprobs": r["old_s"],
                                 "reward+batch": r["make_batch_s"] - r["gen_s"] - r["ref_s"] - r["old_s"],
                                 "train": train_s}})
    return {"name": "TRL GRPOTrainer (1 process)", "steps": steps, **proc}


# ------------------------------------------------------------------------------------------ report
def summarize(run: dict) -> dict:
    steps = run["steps"][1:] or run["steps"]  # drop the warm-up step
    med = lambda k: statistics.median(s[k] for s in steps)  # noqa: E731
    last = run["steps"][-5:]
    cpu = run.get("step_cpu_s") or [float("nan")]
    return {"name": run["name"], "step_s": med("step_s"), "best_step_s": min(s["step_s"] for s in steps),
            "gen_s": med("gen_s"), "train_s": med("train_s"),
            "ref_old_s": med("ref_old_s"),
            "other_s": med("other_s"), "rollout_tok_s": med("rollout_tok_s"), "train_tok_s": med("train_tok_s"),
            "peak_rss_mb": run["peak_rss_mb"], "reward_last5": statistics.mean(s["reward"] for s in last),
            "reward_first": run["steps"][0]["reward"], "resp_len": med("response_length"),
            "cpu_s": run["cpu_s"], "step_cpu_s": statistics.median(cpu), "wall_s": run["wall_s"], "load": run["load"]}


def table(summaries: list[dict]) -> str:
    head = ("| run | s/step (median, steps 2..N) | best s/step | CPU s/step (all procs) | generation s | ref+old logprob s | train s "
            "| other s | rollout tok/s "
            "| train tok/s | peak RSS MB (sum) | reward step 1 | reward last 5 | resp len | run wall s "
            "| run CPU s | load avg |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summaries:
        lines.append(f"| {s['name']} | {s['step_s']:.2f} | {s['best_step_s']:.2f} | {s['step_cpu_s']:.2f} | {s['gen_s']:.2f} | "
                     f"{s['ref_old_s']:.2f} | {s['train_s']:.2f} | "
                     f"{s['other_s']:.2f} | {s['rollout_tok_s']:.0f} | {s['train_tok_s']:.0f} | "
                     f"{s['peak_rss_mb']:.0f} | {s['reward_first']:.3f} | {s['reward_last5']:.3f} | "
                     f"{s['resp_len']:.1f} | {s['wall_s']:.0f} | {s['cpu_s']:.0f} | {s['load']:.1f} |")
    return "\n".join(lines)


def versions() -> str:
    import platform

    import torch
    import transformers

    out = [f"python {platform.python_version()}", f"torch {torch.__version__}",
           f"transformers {transformers.__version__}"]
    for name in ("trl", "deepspeed", "accelerate"):
        try:
            out.append(f"{name} {__import__(name).__version__}")
        except Exception:  # noqa: BLE001
            pass
    cpu = "unknown CPU"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except Exception:  # noqa: BLE001
        pass
    return f"{cpu}, {os.cpu_count()} cores; " + ", ".join(out)


def print_profile(path: Path, top: int = 25) -> None:
    import pstats

    stats = pstats.Stats(str(path))
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)


# ------------------------------------------------------------------------------------------ GPU section
def gpu_section(force: bool) -> None:
    import torch

    if not torch.cuda.is_available():
        print("\n[gpu] skipped: torch.cuda.is_available() is False "
              f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); run on a GPU node to measure "
              "rollout tokens/s, weight-sync s/GB and step time of a 0.5B model.")
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    from hpc_rlhf.rollout.base import GenerationRequest, SamplingParams
    from hpc_rlhf.rollout.transformers_engine import TransformersRolloutEngine

    dev = torch.device("cuda")
    # Qwen2-0.5B-like shape (24 layers, hidden 896, 14 heads / 2 kv heads, intermediate 4864, vocab 151936).
    cfg = LlamaConfig(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096,
                      tie_word_embeddings=True, attention_bias=False)
    torch.manual_seed(0)
    actor = LlamaForCausalLM(cfg).to(dev, torch.bfloat16)
    rollout_model = LlamaForCausalLM(cfg).to(dev, torch.bfloat16).eval()
    nparams = sum(p.numel() for p in actor.parameters())
    engine = TransformersRolloutEngine(rollout_model, eos_token_id=None, pad_token_id=0, device=dev)
    prompts, n, new = 32, 8, 256
    sp = SamplingParams(max_new_tokens=new, temperature=1.0, seed=0)
    reqs = [GenerationRequest([random.Random(i).randint(3, 1000) for _ in range(128)], sp, n=n)
            for i in range(prompts)]
    engine.generate(reqs[:2])
    torch.cuda.synchronize()
    t = time.perf_counter()
    res = engine.generate(reqs)
    torch.cuda.synchronize()
    gen_s = time.perf_counter() - t
    toks = sum(len(r.output_ids) for r in res)
    # weight sync: the colocated path (state-dict copy into the rollout model)
    sd = actor.state_dict()
    gb = sum(v.numel() * v.element_size() for v in sd.values()) / 1e9
    torch.cuda.synchronize()
    t = time.perf_counter()
    engine.update_weights((k, v.detach().clone()) for k, v in sd.items())
    torch.cuda.synchronize()
    sync_s = time.perf_counter() - t
    # one GRPO-like train step on the generated batch (bf16, micro 16)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-6)
    seqs = torch.tensor([r.prompt_ids + (r.output_ids + [0] * new)[:new] for r in res], device=dev)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(0, seqs.shape[0], 16):
        logits = actor(input_ids=seqs[i : i + 16]).logits[:, -new - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, seqs[i : i + 16, -new:, None]).squeeze(-1)
        (-(lp.mean()) / (seqs.shape[0] // 16)).backward()
    opt.step()
    opt.zero_grad()
    torch.cuda.synchronize()
    train_s = time.perf_counter() - t
    print(f"\n[gpu] {torch.cuda.get_device_name()} ; {nparams / 1e6:.0f}M params bf16")
    print(f"[gpu] rollout (hpc_rlhf transformers engine): {prompts}x{n} samples x {new} tokens: "
          f"{toks / gen_s:.0f} tok/s ({gen_s:.1f}s)")
    print(f"[gpu] weight sync (colocated state-dict copy): {sync_s / gb:.3f} s/GB ({gb:.2f} GB, {sync_s:.3f}s)")
    print(f"[gpu] step time (generation + sync + train): {gen_s + sync_s + train_s:.1f}s "
          f"(train {train_s:.1f}s on {seqs.shape[0]} x {seqs.shape[1]} tokens)")


# ------------------------------------------------------------------------------------------ main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", default=str(ROOT / "runs/bench_grpo_vs_trl"))
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                   help="workload: the tiny char-level model, or a SmolLM2-135M-shaped one (see above)")
    p.add_argument("--steps", type=int, help="default: 20 (tiny), 8 (smollm2-135m)")
    p.add_argument("--prompts", type=int, help="prompts per step; default 16 (tiny), 4 (smollm2-135m)")
    p.add_argument("--samples", type=int, help="samples per prompt (num_generations); default 8 / 4")
    p.add_argument("--max-new-tokens", type=int, help="default 16 / 32")
    p.add_argument("--micro", type=int, help="micro batch (rows per forward/backward); default 32 / 16")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--trl-grad-ckpt", type=lambda v: v == "on", metavar="{on,off}",
                   help="TRL's gradient_checkpointing; default: on (TRL's own default) for tiny, off for smollm2-135m")
    p.add_argument("--only", nargs="*", choices=["trl", "hpc1", "hpc2"], default=["trl", "hpc1", "hpc2"])
    p.add_argument("--profile", action="store_true", help="also cProfile hpc_rlhf on 1 rank and print the top")
    p.add_argument("--hpc-extra", nargs="*", default=[], help="extra key=value overrides for hpc_rlhf runs")
    p.add_argument("--baseline-source", type=Path,
                   help="also run hpc_rlhf on 1 rank from this source tree (e.g. `git archive` of an older commit), "
                        "in the same invocation: an A/B of a change against TRL")
    p.add_argument("--gpu", action="store_true", help="run the GPU section only")
    p.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.trl_worker:
        trl_worker(args.trl_worker)
        return
    if args.gpu:
        gpu_section(force=True)
        return
    for key, value in SHAPES[args.shape].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.shape != "tiny" and args.work_dir == p.get_default("work_dir"):
        args.work_dir = str(ROOT / f"runs/bench_grpo_vs_trl_{args.shape}")
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    assets = prepare(args)
    runs = []
    for which in args.only + (["baseline"] if args.baseline_source else []):
        if which == "trl":
            runs.append(run_trl(args, assets))
        elif which == "baseline":
            runs.append(run_hpc(args, assets, 1, "hpc1_baseline", source=args.baseline_source.resolve()))
        else:
            runs.append(run_hpc(args, assets, 1 if which == "hpc1" else 2, which))
        print(table([summarize(runs[-1])]), flush=True)
    summaries = [summarize(r) for r in runs]
    (Path(args.work_dir) / "results.json").write_text(json.dumps({"summaries": summaries, "runs": runs}, indent=1,
                                                                 default=str))
    print(f"\nGRPO {args.prompts} prompts x {args.samples} samples, <= {args.max_new_tokens} new tokens, "
          f"{args.steps} steps, model {MODEL_SIZES if args.shape == 'tiny' else args.shape}, "
          f"KL beta {args.beta}, chat template {args.chat}")
    print(f"machine: {versions()}\n")
    print(table(summaries))
    for r in runs:
        phases = {}
        for s in r["steps"][1:]:
            for k, v in s["phases"].items():
                phases.setdefault(k, []).append(v)
        print(f"{r['name']} median phase seconds: "
              + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in phases.items()))
    if args.profile:
        run_hpc(args, assets, 1, "hpc1_profile", profile=True)
        print_profile(Path(args.work_dir) / "hpc1_profile" / "rank.prof")
    gpu_section(force=False)


if __name__ == "__main__":
    main()
