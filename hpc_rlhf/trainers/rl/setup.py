"""Build what a PPO-family run needs on each rank: tokenizer, controller state, role engines.

Kept apart from the loop so ``loop.py`` reads as the step story.

Runs on every rank: each builds the engines of the roles it hosts; rank 0 also the controller state.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from hpc_rlhf.agents.agent_loader import AgentLoadError, load_agent_executor
from hpc_rlhf.agents.executor import AgentExecutor, SingleTurnExecutor
from hpc_rlhf.agents.openai_executor import OpenAIAgentExecutor  # imports no openai / fastapi by itself
from hpc_rlhf.algos import AdaptiveKLController, FixedKLController, RunningRewardNormalizer
from hpc_rlhf.config.rollout import RolloutConfig, rollout_engine_kind
from hpc_rlhf.config.schema import RunConfig
from hpc_rlhf.data.prompts import Prompt, PromptDataset, PromptStream
from hpc_rlhf.data.reasoning_gym import reasoning_gym_reward, write_prompt_file  # reasoning-gym itself: lazily
from hpc_rlhf.data.vision_prompts import VisionPromptEncoder
from hpc_rlhf.models.hf_module import hf_model, to_device
from hpc_rlhf.models.kernels import resolve_attn_implementation
from hpc_rlhf.models.loading import (
    check_same_tokenizer,
    import_model_code,
    load_causal_lm,
    load_value_model,
    require_local_model,
)
from hpc_rlhf.models.moe import moe_spec
from hpc_rlhf.models.precision import resolve_dtype
from hpc_rlhf.models.tokenizer_protocol import Tokenizer, eos_id
from hpc_rlhf.models.vision import is_vision_language
from hpc_rlhf.planning.model_shape import ModelSizeError, check_moe_tensor_parallel, local_hf_config
from hpc_rlhf.rewards.functions import RewardFunction
from hpc_rlhf.rewards.remote_rm import RemoteRewardModel
from hpc_rlhf.rewards.reward_model import RewardModelRole, build_reward_model_role
from hpc_rlhf.rollout.base import RolloutEngine, SamplingParams
from hpc_rlhf.rollout.transformers_engine import TransformersRolloutEngine
from hpc_rlhf.rollout.vllm_external_launcher import VllmEngineSpec, VllmRolloutEngine  # vLLM itself: lazily
from hpc_rlhf.rollout.vllm_server import VllmServerEngine
from hpc_rlhf.sandbox.factory import configure_run_sandbox
from hpc_rlhf.trainers.rl.controller_checkpoint import Buffers, ControllerCheckpoint
from hpc_rlhf.trainers.rl.rollout_health import RolloutHealth
from hpc_rlhf.trainers.run_skeleton import RunPlan
from hpc_rlhf.training.deepspeed_engine import FrozenEngine, TrainEngine  # deepspeed itself: lazily
from hpc_rlhf.utils.seeding import seed_rank
from hpc_rlhf.weight_sync.adapter import adapter_sync_refusal, resolve_lora_sync
from hpc_rlhf.weight_sync.sharded import WeightSync, build_weight_sync
from hpc_rlhf.world.groups import WorldGroups

log = logging.getLogger(__name__)
_REFILL_EPISODES = 1_000_000  # passes the refill stream may make over the data: never the limit in practice


class SetupError(ValueError):
    """The run cannot start; the message names the key to change."""


def check_supported(cfg: RunConfig) -> None:
    """Keys that ``plan`` understands but the RL trainer does not implement yet fail here, loudly."""
    unsupported = {
        "ds.ring_attn_size together with ds.tensor_parallel_size": cfg.ds.ring_attn_size > 1
        and cfg.ds.tensor_parallel_size > 1,
    }
    keys = [k for k, on in unsupported.items() if on]
    if keys:
        raise SetupError(f"{', '.join(keys)}: not supported by the RL trainer yet (plan accepts them for sizing); "
                         "change the recipe")
    try:
        check_moe_tensor_parallel(local_hf_config(cfg.actor), cfg.ds.tensor_parallel_size, "actor.pretrain")
    except ModelSizeError as err:
        raise SetupError(str(err)) from None
    check_routing_replay(cfg)


def check_routing_replay(cfg: RunConfig) -> None:
    """``algo.routing_replay=rollout`` needs an MoE actor and rollouts that record every sampled token's routes."""
    if cfg.algo.routing_replay != "rollout":
        return
    key = "algo.routing_replay=rollout"
    if (local_hf_config(cfg.actor) or {}).get("n_routed_experts"):
        raise SetupError(f"{key}: actor.pretrain={cfg.actor.pretrain} has a DeepSeek-style router (sigmoid scores, "
                         "group-limited top-k), which routing replay does not support; set algo.routing_replay=none")
    if not actor_is_moe(cfg):
        raise SetupError(f"{key}: actor.pretrain={cfg.actor.pretrain} is not a mixture-of-experts model, so there "
                         "are no routes to replay; set algo.routing_replay=none")
    if cfg.rollout.backend == "vllm":
        if not torch.cuda.is_available():
            raise SetupError(f"{key} with rollout.backend=vllm on a machine without a GPU: vLLM returns routed "
                             "experts only from its V2 model runner, which needs a GPU (Triton); use "
                             "rollout.backend=transformers, or algo.routing_replay=none")
        log.warning("%s with rollout.backend=vllm: vLLM's routed experts (enable_return_routed_experts) feed the "
                    "replay; this path has not been exercised by the project's tests (no GPU there)", key)


