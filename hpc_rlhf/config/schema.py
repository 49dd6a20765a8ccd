"""The typed config tree.

Every section forbids unknown keys, so a typo such as ``algo.kl.init_cof`` fails
before any model loads, naming the key. Names follow OpenRLHF's flags where one
exists (see ``docs/openrlhf_flags.md``). This module imports no torch.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from hpc_rlhf.config.rollout import RolloutConfig, VllmConfig
from hpc_rlhf.config.sandbox import SandboxConfig
from hpc_rlhf.config.section import Section
from hpc_rlhf.config.switched_off import refuse_switched_off

# train.output_access: who may read what a run writes (hpc_rlhf.utils.output_access)
OutputAccess = Literal["private", "group"]

AdvantageEstimator = Literal["gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo", "distill"]
GROUP_ESTIMATORS = ("reinforce_baseline", "rloo", "group_norm", "dr_grpo")


class ModelRole(Section):
    """A model hosted by a role group (actor, critic, ref, reward)."""

    pretrain: str | None = Field(None, description="local HF model folder (config.json + weights)")
    num_params_b: float | None = Field(
        None, gt=0, description="model size in billions of parameters, used by `plan` when no local config.json"
    )
    num_ranks: int | None = Field(
        None, ge=1, description="ranks of this role when not colocated (disaggregated placement)"
    )
    offload: bool = Field(False, description="keep parameters on CPU between uses (frozen roles)")

    def pretrain_path(self, key: str) -> str:
        """``pretrain`` where the run loads the model; ``key`` (``model.pretrain``, ``ref.pretrain``) names it."""
        if not self.pretrain:
            raise ValueError(f"{key} is required here: a local HF model folder")
        return self.pretrain


class TrainedRole(ModelRole):
    learning_rate: float = Field(1e-6, gt=0, description="peak learning rate of the cosine schedule (AdamW)")
    lr_warmup_ratio: float = Field(
        0.03, ge=0, le=1, description="fraction of the optimizer steps spent in linear warmup from 0 to the peak")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine schedule floor as a fraction of the peak LR")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (not on biases and norm weights)")
    adam_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW (beta1, beta2)")
    max_norm: float = Field(1.0, gt=0, description="gradient clipping norm")


class ActorConfig(TrainedRole):
    build_tiny: Literal["qwen3_moe", "mixtral", "tools", "margin", "qwen2_5_vl", "qwen3_vl"] | bool = Field(
        False, description="create a tiny char-level model at actor.pretrain if missing (CPU recipes, tests): true "
        "a Llama, margin the Llama drawn with std 0.1 (greedy answers get a logit margin), tools a Llama whose "
        "tokenizer has one tool-call token (hpc_rlhf.models.tiny.TOOL_CALL_TOKEN), "
        "qwen3_moe / mixtral a mixture-of-experts model (4 experts, top-2), qwen2_5_vl / qwen3_vl a "
        "vision-language model with a 2-block vision tower (hpc_rlhf.models.tiny_vlm)"
    )
    freeze_vision_tower: bool = Field(
        False, description="vision-language models: train the language model and the vision-to-text projector only; "
        "the vision encoder's blocks and patch embedding keep their weights (hpc_rlhf.models.vision)")


class CriticConfig(TrainedRole):
    learning_rate: float = Field(9e-6, gt=0, description="peak learning rate of the critic's cosine schedule (AdamW)")
    value_head_prefix: str = Field(
        "score", description="checkpoint name of the value head (OpenRLHF: value_head); fresh head when absent")


class RefConfig(ModelRole):
    pass


class TeacherConfig(ModelRole):
    """The frozen teacher of on-policy distillation (``algo.distill_coef``): it scores every token the student
    samples. Placed like the reference model (every rank when colocated; ``teacher.num_ranks`` of its own, or the
    actor's ranks with ``train.colocate_actor_ref``); ZeRO-3 / AutoTP / ``teacher.offload`` as the reference."""

    pretrain: str | None = Field(
        None, description="local HF model folder of the teacher; its tokenizer must be the actor's. Set: the "
        "teacher role runs and its per-token advantage is added (algo.distill_coef)")


class RewardConfig(ModelRole):
    value_head_prefix: str = Field("score", description="checkpoint name of the reward model's value head")
    reward_func_path: str | None = Field(None, description="Python file defining reward_func(queries, prompts, labels)")
    remote_url: list[str] = Field(default_factory=list, description="OpenRLHF /get_reward servers")
    remote_timeout_s: float = Field(
        60.0, gt=0, description="seconds one request to a reward.remote_url server may take before it is retried")
    remote_max_retries: int = Field(
        3, ge=0,
        description="retries of a failed reward.remote_url request (with backoff) before the step fails, naming the "
        "server")
    remote_api_key_env: str = Field(
        "HPC_RLHF_RM_API_KEY", min_length=1, description="environment variable holding the servers' API key, sent "
        "as 'Authorization: Bearer <key>' when set (the key itself is never in the config, so never in "
        "config.resolved.yaml or the logs)")
    reward_func_timeout_s: float | None = Field(
        300.0, gt=0, description="limit for one reward_func call (run in a worker thread); null: no limit, "
        "called in the main thread (for functions that use signal.alarm)")
    normalize: bool = Field(
        False, description="reward model: (score - reward_mean) / reward_std from its config.json (OpenRLHF's "
        "--normalize_reward)")


class LoraConfig(Section):
    rank: int = Field(0, ge=0, description="0 disables LoRA")
    alpha: int = Field(16, ge=1, description="LoRA scaling numerator: adapters are scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA branch")
    target_modules: list[str] = Field(
        default_factory=lambda: ["all-linear"],
        description="module names (or all-linear) that get adapters; peft's target_modules")
    load_in_4bit: bool = Field(
        False, description="QLoRA: the frozen base in 4-bit NF4 (bitsandbytes); ZeRO 0-2, no tensor parallelism")
    sync: Literal["auto", "adapter", "merged"] = Field(
        "auto",
        description="what each weight sync sends the rollout engine: adapter (the rollout engine keeps the base it "
        "loaded and receives only the LoRA factors, applied to every request: peft in the transformers engine, "
        "vLLM's LoRA support in vLLM), merged (W + scale * B @ A for every weight, the whole model); auto: adapter "
        "where the engine supports it (not with QLoRA, nor on vLLM with adapted MoE experts / router or a "
        "vision-language model), else merged, decided at start-up and logged")

    @model_validator(mode="after")
    def _adapter_sync(self) -> LoraConfig:
        """An explicit adapter sync needs adapters, and an engine base equal to the one the adapters train on."""
        if self.sync != "adapter":
            return self
        if self.rank == 0:
            raise ValueError("ds.lora.sync=adapter needs ds.lora.rank > 0 (no adapter to sync); set ds.lora.rank, or "
                             "leave ds.lora.sync=auto")
        if self.load_in_4bit:
            raise ValueError("ds.lora.sync=adapter with ds.lora.load_in_4bit=true: the rollout engine keeps a full "
                             "precision base, while the adapter trains on the dequantised 4-bit one, so the engine "
                             "would sample from another policy; set ds.lora.sync=merged (or auto)")
        return self


def resolved_param_dtype(param_dtype: str, on_gpu: bool) -> str:
    """``auto`` is ``bf16`` on GPU and ``fp32`` on CPU (bf16 matmul is ~500x slower on our CPUs)."""
    if param_dtype == "auto":
        return "bf16" if on_gpu else "fp32"
    return param_dtype


class DeepSpeedConfig(Section):
    zero_stage: Literal[0, 1, 2, 3] = Field(
        2,
        description="DeepSpeed ZeRO stage of the trained roles (3 shards weights too; only with train.colocate_all); "
        "a trained role in bf16 runs stages 0-2 as 2, fp32 on one replica runs 1-2 as 0 (plan prints the stage "
        "that runs)")
    adam_offload: bool = Field(
        False, description="ZeRO-Offload: Adam states and steps on the host (DeepSpeedCPUAdam); needs ZeRO stage >= 1")
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in the backward (less memory, about a third more compute)")
    param_dtype: Literal["auto", "bf16", "fp32"] = Field("auto", description="auto: bf16 on GPU, fp32 on CPU")
    tensor_parallel_size: int = Field(
        1, ge=1, description="DeepSpeed AutoTP: ranks that split each layer of a trained or frozen model")
    ring_attn_size: int = Field(
        1, ge=1,
        description="sequence parallelism: ranks that split each sequence, joined by ring attention (ring-flash-attn "
        "on GPU)")
    ring_head_stride: int = Field(
        1, ge=1, description="ring attention: heads processed per ring pass (ring-flash-attn's head stride)")
    attn_implementation: Literal["auto", "eager", "sdpa", "flash_attention_2", "flash_attention_3"] = Field(
        "auto",
        description="attention kernel of the trained and frozen models: auto (flash_attention_2 when installed on "
        "GPU, else "
        "sdpa), sdpa, eager, flash_attention_2, flash_attention_3")
    use_liger_kernel: bool = Field(
        False,
        description="Liger Triton kernels in the trained and frozen models on GPU, when liger-kernel is installed")
    lora: LoraConfig = Field(default_factory=LoraConfig)

    @model_validator(mode="after")
    def _qlora_layout(self) -> DeepSpeedConfig:
        """QLoRA's 4-bit weights are bitsandbytes tensors that neither ZeRO-3 nor AutoTP can partition."""
        if not self.lora.load_in_4bit:
            return self
        if self.lora.rank == 0:
            raise ValueError("ds.lora.load_in_4bit=true needs ds.lora.rank > 0: only LoRA adapters train on a "
                             "4-bit base")
        if self.zero_stage == 3:
            raise ValueError("ds.lora.load_in_4bit=true with ds.zero_stage=3: ZeRO-3 cannot partition 4-bit "
                             "weights; use ds.zero_stage 2 (the frozen 4-bit base is replicated, a quarter of bf16)")
        if self.tensor_parallel_size > 1:
            raise ValueError("ds.lora.load_in_4bit=true with ds.tensor_parallel_size > 1: AutoTP cannot shard "
                             "4-bit weights; use ds.tensor_parallel_size 1")
        return self


class KLConfig(Section):
    init_coef: float = Field(0.0, ge=0, description="0 disables the reference model")
    estimator: Literal["k1", "k2", "k3"] = Field(
        "k1",
        description="KL estimator to the reference: k1 (log ratio), k2 (half squared log ratio), k3 (Schulman's "
        "unbiased, "
        "non-negative)")
    use_loss: bool = Field(False, description="KL as a loss term (GRPO style) instead of folded into rewards")
    target: float | None = Field(None, gt=0, description="adaptive KL controller target; None = fixed")
    horizon: int = Field(
        10000, ge=1, description="adaptive KL controller (with kl.target): steps over which the coefficient adapts")


class AlgoConfig(Section):
    advantage_estimator: AdvantageEstimator = Field(
        "group_norm",
        description="gae (PPO with a critic), reinforce (REINFORCE++), reinforce_baseline, rloo, group_norm (GRPO), "
        "dr_grpo, "
        "distill (on-policy distillation from teacher.pretrain)")
    gamma: float = Field(1.0, ge=0, le=1, description="discount factor of the returns (group estimators need 1)")
    lambd: float = Field(1.0, ge=0, le=1, description="GAE lambda")
    kl: KLConfig = Field(default_factory=KLConfig)
    eps_clip_low: float = Field(0.2, gt=0, description="lower clip of the importance ratio, 1 - eps (ppo, gspo, cispo)")
    eps_clip_high: float = Field(
        0.2, gt=0,
        description="upper clip of the importance ratio, 1 + eps; above eps_clip_low it is DAPO's clip-higher")
    dual_clip: float | None = Field(
        None, gt=1, description="dual clip c > 1: caps the loss of negative-advantage tokens at -c A (ppo, gspo)")
    value_clip: float | None = Field(
        0.5, gt=0, description="PPO value clipping of the critic around its rollout-time values (null: off)")
    policy_loss_type: Literal["ppo", "gspo", "cispo", "sapo"] = Field(
        "ppo", description="ppo: clipped token ratio (OpenRLHF's default); gspo: sequence ratio (arXiv:2507.18071); "
        "cispo: REINFORCE weighted by the stop-gradient clipped ratio, clipped tokens keep their gradient "
        "(MiniMax-M1, arXiv:2506.13585; the band is algo.eps_clip_low/high, MiniMax keeps no lower bound: "
        "eps_clip_low >= 1); sapo: a smooth temperature-gated trust region instead of the clip (arXiv:2511.20347; "
        "algo.sapo_tau_pos/neg)")
    sapo_tau_pos: float = Field(1.0, gt=0, description="policy_loss_type=sapo: gate temperature where the advantage "
                                "is positive (paper: 1.0); larger fades off-policy tokens faster")
    sapo_tau_neg: float = Field(1.05, gt=0, description="policy_loss_type=sapo: gate temperature where the "
                                "advantage is zero or negative (paper: 1.05, above sapo_tau_pos)")
    loss_agg_mode: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                           "seq_mean_token_sum_norm"] | None = Field(
        None,
        description="how per-token losses become one number: token_mean (over all tokens), seq_mean_token_mean, "
        "seq_mean_token_sum, seq_mean_token_sum_norm (Dr. GRPO); null: the policy loss's own choice, "
        "seq_mean_token_mean for sapo (its paper, veRL and TRL average per sequence), token_mean for the others")
    entropy_loss_coef: float = Field(
        0.0, ge=0, description="weight of an entropy bonus in the actor loss (0: entropy only logged)")
    aux_loss_coef: float = Field(
        0.0, ge=0, description="weight of a mixture-of-experts actor's router load-balancing loss (Switch "
        "Transformer; transformers' load_balancing_loss_func) in the actor loss; > 0 needs an MoE actor")
    routing_replay: Literal["none", "measure", "rollout"] = Field(
        "measure", description="mixture-of-experts actors: 'rollout' replays the experts the rollout engine routed "
        "each token to in the actor's forwards (R3, arXiv:2510.11370; gate weights from the current router); "
        "'measure' records them and logs moe/route_mismatch, the fraction of action tokens the trainer routes "
        "differently, without replaying; 'none' records nothing. Routes are recorded by rollout.backend=transformers "
        "(single-turn and multi-turn agent rollouts; not OpenAI-client agents), and for 'rollout' by vLLM on a GPU "
        "(enable_return_routed_experts); no effect on dense actors")
    distill_coef: float = Field(
        1.0, gt=0, description="with teacher.pretrain: weight of the per-token distillation advantage "
        "log p_teacher(y_t) - log p_student(y_t); advantage_estimator=distill trains on it alone, any other "
        "estimator adds it to the task reward's advantage")
    no_advantage_std_norm: bool = Field(
        False, description="group estimators: subtract the group mean without dividing by the group's std (Dr. GRPO)")
    reward_clip_range: tuple[float, float] | None = Field(
        None, description="clamp on the sequence rewards after group shaping (OpenRLHF's order)")
    normalize_reward: bool = Field(False, description="running mean/std normalisation of the rewards")
    is_correction: Literal["none", "tis", "icepop", "seq_mask_tis"] = Field(
        "none",
        description="rollout-vs-trainer mismatch correction with the engine's log-probs: none, tis (truncated "
        "importance "
        "sampling), icepop (mask tokens outside the band), seq_mask_tis (a sequence weight, masked outside the band)")
    is_truncation: tuple[float, float] = Field(
        (0.5, 2.0), description="algo.is_correction: the [low, high] band of the rollout importance weight")
    dynamic_filtering: bool = Field(
        False, description="DAPO dynamic sampling: drop prompt groups whose mean reward is outside the open interval "
        "algo.dynamic_filtering_reward_range (all solved or all failed)")
    dynamic_filtering_reward_range: tuple[float, float] = Field(
        (0.0, 1.0),
        description="algo.dynamic_filtering: a group is kept when its mean reward lies strictly inside (low, high)")
    overlong_buffer_len: int | None = Field(
        None, ge=1,
        description="DAPO overlong penalty: the last N tokens before rollout.generate_max_len where the reward is "
        "reduced linearly")
    overlong_penalty_factor: float = Field(
        1.0, ge=0, description="DAPO overlong penalty: reward subtracted at the length limit")

    @model_validator(mode="after")
    def _loss_options(self) -> AlgoConfig:
        if self.dual_clip is not None and self.policy_loss_type in ("cispo", "sapo"):
            raise ValueError(f"algo.dual_clip applies to the ppo and gspo losses, not to "
                             f"algo.policy_loss_type={self.policy_loss_type}: unset algo.dual_clip")
        return self

    @property
    def needs_critic(self) -> bool:
        return self.advantage_estimator == "gae"

    @property
    def agg_mode(self) -> str:
        """``loss_agg_mode``, or the policy loss's own when it is unset: SAPO's paper (arXiv:2511.20347, eq. 5),
        veRL and TRL average each sequence's tokens, then the sequences; every other loss here a token mean."""
        if self.loss_agg_mode is not None:
            return self.loss_agg_mode
        return "seq_mean_token_mean" if self.policy_loss_type == "sapo" else "token_mean"

    @property
    def needs_ref(self) -> bool:
        return self.kl.init_coef > 0


