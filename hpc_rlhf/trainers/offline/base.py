"""The loop shared by the offline trainers (SFT, reward model, DPO, KTO): data parallel over the world.

Every rank reads the (small, tokenised) dataset and draws the same global batch from a seeded,
resumable stream; dp rank ``r`` trains on its contiguous ``1 / dp`` shard, in micro-batches that are
padded or packed (``hpc_rlhf.data.packing``). Loss normalisers (trained tokens, pairs, samples) are
counted on the *global* batch before the first micro-batch, so the summed micro-batch losses equal the
full-batch mean exactly (``hpc_rlhf.algos.preference.global_mean``). The engine back-propagates each
share as it is (the facade passes ``scale_wrt_gas=False``: DeepSpeed does not divide by the accumulation
steps), so the gradients summed over the micro-batches are those of the global mean.

A subclass supplies the datasets, the model factory, one micro-batch's loss and statistics, and the
eval statistics. The steps, evals, checkpoints and export are scheduled by the run skeleton shared with RL
(``hpc_rlhf.trainers.run_skeleton``; this class implements its hooks). The step reads::

    batch -> shard -> micro-batches: forward, loss, backward, step -> reduce stats
          -> [eval] -> metrics.jsonl -> [checkpoint] ... -> final eval -> HF export (<output_dir>/model)

Statistics are *sums* (``loss_sum``, ``num_pairs``, ...) all-reduced over the dp group once per step, so
ratios such as accuracy are exact over the global batch.

With ``ds.tensor_parallel_size = tp > 1`` (DeepSpeed AutoTP) each run of ``tp`` consecutive ranks holds one
sharded copy of the model and trains on the same shard; there are ``world / tp`` dp ranks.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from hpc_rlhf.ckpt import CheckpointManager, load_json, load_rank_rng, save_json_atomic, save_rank_rng
from hpc_rlhf.ckpt.layout import compare_layouts, read_layout, supervised_layout, write_layout
from hpc_rlhf.ckpt.resume import agreed_checkpoint, warn_if_starting_over
from hpc_rlhf.ckpt.universal import load_resharded
from hpc_rlhf.config import save_resolved_config
from hpc_rlhf.config.schema import RefConfig
from hpc_rlhf.config.supervised import ReferenceRunConfig, SupervisedRunConfig
from hpc_rlhf.data.packing import CollatedBatch, TokenSample, collate
from hpc_rlhf.data.prompts import PromptStream
from hpc_rlhf.models.loading import import_model_code, load_causal_lm, load_tokenizer, resolve_attn_implementation
from hpc_rlhf.models.precision import resolve_dtype
from hpc_rlhf.planning.model_shape import check_moe_tensor_parallel, local_hf_config
from hpc_rlhf.resilience.stall_guard import StallGuard
from hpc_rlhf.trainers import run_skeleton
from hpc_rlhf.trainers.offline.moe_terms import MoETerms, moe_summary
from hpc_rlhf.trainers.run_skeleton import RunHooks, RunPlan
from hpc_rlhf.training.deepspeed_engine import FrozenEngine, TrainEngine, gradient_accumulation_steps
from hpc_rlhf.utils.metrics import MetricsLogger, PhaseTimer
from hpc_rlhf.utils.seeding import seed_rank
from hpc_rlhf.world.groups import comm_device, tensor_data_parallel_groups, world_peers
from hpc_rlhf.world.network import save_world_record

log = logging.getLogger(__name__)
STATE_FILE = "trainer_state.json"
ENGINE_TAG = "engine"
RM_STATS_SAMPLES = 256  # train pairs scored for reward_mean / reward_std when there is no eval set
RunConfigT = TypeVar("RunConfigT", bound=SupervisedRunConfig)


def all_reduce_sums(sums: dict[str, float], group: Any = None) -> dict[str, float]:
    """Sum every statistic over ``group`` (default: the world; every rank must hold the same keys)."""
    keys = sorted(sums)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict(sums)
    values = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64, device=comm_device())
    dist.all_reduce(values, group=group)
    return dict(zip(keys, values.tolist(), strict=True))


def ratio(sums: dict[str, float], num: str, den: str) -> float:
    return sums[num] / sums[den] if sums.get(den) else float("nan")


class SupervisedTrainer(RunHooks, Generic[RunConfigT]):
    """Base of the offline trainers. Subclasses implement the methods that raise NotImplementedError; the
    run hooks (``run_step``, ``run_eval``, ``metrics_row``, ...) plug the loop into the shared run skeleton."""

    kind = "supervised"
    uses_reference = False  # DPO / KTO: a frozen reference model (``self.ref``), built after the trained engine

    def __init__(self, cfg: RunConfigT) -> None:
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.tp_group, self.dp_group = tensor_data_parallel_groups(cfg.ds.tensor_parallel_size)
        self.dp_size, self.dp_rank = dist.get_world_size(self.dp_group), dist.get_rank(self.dp_group)
        seed_rank(cfg.train.seed, self.rank)
        self.on_gpu = torch.cuda.is_available()
        self.dtype = resolve_dtype(cfg.ds.param_dtype, self.on_gpu)
        self.attn = resolve_attn_implementation(cfg.ds.attn_implementation, self.on_gpu)
        self.tokenizer = load_tokenizer(cfg.model.pretrain, key="model.pretrain")
        check_moe_tensor_parallel(local_hf_config(cfg.model), cfg.ds.tensor_parallel_size, "model.pretrain")
        self.output_dir = Path(cfg.train.output_dir)

        self.train_set, eval_set = self.build_datasets()
        # Every rank evaluates the same number of samples (ZeRO-3 forwards are collective).
        self.eval_set = eval_set[:len(eval_set) - len(eval_set) % self.dp_size]
        tcfg = cfg.train
        self.micro = tcfg.micro_train_batch_size
        self.gas = gradient_accumulation_steps(tcfg.train_batch_size, self.micro, self.dp_size)
        self.stream = PromptStream(self.train_set, tcfg.train_batch_size, seed=tcfg.seed, num_episodes=tcfg.max_epochs)
        self.num_steps = self.stream.num_batches if tcfg.max_steps is None else min(tcfg.max_steps,
                                                                                   self.stream.num_batches)
        if self.num_steps < 1:
            raise ValueError(f"{len(self.train_set)} train samples cannot fill one batch of train.train_batch_size="
                             f"{tcfg.train_batch_size}")
        import_model_code(cfg.model.pretrain, self.reference_config().pretrain if self.uses_reference else None)
        self.engine = TrainEngine.create(self.model_factory, cfg.ds, cfg.model,
                                         train_batch_size=tcfg.train_batch_size, micro_train_batch_size=self.micro,
                                         num_training_steps=self.num_steps, dp_group=self.dp_group,
                                         tp_group=self.tp_group)
        # A mixture-of-experts model: its load-balancing loss (loss.aux_loss_coef) and routing statistics.
        self.moe = MoETerms.of(self.engine.module, cfg.loss.aux_loss_coef)
        if self.uses_reference:
            self.ref = self.frozen_reference()
        self.ckpt = CheckpointManager(cfg.ckpt.path or self.output_dir / "ckpt", max_num=cfg.ckpt.max_num)
        # recorded in checkpoints; compared on resume
        self.layout = supervised_layout(cfg, dist.get_world_size(), torch.cuda.is_available())
        if not cfg.ckpt.load:
            warn_if_starting_over(self.ckpt)
        self.step = 0
        self.stopped_by_signal = False
        self.requeued = False  # with stopped_by_signal: SLURM restarts the job (cli exit status, preemption.py)
        resumed = self.maybe_resume()
        if self.rank == 0:
            save_resolved_config(cfg, self.output_dir)
            save_world_record(world_peers(), self.output_dir)  # where the ranks met (world.json)
            self.metrics = MetricsLogger(self.output_dir, cfg.logger, cfg.model_dump(mode="json"), resume=resumed)
            if resumed:
                self.metrics.truncate_after(self.step)
            log.info("%s: %d train / %d eval items, %d steps, %d micro-batches per rank per step, packing=%s",
                     self.kind, len(self.train_set), len(self.eval_set), self.num_steps, self.gas,
                     tcfg.packing_samples)
        else:
            self.metrics = None

    # ------------------------------------------------------------------ subclass interface
    def build_datasets(self) -> tuple[list, list]:
        raise NotImplementedError

    def model_factory(self) -> torch.nn.Module:
        ds = self.cfg.ds
        return load_causal_lm(self.cfg.model.pretrain_path("model.pretrain"), self.dtype, self.attn,
                              ds.use_liger_kernel, ds.lora.load_in_4bit,
                              freeze_vision_tower=self.cfg.model.freeze_vision_tower)

    def global_counts(self, batch: list) -> dict[str, int]:
        """Loss normalisers of the whole step batch (every rank sees the same batch)."""
        raise NotImplementedError

    def input_tokens(self, items: list) -> int:
        """Tokens the trained model's forward of ``items`` reads (throughput, and the MoE loss's weights)."""
        raise NotImplementedError

    def router_sink(self) -> list | None:
        """What the trained model's forward of a train micro-batch passes as ``router`` (its router logits, for
        an MoE model's load-balancing loss and statistics); None for a dense model, the reference and evals."""
        return self.moe.sink() if self.moe is not None else None

    def train_micro(self, items: list, counts: dict[str, int]) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss share to back-propagate, statistic sums) of one micro-batch."""
        raise NotImplementedError

    def eval_micro(self, items: list) -> dict[str, float]:
        raise NotImplementedError

    def summarize(self, sums: dict[str, float], prefix: str = "") -> dict[str, float]:
        raise NotImplementedError

    def after_export(self, model_dir: Path) -> None:
        """Rank 0, after the HF export (the reward model adds its reward statistics)."""

    # ------------------------------------------------------------------ helpers for subclasses
    def collate(self, samples: Sequence[TokenSample]) -> CollatedBatch:
        tcfg = self.cfg.train
        return collate(samples, self.tokenizer.pad_token_id, packing=tcfg.packing_samples,
                       max_tokens_per_row=tcfg.packing_max_tokens or self.cfg.data.max_len)

    def reference_config(self) -> RefConfig:
        """``ref`` of a trainer with a frozen reference (``uses_reference``)."""
        if not isinstance(self.cfg, ReferenceRunConfig):
            raise TypeError(f"{type(self).__name__} uses a reference model, but its config "
                            f"{type(self.cfg).__name__} has no ref section")
        return self.cfg.ref

    def frozen_reference(self) -> FrozenEngine:
        cfg, ref = self.cfg, self.reference_config()
        path = ref.pretrain or cfg.model.pretrain_path("model.pretrain")
        # Under QLoRA the reference loads the same 4-bit base as the policy, so both start equal.
        return FrozenEngine.create(lambda: load_causal_lm(path, self.dtype, self.attn, cfg.ds.use_liger_kernel,
                                                          cfg.ds.lora.load_in_4bit),
                                   cfg.ds, ref, micro_batch_size=self.micro, dp_group=self.dp_group,
                                   tp_group=self.tp_group)

    # ------------------------------------------------------------------ the run (hpc_rlhf.trainers.run_skeleton)
    def fit(self) -> list[dict[str, Any]]:
        """Train the remaining steps, then export; every phase bounded by a ``StallGuard`` (a hang exits 124).

        Returns one row per step and one for the eval at start, each with its ``step``, on every rank."""
        tcfg = self.cfg.train
        plan = RunPlan(num_steps=self.num_steps, rank=self.rank, logging_steps=self.cfg.logger.logging_steps,
                       save_steps=self.cfg.ckpt.save_steps, evaluates=bool(self.eval_set), eval_every=tcfg.eval_steps,
                       eval_at_start=bool(self.eval_set), start_step=self.step, requeue=self.cfg.slurm.requeue)
        guard = StallGuard.from_config(tcfg, self.rank, dist.get_world_size())
        outcome = run_skeleton.run(self, plan, guard)
        self.stopped_by_signal, self.requeued = outcome.stopped_by_signal, outcome.requeued
        return outcome.history

    def run_step(self, step: int, timer: PhaseTimer) -> tuple[dict[str, Any], int]:
        row, num_tokens = self.train_step(self.stream.next_batch(), timer)
        self.step = step
        return row, num_tokens

    def run_eval(self, step: int) -> dict[str, float]:
        return self.evaluate()

    def metrics_row(self, step: int, result: tuple[dict[str, Any], int], eval_row: dict[str, float] | None,
                    timer: PhaseTimer) -> dict[str, Any]:
        row, num_tokens = result
        if eval_row is not None:
            row.update(eval_row)
        seconds = dict(timer.seconds)
        step_s = seconds.pop("step") + seconds.get("eval", 0.0)  # an offline step's time includes its eval
        row.update({f"timing/{phase}": value for phase, value in seconds.items()})
        row.update({"timing/step": step_s, "tokens_per_s": num_tokens / max(step_s, 1e-9),
                    "epoch": self.stream.episode})
        return {k: v for k, v in row.items() if v is not None}  # an engine step that reports no lr / grad_norm

    def history_row(self, step: int, row: dict[str, Any]) -> dict[str, Any]:
        if self.rank == 0:
            shown = {k: round(v, 4) for k, v in row.items()
                     if isinstance(v, float) and not k.startswith("timing/") and k != "lr"}
            log.info("step %d/%d %s", step, self.num_steps, shown)
        return {"step": step, **row}

    def save_checkpoint(self, step: int) -> None:
        self.save()

    def train_step(self, batch: list, timer: PhaseTimer) -> tuple[dict[str, Any], int]:
        per_rank = len(batch) // self.dp_size
        shard = batch[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        counts = self.global_counts(batch)
        global_tokens = self.input_tokens(batch)
        sums: dict[str, float] = defaultdict(float)
        info: dict[str, Any] = {}
        self.engine.train()
        with timer("train"):
            for begin in range(0, per_rank, self.micro):
                items = shard[begin:begin + self.micro]
                tokens = self.input_tokens(items)
                if self.moe is not None:
                    self.moe.start_micro()
                loss, stats = self.train_micro(items, counts)
                stats["num_input_tokens"] = tokens
                if self.moe is not None:
                    loss, moe_stats = self.moe.finish_micro(loss, tokens, global_tokens, self.dp_size)
                    stats.update(moe_stats)
                # The share is already normalised by global counts; nothing divides it by the accumulation steps.
                self.engine.backward(loss)
                info = self.engine.step()
                for key, value in stats.items():
                    sums[key] += value
        sums = all_reduce_sums(sums, self.dp_group)
        row: dict[str, float | None] = {**self.summarize(sums), **moe_summary(sums)}
        row.update(lr=info.get("lr"), grad_norm=info.get("grad_norm"))
        return row, int(sums.get("num_input_tokens", 0))

    @torch.no_grad()
    def evaluate(self, items: Sequence | None = None) -> dict[str, float]:
        items = self.eval_set if items is None else items
        per_rank = len(items) // self.dp_size
        shard = items[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        sums: dict[str, float] = defaultdict(float)
        self.engine.eval()
        for begin in range(0, per_rank, self.micro):
            for key, value in self.eval_micro(list(shard[begin:begin + self.micro])).items():
                sums[key] += value
        self.engine.train()
        return self.summarize(all_reduce_sums(sums, self.dp_group), prefix="eval_")

    # ------------------------------------------------------------------ checkpoint / export
    def save(self) -> None:
        with self.ckpt.saving(self.step) as tmp:
            self.engine.save_checkpoint(str(tmp), tag=ENGINE_TAG, client_state={"step": self.step})
            save_rank_rng(tmp, self.rank)
            if self.rank == 0:
                save_json_atomic(tmp / STATE_FILE, {"step": self.step, "kind": self.kind,
                                                    "stream": self.stream.state_dict()})
                write_layout(tmp, self.layout)

    def maybe_resume(self) -> bool:
        if not self.cfg.ckpt.load:
            return False
        latest = agreed_checkpoint(self.ckpt)  # verified, and the same on every rank
        if latest is None:
            log.warning("ckpt.load=true but no checkpoint under %s: starting from scratch", self.ckpt.root)
            return False
        state = load_json(latest / STATE_FILE)
        if state.get("kind") != self.kind:
            raise ValueError(f"{latest} is a {state.get('kind')} checkpoint, this is a {self.kind} run")
        saved = read_layout(latest)  # None: written before layouts were recorded; loads as saved
        change = compare_layouts(saved, self.layout, latest) if saved else None
        if change is not None and change.resharded:
            if self.rank == 0:
                log.warning("checkpoint %s was saved with another layout: %s", latest, "; ".join(change.notes))
            # The global batch is split over the data-parallel ranks by its order, so the data stream carries over.
            load_resharded(self.engine, latest, "model", latest, ENGINE_TAG)
        else:
            self.engine.load_checkpoint(str(latest), tag=ENGINE_TAG)
        self.stream.load_state_dict(state["stream"])
        self.step = int(state["step"])
        if change is None or change.same_world:
            load_rank_rng(latest, self.rank)
        else:
            log.info("rank %d: RNG seeded as at a fresh start (the checkpoint's world had another size)", self.rank)
        log.info("resumed from %s at step %d", latest, self.step)
        return True

    def export(self) -> None:
        model_dir = self.output_dir / "model"
        self.engine.save_hf(str(model_dir), tokenizer=self.tokenizer)
        if self.rank == 0:
            self.after_export(model_dir)
            if self.metrics is not None:
                self.metrics.close()
        dist.barrier()