def records_routes(cfg: RunConfig) -> bool:
    """Whether the rollout engine records each token's experts (``algo.routing_replay``): an MoE actor generated
    by the transformers engine."""
    return (cfg.algo.routing_replay != "none" and cfg.rollout.backend == "transformers"
            and actor_is_moe(cfg))


def actor_is_moe(cfg: RunConfig) -> bool:
    """Whether ``actor.pretrain``'s config.json describes a mixture-of-experts model."""
    return moe_spec(local_hf_config(cfg.actor) or {}) is not None


def actor_is_vision_language(cfg: RunConfig) -> bool:
    """Whether ``actor.pretrain``'s config.json describes a vision-language model (``hpc_rlhf.models.vision``)."""
    return is_vision_language(local_hf_config(cfg.actor) or {})


def check_vision_language(cfg: RunConfig, on_gpu: bool) -> None:
    """What a vision-language actor cannot be combined with yet, refused before any model loads (naming keys)."""
    if not actor_is_vision_language(cfg):
        if cfg.actor.freeze_vision_tower:
            raise SetupError(f"actor.freeze_vision_tower=true but actor.pretrain={cfg.actor.pretrain} is a text-only "
                             "model")
        return
    # The critic (PPO with GAE; hpc_rlhf.models.vision.vision_value_class), the reference and the teacher run their
    # forwards with the rows' images: a text-only model of their own would not see them.
    for key, section in (("critic.pretrain", cfg.critic), ("ref.pretrain", cfg.ref),
                         ("teacher.pretrain", cfg.teacher)):
        hf = local_hf_config(section)
        if hf is not None and not is_vision_language(hf):
            raise SetupError(f"{key}={section.pretrain} is a text-only model but actor.pretrain={cfg.actor.pretrain} "
                             f"is a vision-language model: it must read the rows' images; give a vision-language "
                             f"model of the actor's family" + (" or leave it unset (it starts from actor.pretrain)"
                                                                if key != "teacher.pretrain" else ""))
    if cfg.reward.pretrain is not None:
        raise SetupError("a vision-language actor with a reward model (reward.pretrain) is not supported yet: use "
                         "reward.reward_func_path")
    if cfg.ds.ring_attn_size > 1:
        raise SetupError("ds.ring_attn_size > 1 with a vision-language actor is not supported yet")
    if cfg.rollout.backend == "vllm" and not on_gpu:
        raise SetupError("rollout.backend=vllm with a vision-language actor needs a GPU: vLLM's CPU build cannot load "
                         "Qwen-VL without torchvision (docs/vlm.md); use rollout.backend=transformers on CPU")