class StallLimits(Section):
    """Bounds on a hang, shared by the RL and offline trainers (``hpc_rlhf.resilience.stall_limits``,
    docs/reliability.md).

    A step may take ``max(watchdog_timeout_s, watchdog_step_factor x`` the slowest step so far``)``; the first step
    (compilation, engine start-up) and checkpoint saves / loads have their own allowances. The same bound is the
    collective timeout of every process group while the phase runs; ``collective_timeout_s`` covers start-up.
    """

    collective_timeout_s: int = Field(
        1800, ge=1, description="collective timeout during start-up (init, model loading); steps and checkpoints use "
        "the phase bounds below")
    watchdog_timeout_s: float | None = Field(
        60.0, ge=0, description="floor of a step's time limit; a rank silent for longer dumps its stacks to "
        "<output_dir>/hang/ and the job exits with status 124. 0 or null: no watchdog, fixed collective timeout")
    watchdog_step_factor: float = Field(
        4.0, ge=1, description="a step may take this many times the slowest step so far")
    watchdog_first_step_s: float = Field(
        1800.0, gt=0, description="limit of the first step after (re)start (compilation, engine warm-up) and of "
        "each evaluation")
    watchdog_checkpoint_s: float = Field(
        1800.0, gt=0, description="limit of one checkpoint save or load, and of the final HF export")