def vision_encoder(cfg: RunConfig, tokenizer: Tokenizer) -> VisionPromptEncoder | None:
    """The prompt-image encoder of a vision-language actor (its image processor, ``data.min_pixels`` /
    ``max_pixels``); None for a text model."""
    if not actor_is_vision_language(cfg):
        return None
    from transformers import AutoConfig

    path = model_path(cfg.actor.pretrain, "actor.pretrain")
    return VisionPromptEncoder.from_pretrained(path, tokenizer, AutoConfig.from_pretrained(path),
                                               cfg.data.min_pixels, cfg.data.max_pixels)


def model_path(path: str | None, key: str) -> str:
    """``path`` of a role that needs a model, or a SetupError naming ``key``."""
    if path is None:
        raise SetupError(f"{key} is not set: give the model folder")
    return path


def check_model_paths(cfg: RunConfig) -> None:
    """Every role's model folder exists, before minutes of start-up (errors name the key)."""
    paths = {"actor.pretrain": cfg.actor.pretrain, "critic.pretrain": cfg.critic.pretrain,
             "ref.pretrain": cfg.ref.pretrain, "teacher.pretrain": cfg.teacher.pretrain,
             "reward.pretrain": cfg.reward.pretrain}
    for key, path in paths.items():
        if path is not None or key == "actor.pretrain":
            require_local_model(path, key)