class TrainConfig(StallLimits):
    output_dir: str = Field(
        "runs/default",
        description="run folder: metrics.jsonl, checkpoints (ckpt/), exports (model/, hf/), resolved config")
    output_access: OutputAccess = Field(
        "private", description="who may read what the run writes (checkpoints, exports, metrics, rollout dumps): "
        "private: this user only (files 0600, folders 0700); group: the user's group may read too (0640 / 0750). "
        "Set as every rank's umask at start-up, so the processes a rank starts follow it")
    seed: int = Field(
        42, description="seed of data order, sampling and initialisation (checkpoints keep every RNG state)")
    max_epochs: int = Field(1, ge=1, description="PPO epochs over each rollout batch")
    num_episodes: int = Field(1, ge=1, description="passes over the prompt data")
    max_steps: int | None = Field(None, ge=1, description="RL steps (rollout + update) to run")
    train_batch_size: int = Field(
        8, ge=1, description="samples (episodes) per optimizer step (global); a branching OpenAI-client agent's "
        "episode counts once and brings all its rows")
    micro_train_batch_size: int = Field(4, ge=1, description="rows per forward/backward per rank")
    colocate_all: bool = Field(True, description="every rank hosts every enabled role (hybrid engine)")
    colocate_actor_ref: bool = Field(
        False, description="the frozen models (reference, and the teacher of on-policy distillation) share the "
        "actor's ranks instead of ranks of their own")
    colocate_critic_reward: bool = Field(
        False, description="disaggregated layouts: the critic and the reward model share their ranks")
    packing_samples: bool = Field(
        False, description="pack the rows of a micro-batch into one sequence without padding (block-causal attention)")
    use_dynamic_batch: bool = Field(
        False, description="micro-batches by token budget (train.max_tokens_per_gpu) instead of a row count")
    max_tokens_per_gpu: int | None = Field(
        None, ge=1, description="use_dynamic_batch: tokens per GPU in a micro-batch (x ds.ring_attn_size per ring)")
    agent_func_path: str | None = Field(
        None, description="Python file with AgentInstance / AgentExecutor, or an OpenAI-client agent's "
        "`async def run_episode(client, prompt, label)` or workflow class with `async def arun_episode(self, client, "
        "data)`")
    agent_max_turns: int = Field(8, ge=1, description="agents: turns per episode before it is ended")
    agent_step_timeout_s: float = Field(
        300.0, gt=0,
        description="agents: seconds one AgentInstance.step may take before the episode is ended as failed")
    agent_episode_timeout_s: float = Field(
        600.0, gt=0, description="OpenAI-client agents: wall time limit of one episode")
    agent_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments for AgentInstance(...) and reset(...), run_episode(...) "
        "or the workflow class's constructor (the names each accepts)")
    max_agent_failure_fraction: float = Field(
        0.5, ge=0, le=1, description="stop when more agent episodes than this fail over agent_failure_window_steps")
    agent_failure_window_steps: int = Field(5, ge=1, description="steps the failure fraction is measured over")
    async_train: bool = Field(
        False,
        description="asynchronous RL: rollouts of the next steps are generated while the actor trains (disaggregated "
        "layout)")
    async_queue_size: int = Field(
        1, ge=1,
        description="train.async_train: batches generated ahead of training (each up to that many policy versions old)")
    max_staleness: int = Field(1, ge=0, description="policy versions a trained sample may lag behind")
    staleness_policy: Literal["wait", "drop"] = Field(
        "wait", description="wait: generate at most max_staleness batches ahead; drop: drop older samples"
    )
    partial_rollout: bool = Field(
        False,
        description="train.async_train: weight updates land while generation runs; unfinished responses continue "
        "under the new "
        "weights, each token keeping its version")


class ReasoningGymConfig(Section):
    task: str | None = Field(
        None, description="a reasoning-gym task (countdown, basic_arithmetic, chain_sum, ...): its generated questions "
        "are the prompts and its score_answer the reward (extra `tasks`); null: off")
    size: int = Field(1000, ge=1, description="task instances generated")
    seed: int | None = Field(None, description="generator seed; default train.seed")


class DataConfig(Section):
    prompt_data: list[str] = Field(default_factory=list, description="files or save_to_disk folders")
    prompt_data_probs: list[float] | None = Field(None, description="mixture weights, one per data.prompt_data source")
    input_key: str = Field("input", description="column of the prompt (text or chat messages)")
    label_key: str | None = Field(
        None, description="column passed to the reward function as the label (reference answer)")
    input_template: str | None = Field(None, description="format string with one {} where the prompt goes")
    apply_chat_template: bool = Field(
        False, description="wrap prompts in the tokenizer's chat template (with the generation prompt)")
    max_samples: int | None = Field(None, ge=1, description="use at most this many prompts (after mixing)")
    prompt_max_len: int = Field(1024, ge=1, description="prompt tokens kept (longer prompts are left-truncated)")
    max_len: int | None = Field(None, ge=1, description="prompt + response token budget")
    skip_bad_rows: bool = Field(
        False,
        description="skip and count rows that fail validation instead of stopping with an error naming the file and "
        "row")
    images_key: str = Field(
        "images", description="column holding a prompt row's images (paths relative to the data file, file:// or "
        "base64 data URLs, HF datasets.Image values); image content parts in chat messages are read too")
    min_pixels: int | None = Field(
        None, ge=1, description="vision-language models: smallest image area in pixels; smaller images are scaled "
        "up by the model's image processor (null: the processor's own setting)")
    max_pixels: int | None = Field(
        None, ge=1, description="vision-language models: largest image area in pixels; larger images are scaled "
        "down by the model's image processor, which bounds each image's tokens at max_pixels / (patch * merge)^2 "
        "(null: the processor's own setting)")
    synthetic_task: Literal["arithmetic", "colour", "code"] | None = Field(
        None, description="write a seeded task to data.prompt_data[0] if that file is missing (CPU recipes); colour "
        "and code also write their held-out split to eval.data[0]"
    )
    synthetic_num_samples: int = Field(512, ge=1, description="data.synthetic_task: prompts written")
    reasoning_gym: ReasoningGymConfig = Field(default_factory=ReasoningGymConfig)

    @model_validator(mode="after")
    def _probs_match_data(self) -> DataConfig:
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ValueError(f"data.min_pixels={self.min_pixels} is larger than data.max_pixels={self.max_pixels}")
        if self.reasoning_gym.task and self.prompt_data:
            raise ValueError(f"data.reasoning_gym.task={self.reasoning_gym.task} generates the prompts: leave "
                             f"data.prompt_data empty (got {self.prompt_data})")
        if self.prompt_data_probs is not None and len(self.prompt_data_probs) != len(self.prompt_data):
            raise ValueError(
                f"data.prompt_data_probs has {len(self.prompt_data_probs)} entries but data.prompt_data "
                f"has {len(self.prompt_data)}; give one probability per dataset"
            )
        return self