def check_teacher_tokenizer(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """On-policy distillation: the teacher must read the student's token ids as the student does."""
    # transformers' type, not the Tokenizer protocol: the check compares the two tokenizers loaded from their
    # folders (name_or_path, bos_token_id), members no other call site needs.
    if cfg.needs_teacher:
        check_same_tokenizer(tokenizer, "actor.pretrain", model_path(cfg.teacher.pretrain, "teacher.pretrain"),
                             "teacher.pretrain")


def optimizer_steps(cfg: RunConfig, num_steps: int) -> int:
    """Optimizer steps over the run: the LR schedule's horizon."""
    samples = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    return max(1, num_steps * cfg.train.max_epochs * samples // cfg.train.train_batch_size)


class ControllerState:
    """Everything only rank 0 owns: prompt stream, reward function, KL controller, reward statistics."""

    def __init__(self, cfg: RunConfig, tokenizer: Tokenizer) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        r = cfg.reward
        gym = cfg.data.reasoning_gym
        if not (r.reward_func_path or r.remote_url or r.pretrain or cfg.train.agent_func_path or gym.task):
            raise SetupError("no reward source: set reward.reward_func_path, reward.pretrain, reward.remote_url, "
                             "data.reasoning_gym.task, or an agent (train.agent_func_path) whose environment returns "
                             "rewards")
        text_only = None if actor_is_vision_language(cfg) else cfg.actor.pretrain
        dataset = PromptDataset.from_config(cfg.data, tokenizer, seed=cfg.train.seed, text_only_model=text_only) \
            if not gym.task else reasoning_gym_prompts(cfg, tokenizer)
        self.stream = PromptStream(dataset, cfg.rollout.rollout_batch_size, seed=cfg.train.seed,
                                   num_episodes=cfg.train.num_episodes)
        # DAPO refill rounds draw from their own endless stream, so the step count above stays exact.
        self.refill_stream = PromptStream(dataset, cfg.rollout.rollout_batch_size, seed=cfg.train.seed + 1,
                                          num_episodes=_REFILL_EPISODES)
        self.num_steps = self.stream.num_batches
        if cfg.train.max_steps is not None:
            self.num_steps = min(self.num_steps, cfg.train.max_steps)
        self.reward_fn = reward_function(cfg)
        kl = cfg.algo.kl
        self.kl_controller = (AdaptiveKLController(kl.init_coef, kl.target, kl.horizon) if kl.target
                              else FixedKLController(kl.init_coef))
        self.reward_normalizer = RunningRewardNormalizer()
        self.health = RolloutHealth(cfg.train.max_agent_failure_fraction, cfg.train.agent_failure_window_steps,
                                    cfg.data.max_len)

    def next_prompts(self) -> list[Prompt]:
        return self.stream.next_batch()

    def refill_prompts(self) -> list[Prompt]:
        """Prompts for a dynamic-filtering refill round (``rollout.dynamic_filtering_max_rounds``)."""
        return self.refill_stream.next_batch()

    def normalized_rewards(self, rewards: torch.Tensor) -> torch.Tensor:
        """(B,) sequence rewards -> the same after the running normaliser (updated with them first) when
        ``algo.normalize_reward`` is on; unchanged otherwise."""
        if not self.cfg.algo.normalize_reward:
            return rewards
        self.reward_normalizer.update(rewards)
        return self.reward_normalizer.normalize(rewards)

    def after_step(self, row: dict[str, Any]) -> None:
        if "kl" in row:
            self.kl_controller.update(row["kl"], int(row["num_samples"]))

    def checkpoint(self, step: int, buffers: Buffers | None = None) -> ControllerCheckpoint:
        """What a checkpoint at ``step`` keeps of this state: the prompt streams' positions, the KL controller and
        the reward statistics; ``buffers``: the trainer's objects beyond them (an asynchronous run's queue)."""
        return ControllerCheckpoint(step=step, stream=self.stream.state_dict(), kl=self.kl_controller.state_dict(),
                                    reward_norm=self.reward_normalizer.state_dict(),
                                    refill_stream=self.refill_stream.state_dict(), buffers=buffers)

    def restore(self, saved: ControllerCheckpoint) -> None:
        """Restore :meth:`checkpoint` (the buffers are the trainer's to restore)."""
        self.stream.load_state_dict(saved.stream)
        self.kl_controller.load_state_dict(saved.kl)
        self.reward_normalizer.load_state_dict(saved.reward_norm)
        if saved.refill_stream is not None:  # checkpoints written before refill existed lack it
            self.refill_stream.load_state_dict(saved.refill_stream)


def run_plan(cfg: RunConfig, num_steps: int, rank: int, is_controller: bool) -> RunPlan:
    """The run skeleton's schedules from the run config: saves every ``ckpt.save_steps`` and at the last step, evals
    (with ``eval.data``) every ``eval.steps`` and at start with ``eval.at_start``, rows every
    ``logger.logging_steps``; the progress bar on the controller."""
    return RunPlan(num_steps=num_steps, rank=rank, logging_steps=cfg.logger.logging_steps,
                   save_steps=cfg.ckpt.save_steps, save_last_step=True, evaluates=bool(cfg.eval.data),
                   eval_every=cfg.eval.steps, eval_at_start=bool(cfg.eval.data) and cfg.eval.at_start,
                   resume=cfg.ckpt.load, requeue=cfg.slurm.requeue, progress_bar=is_controller)


def reasoning_gym_prompts(cfg: RunConfig, tokenizer: Tokenizer) -> PromptDataset:
    """``data.reasoning_gym``: the task's questions, written once under ``<train.output_dir>/data`` and read like
    any prompt file (``data.input_template``, ``apply_chat_template``, ``max_samples`` apply)."""
    data, gym = cfg.data, cfg.data.reasoning_gym
    seed = cfg.train.seed if gym.seed is None else gym.seed
    if gym.task is None:
        raise SetupError("data.reasoning_gym.task is not set")
    path = write_prompt_file(gym.task, gym.size, seed, Path(cfg.train.output_dir) / "data")
    return PromptDataset([str(path)], input_key="question", label_key="label", input_template=data.input_template,
                         apply_chat_template=data.apply_chat_template, tokenizer=tokenizer,
                         max_samples=data.max_samples, seed=cfg.train.seed)


def reward_function(cfg: RunConfig) -> Any:
    """The reward function or remote server that scores on the controller (None: a model role or the agent).

    A ``.py`` path in ``reward.remote_url`` (OpenRLHF's ``--remote_rm_url /path/reward_func.py``) is read as a
    reward-function file, as OpenRLHF does; ``reward.reward_func_path`` is this project's key for it.
    """
    r = cfg.reward
    configure_run_sandbox(cfg.sandbox)  # before the reward file loads: a code reward builds its sandbox from it
    path = r.reward_func_path
    files = [u for u in r.remote_url if u.strip().lower().endswith(".py") and "://" not in u]
    if files:
        if len(r.remote_url) > 1:
            raise SetupError(f"reward.remote_url={r.remote_url} mixes a Python file with other entries: give the "
                             "reward function alone, as reward.reward_func_path=<file.py>")
        path = files[0]
        log.info("reward.remote_url=%s is a Python file: using it as the reward function (the key for it is "
                 "reward.reward_func_path)", path)
    if path:
        return RewardFunction(path, timeout_s=r.reward_func_timeout_s)
    if r.remote_url:
        return RemoteRewardModel(r.remote_url, timeout_s=r.remote_timeout_s, max_retries=r.remote_max_retries,
                                 api_key=os.environ.get(r.remote_api_key_env) or None)
    if cfg.data.reasoning_gym.task and not r.pretrain and not cfg.train.agent_func_path:
        return reasoning_gym_reward  # the task's own score_answer
    return None


@dataclass
class RolloutSide:
    engine: RolloutEngine
    executor: AgentExecutor
    rollout_cfg: RolloutConfig
    stop_token_ids: list[int]

    def sampling(self, seed: int) -> SamplingParams:
        return SamplingParams.from_rollout_config(self.rollout_cfg, self.stop_token_ids, seed=seed)


@dataclass
class Roles:
    """The engines this rank hosts (``None`` for roles it does not host)."""

    actor: TrainEngine | None = None
    critic: TrainEngine | None = None
    ref: FrozenEngine | None = None
    teacher: FrozenEngine | None = None
    reward: RewardModelRole | None = None
    rollout: RolloutSide | None = None
    need_old_logprobs: bool = True

    def trained_engines(self) -> dict[str, TrainEngine | None]:
        """The trained roles' engines by role name (``placement.TRAINED_ROLES``), for checkpoints."""
        return {"actor": self.actor, "critic": self.critic}


def rollout_shares_actor(cfg: RunConfig, world: WorldGroups) -> bool:
    """Whether this rank's rollout engine generates with the actor's own module instead of a copy.

    Colocated transformers rollout on a rank that trains the actor: same parameters, so no second model in
    memory and no per-step weight copy. Not under ZeRO-3 (parameters partitioned), AutoTP (sharded), LoRA
    (generation uses merged weights) or Liger kernels (patched forwards)."""
    return (cfg.train.colocate_all and cfg.rollout.backend == "transformers" and world.has_role("rollout")
            and world.has_role("actor") and cfg.ds.zero_stage != 3 and cfg.ds.tensor_parallel_size == 1
            and cfg.ds.lora.rank == 0 and not cfg.ds.use_liger_kernel)


def lora_sync_mode(cfg: RunConfig, announce: bool = False) -> str | None:
    """``ds.lora.sync`` resolved for this run's rollout engine: ``adapter`` (the engine keeps its base and takes the
    adapter alone) or ``merged``; None without LoRA. An explicit ``adapter`` the engine cannot take raises
    ``SetupError`` naming why; ``announce`` logs the decision (once, on the controller)."""
    lora = cfg.ds.lora
    if lora.rank == 0:
        return None
    # DeepSeek's routed experts count too (moe_spec leaves them out for routing statistics only).
    moe = actor_is_moe(cfg) or bool((local_hf_config(cfg.actor) or {}).get("n_routed_experts"))
    refusal = adapter_sync_refusal(
        backend=cfg.rollout.backend, load_in_4bit=lora.load_in_4bit, moe=moe,
        target_modules=lora.target_modules, vision_language=actor_is_vision_language(cfg),
        discards_weights_in_sleep=cfg.vllm.enable_sleep and cfg.vllm.sleep_level == 2 and torch.cuda.is_available())
    try:
        mode = resolve_lora_sync(lora.sync, refusal)
    except ValueError as err:
        raise SetupError(str(err)) from None
    if announce:
        why = f" ({refusal})" if mode == "merged" and lora.sync == "auto" else ""
        log.info("ds.lora.sync=%s: each weight sync sends the rollout engine %s%s", lora.sync,
                 "the LoRA adapter only" if mode == "adapter" else "the merged weights (W + scale * B @ A)", why)
    return mode


def vllm_engine_spec(cfg: RunConfig) -> VllmEngineSpec:
    """What a vLLM rollout engine takes from the run config."""
    return VllmEngineSpec(model_path=cfg.actor.pretrain, param_dtype=cfg.ds.param_dtype,
                          max_model_len=cfg.data.max_len or cfg.data.prompt_max_len + cfg.rollout.generate_max_len,
                          tensor_parallel_size=cfg.rollout.tensor_parallel_size, seed=cfg.train.seed, vllm=cfg.vllm,
                          return_routed_experts=cfg.algo.routing_replay == "rollout",
                          lora=cfg.ds.lora if lora_sync_mode(cfg) == "adapter" else None)


def weight_sync(cfg: RunConfig, world: WorldGroups) -> WeightSync | None:
    """The actor -> rollout weight sync of a layout whose rollout ranks are a subset of the world; None when
    colocated (weights load in-process, ``weight_sync.colocated``). Collective (it creates groups)."""
    if cfg.train.colocate_all:
        return None
    return build_weight_sync(cfg.rollout, world, adapter=lora_sync_mode(cfg) == "adapter")


def _rollout_engine(cfg: RunConfig, tokenizer: Tokenizer, on_gpu: bool, actor: TrainEngine | None = None,
                    rank: int = 0) -> RolloutEngine:
    """The rollout engine of this rank; with ``actor`` (:func:`rollout_shares_actor`) it runs on its module."""
    dtype = resolve_dtype(cfg.ds.param_dtype, on_gpu)
    kind = rollout_engine_kind(cfg.rollout, cfg.train.colocate_all)
    if kind == "vllm_server_process":
        engine = VllmServerEngine.from_spec(
            vllm_engine_spec(cfg), torch.cuda.current_device() if on_gpu else None,
            max_restarts=cfg.rollout.max_engine_restarts, timeout_s=cfg.rollout.engine_timeout_s,
            name=f"rank {rank}'s vLLM rollout engine (rollout.vllm_mode=server_process)")
        engine.faults.rank = rank
        return engine
    if kind == "vllm_external_launcher":
        return VllmRolloutEngine.from_spec(vllm_engine_spec(cfg))
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    record = records_routes(cfg)
    if actor is not None:
        # rollout_shares_actor: a plain HF model (no LoRA, no Liger) is what DeepSpeed wraps.
        return TransformersRolloutEngine(hf_model(actor), eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id, device=device, shares_trained_model=True,
                                         record_routes=record)
    model = load_causal_lm(model_path(cfg.actor.pretrain, "actor.pretrain"), dtype,
                           resolve_attn_implementation(cfg.ds.attn_implementation, on_gpu))
    to_device(model, device)
    model.train(False)  # eval mode (transformers leaves its ``eval`` override untyped)
    return TransformersRolloutEngine(model, eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.pad_token_id, device=device, record_routes=record,
                                     lora=cfg.ds.lora if lora_sync_mode(cfg) == "adapter" else None)


def check_agent_loads(cfg: RunConfig, tokenizer: Tokenizer, rank: int) -> None:
    """Collective: rank 0 loads the agent file once before any rank builds its executor, so a broken file is
    reported once, with its traceback, by rank 0; the other ranks exit with a one-line pointer to it."""
    if not cfg.train.agent_func_path:
        return
    error = None
    if rank == 0:
        try:
            _executor(cfg, tokenizer)
        except AgentLoadError as err:
            error = err
    box = [None if error is None else str(error).splitlines()[0]]
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0] is not None:
        raise SystemExit(f"rank {rank}: the agent file {cfg.train.agent_func_path} (train.agent_func_path) did not "
                         "load; rank 0 printed the error and its traceback")


def _executor(cfg: RunConfig, tokenizer: Tokenizer) -> AgentExecutor:
    """Single-turn by default; the user's agent file (multi-turn or OpenAI-client) when ``train.agent_func_path``
    is set."""
    if not cfg.train.agent_func_path:
        single = SingleTurnExecutor(tokenizer, cfg.data.prompt_max_len)
        single.vision = vision_encoder(cfg, tokenizer)
        return single
    configure_run_sandbox(cfg.sandbox)  # before the agent file loads: its code interpreter may build it
    executor = load_agent_executor(cfg.train.agent_func_path, tokenizer, cfg.data.prompt_max_len,
                                   max_len=cfg.data.max_len, max_turns=cfg.train.agent_max_turns,
                                   num_concurrent=cfg.rollout.async_num_tasks,
                                   step_timeout_s=cfg.train.agent_step_timeout_s,
                                   agent_kwargs=cfg.train.agent_kwargs,
                                   episode_timeout_s=cfg.train.agent_episode_timeout_s,
                                   tool_call_parser=cfg.rollout.tool_call_parser,
                                   reasoning_parser=cfg.rollout.reasoning_parser,
                                   endpoint_listen=cfg.rollout.agent_endpoint)
    # Multi-turn agents take the prompts' images and images in feedback (agents.images); an OpenAI-client agent
    # sends its images in its chat messages (base64 data URLs) and the endpoint encodes them.
    executor.vision = vision_encoder(cfg, tokenizer)
    if isinstance(executor, OpenAIAgentExecutor):  # the endpoint's caps on images and connections
        executor.limits = cfg.rollout.endpoint_limits
    if isinstance(executor, OpenAIAgentExecutor) and cfg.algo.routing_replay == "rollout":
        # Its rows are the chat calls' prompts and completions, re-tokenized per call: no engine routes reach them.
        raise SetupError(f"algo.routing_replay=rollout with train.agent_func_path={cfg.train.agent_func_path}: an "
                         "OpenAI-client agent's rows carry no recorded routes (single-turn and multi-turn agent "
                         "files do); set algo.routing_replay=measure or none")
    if isinstance(executor, OpenAIAgentExecutor) and cfg.rollout.tensor_parallel_size > 1:
        # Each engine rank would batch its own HTTP requests: tensor-parallel peers would not agree on the calls.
        raise SetupError(f"train.agent_func_path={cfg.train.agent_func_path} is an OpenAI-client agent, "
                         f"which needs rollout.tensor_parallel_size=1 (got {cfg.rollout.tensor_parallel_size})")
    return executor


def _rollout_side(cfg: RunConfig, world: WorldGroups, tokenizer: Tokenizer, on_gpu: bool,
                  actor: TrainEngine | None = None) -> RolloutSide:
    engine, executor = _rollout_engine(cfg, tokenizer, on_gpu, actor, world.rank), _executor(cfg, tokenizer)
    if isinstance(executor, OpenAIAgentExecutor):
        executor.context_len = engine.max_context_len  # an over-long agent call is its own 400, not the batch's
    side = RolloutSide(engine, executor, cfg.rollout, [eos_id(tokenizer)])
    # A rollout engine may seed the global RNGs itself, the same on every rank (vLLM's worker calls
    # set_random_seed(engine seed)): give each rank its own streams back, whatever the engine.
    seed_rank(cfg.train.seed, world.rank)
    return side


def build_roles(cfg: RunConfig, world: WorldGroups, tokenizer: Tokenizer, num_steps: int) -> Roles:
    """Create the engines of every role this rank hosts. Collective within each role group."""
    on_gpu = torch.cuda.is_available()
    check_vision_language(cfg, on_gpu)
    dtype = resolve_dtype(cfg.ds.param_dtype, on_gpu)
    attn = resolve_attn_implementation(cfg.ds.attn_implementation, on_gpu)
    liger = cfg.ds.use_liger_kernel  # training roles only; the rollout engine keeps plain modules
    # QLoRA: the trained roles and the reference load 4-bit base weights (the reference then equals the
    # initial policy exactly); the reward model and the rollout engine keep full precision.
    q4 = cfg.ds.lora.load_in_4bit
    samples = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    roles = Roles()
    # Before the first zero.Init (loading.import_model_code says why).
    import_model_code(*dict.fromkeys((cfg.actor.pretrain, cfg.critic.pretrain, cfg.ref.pretrain,
                                      cfg.teacher.pretrain, cfg.reward.pretrain)))
    share_actor = rollout_shares_actor(cfg, world)
    if world.has_role("rollout") and not share_actor:
        roles.rollout = _rollout_side(cfg, world, tokenizer, on_gpu)
    # Exactly on-policy (one epoch, one optimizer step per rollout): the current logprobs are the old ones,
    # so the extra actor forward is skipped - unless the KL to the reference must be known before training:
    # folded into the rewards, or measured for an adaptive KL controller. A KL loss with a fixed coefficient
    # (GRPO) needs no old logprobs: the actor computes it from the current ones (and logs it as ``kl``).
    kl_needs_old = "ref" in world.roles and (not cfg.algo.kl.use_loss or cfg.algo.kl.target is not None)
    roles.need_old_logprobs = not (cfg.train.max_epochs == 1 and samples == cfg.train.train_batch_size
                                   and not kl_needs_old)
    for role, role_cfg in (("actor", cfg.actor), ("critic", cfg.critic)):
        if role not in world.roles:
            continue
        dp = len(world.roles[role].dp_leaders)
        if cfg.train.train_batch_size % (dp * cfg.train.micro_train_batch_size):
            raise SetupError(f"train.train_batch_size={cfg.train.train_batch_size} must be a multiple of "
                             f"{role} data-parallel size {dp} x train.micro_train_batch_size="
                             f"{cfg.train.micro_train_batch_size}")
        if world.has_role(role):
            model_dir = model_path(role_cfg.pretrain or cfg.actor.pretrain, f"{role}.pretrain")
            head = cfg.critic.value_head_prefix
            factory = partial(load_causal_lm, model_dir, dtype, attn, liger, q4,
                              freeze_vision_tower=cfg.actor.freeze_vision_tower) if role == "actor" else \
                partial(load_value_model, model_dir, dtype, attn, liger, q4, value_head_prefix=head,
                        key="critic.value_head_prefix")
            # DeepSpeed counts every rank of its group (dp x sp) as a replica; sp peers share a micro-batch.
            engine = TrainEngine.create(
                factory, cfg.ds, role_cfg,
                train_batch_size=cfg.train.train_batch_size * cfg.ds.ring_attn_size,
                micro_train_batch_size=cfg.train.micro_train_batch_size,
                num_training_steps=optimizer_steps(cfg, num_steps), dp_group=world.roles[role].dp_sp_group,
                tp_group=world.roles[role].tp_group, on_gpu=on_gpu)
            if role == "actor":
                roles.actor = engine
            else:
                roles.critic = engine
    if share_actor:
        roles.rollout = _rollout_side(cfg, world, tokenizer, on_gpu, actor=roles.actor)
    for role, section in (("ref", cfg.ref), ("teacher", cfg.teacher)):
        if not world.has_role(role):
            continue
        # The reference is the initial policy (QLoRA: its 4-bit base, as the actor's); the teacher is its own
        # model, kept in full precision.
        path, quantized = (cfg.ref.pretrain or cfg.actor.pretrain, q4) if role == "ref" else (cfg.teacher.pretrain,
                                                                                             False)
        frozen = FrozenEngine.create(partial(load_causal_lm, model_path(path, f"{role}.pretrain"), dtype, attn, liger,
                                             quantized), cfg.ds,
                                     section, micro_batch_size=cfg.rollout.micro_rollout_batch_size,
                                     dp_group=world.roles[role].dp_sp_group, tp_group=world.roles[role].tp_group,
                                     on_gpu=on_gpu)
        if role == "ref":
            roles.ref = frozen
        else:
            roles.teacher = frozen
    if world.has_role("reward"):  # full precision under QLoRA too
        roles.reward = build_reward_model_role(cfg.reward, cfg.ds,
                                               micro_batch_size=cfg.rollout.micro_rollout_batch_size,
                                               dp_group=world.roles["reward"].dp_sp_group,
                                               tp_group=world.roles["reward"].tp_group, on_gpu=on_gpu)
    return roles