class EvalConfig(Section):
    data: list[str] = Field(
        default_factory=list, description="held-out prompt files or save_to_disk folders (data.input_key / "
        "label_key / templates apply); one data source per file, or per value of a `data_source` column")
    steps: int | None = Field(
        None, ge=1, description="evaluate every N steps and after the last one; null with eval.data: the last only")
    n_samples_per_prompt: int = Field(1, ge=1, description="samples per eval prompt (pass@k for k = 1, 2, 4, ... <= n)")
    temperature: float = Field(0.0, ge=0, description="eval sampling temperature; 0 is greedy")
    max_samples: int | None = Field(None, ge=1, description="at most this many prompts from each eval.data entry")
    at_start: bool = Field(False, description="also evaluate the initial weights before the first step (logged as "
                           "step 0; not on resume)")
    pass_threshold: float = Field(
        1.0, description="a sample counts as correct for pass@k when its score (the reward's `scores`) is >= this")


class CkptConfig(Section):
    path: str | None = Field(None, description="default: <train.output_dir>/ckpt")
    save_steps: int | None = Field(
        None, ge=1, description="checkpoint every N steps (null: only when stopped by a signal and at the end)")
    max_num: int = Field(3, ge=1, description="checkpoints kept; also HF exports kept (ckpt.save_hf), besides the best")
    load: bool = Field(
        False, description="resume from the newest checkpoint that verifies (start fresh when there is none)")
    save_hf: bool = Field(
        False, description="at each checkpoint, also export the actor in HF format to <train.output_dir>/hf/step_<N>")
    save_critic_hf: bool = Field(False, description="ckpt.save_hf: export the critic too, to hf/step_<N>/critic")
    best_metric: str | None = Field(
        None, description="ckpt.save_hf: a metrics key (e.g. eval/all/pass@1); hf/BEST names the export where it "
        "was best, and rotation keeps that export")
    best_mode: Literal["max", "min"] = Field("max", description="ckpt.best_metric: whether higher or lower is better")


class LoggerConfig(Section):
    logging_steps: int = Field(1, ge=1, description="log metrics every N steps")
    use_tensorboard: bool = Field(True, description="write TensorBoard events to <train.output_dir>/tensorboard")
    use_wandb: bool = Field(False, description="log to Weights & Biases (the wandb extra)")
    wandb_project: str = Field("hpc-rlhf", description="Weights & Biases project")
    wandb_run_name: str | None = Field(
        None, description="Weights & Biases run name (default: the output folder's name)")
    dump_rollouts_every: int | None = Field(
        None, ge=1, description="every N steps, write the step's samples to <train.output_dir>/rollouts/step_<N>.jsonl")


class SlurmConfig(Section):
    partition: str | None = Field(None, description="sbatch --partition (hpc-rlhf submit)")
    time: str = Field(
        "04:00:00", description="sbatch --time; the run checkpoints before it runs out (slurm.signal_grace_s)")
    nodes: int = Field(1, ge=1, description="sbatch --nodes")
    gpus_per_node: int = Field(8, ge=0, description="GPUs (ranks) per node")
    cpus_per_task: int | None = Field(None, ge=1, description="sbatch --cpus-per-task (per rank)")
    account: str | None = Field(None, description="sbatch --account")
    signal_grace_s: int = Field(300, ge=1, description="warning signal this many seconds before the time limit")
    requeue: bool = Field(
        True,
        description="after a stop by SLURM's time-limit or preemption signal, rank 0 requeues the job, which resumes "
        "from the "
        "checkpoint")


class RunConfig(Section):
    """The whole run. Sections are named as users address them on the command line."""

    actor: ActorConfig = Field(default_factory=ActorConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    ref: RefConfig = Field(default_factory=RefConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    ds: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    ckpt: CkptConfig = Field(default_factory=CkptConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    slurm: SlurmConfig = Field(default_factory=SlurmConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)

    @model_validator(mode="after")
    def _cross_section_rules(self) -> RunConfig:
        refuse_switched_off(self)  # a key that another key switched off and that can only be a mistake
        groups = self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt
        if groups % self.train.train_batch_size != 0:
            raise ValueError(
                f"rollout.rollout_batch_size x rollout.n_samples_per_prompt = {groups} samples per step "
                f"must be a multiple of train.train_batch_size = {self.train.train_batch_size}"
            )
        if self.algo.advantage_estimator in GROUP_ESTIMATORS and self.rollout.n_samples_per_prompt < 2:
            raise ValueError(
                f"algo.advantage_estimator={self.algo.advantage_estimator} needs a group per prompt: "
                "set rollout.n_samples_per_prompt >= 2"
            )
        if self.algo.advantage_estimator in GROUP_ESTIMATORS and self.algo.gamma != 1.0:
            raise ValueError(
                f"algo.advantage_estimator={self.algo.advantage_estimator} needs algo.gamma=1 (its baseline is a "
                f"sequence-level group reward; OpenRLHF forces gamma to 1 for it), got {self.algo.gamma}"
            )
        if self.reward.normalize and not self.needs_reward_model:
            raise ValueError(
                "reward.normalize=true applies the reward model's reward_mean / reward_std and needs reward.pretrain "
                "as the scorer (no reward.remote_url or reward.reward_func_path; a remote server normalises with "
                "serve_rm --normalize)"
            )
        if self.vllm.sleep_level == 2 and (self.eval.data or self.algo.dynamic_filtering):
            raise ValueError(
                "vllm.sleep_level=2 discards vLLM's weights on sleep, so only a weight sync may follow a wake; "
                "eval.data and algo.dynamic_filtering generate again before the next sync: use vllm.sleep_level=1"
            )
        if self.train.async_train and self.train.colocate_all:
            raise ValueError(
                "train.async_train=true needs a disaggregated layout (rollout overlaps training); "
                "set train.colocate_all=false and give each role its num_ranks"
            )
        if self.train.use_dynamic_batch and self.train.max_tokens_per_gpu is None:
            raise ValueError("train.use_dynamic_batch=true needs train.max_tokens_per_gpu (tokens per micro-batch "
                             "per rank; rollout.max_tokens_per_gpu for the experience forwards defaults to it)")
        if (self.ckpt.best_metric or self.ckpt.save_critic_hf) and not self.ckpt.save_hf:
            key = "ckpt.best_metric" if self.ckpt.best_metric else "ckpt.save_critic_hf"
            raise ValueError(f"{key} applies to the HF exports: set ckpt.save_hf=true too")
        if self.ckpt.save_critic_hf and not self.algo.needs_critic:
            raise ValueError("ckpt.save_critic_hf=true but the run has no critic (algo.advantage_estimator="
                             f"{self.algo.advantage_estimator}; only gae trains one)")
        if self.reward.remote_url and self.reward.reward_func_path:
            raise ValueError("set only one of reward.remote_url and reward.reward_func_path")
        if self.algo.advantage_estimator == "distill" and not self.needs_teacher:
            raise ValueError("algo.advantage_estimator=distill trains on the teacher's per-token scores: set "
                             "teacher.pretrain to the teacher's model folder")
        return self

    @property
    def needs_teacher(self) -> bool:
        """On-policy distillation: a teacher role scores the sampled tokens."""
        return self.teacher.pretrain is not None

    @property
    def needs_reward_model(self) -> bool:
        """A reward-model role gets ranks only when no function or remote server scores."""
        r = self.reward
        return r.pretrain is not None and not r.remote_url and r.reward_func_path is None
