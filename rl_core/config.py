"""The run's configuration: every key, its type and its one default, as dataclasses (OmegaConf structured configs).

Key names follow verl 0.9 (``verl/trainer/config/ppo_trainer.yaml``) wherever verl has the concept, so a verl user's
override strings carry over. This module is the only place a default lives (the agent loops' keys,
``actor_rollout_ref.rollout.multi_turn`` and ``.agent``, in :mod:`rl_core.agent.settings`, beside the loops): Hydra
composes ``configs/ppo_trainer.yaml`` on top of :class:`PPOTrainerConfig`, workers and the flow read the composed
values and never fall back to a default of their own. The defaults are verl 0.9's (a user's own model gets verl's
learning rates, clip ratios, lengths and batch sizes); the few deliberate differences are listed in
``tests/config/test_verl_defaults.py`` and the README. With no ``actor_rollout_ref.model.path`` the embedded demo runs
instead (the synthetic addition task on a tiny Qwen2 model, GRPO, all on CPU), with the values of the demo profile
``configs/profile/demo.yaml`` applied under the user's overrides (:func:`flows.config.compose_config`).

OmegaConf enforces the types (``data.train_batch_size=many`` is refused) and the key set (a misspelt key is
refused; there is no free-form key except the ``dict`` fields). ``"${...}"`` defaults interpolate another key.
Values that a type cannot express (choices, ranges, divisibility) are checked by
:func:`rl_core.config_checks.check_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rl_core.agent.settings import AgentConfig, MultiTurnConfig
from rl_core.rollout_schedule import agent_batching

if TYPE_CHECKING:
    from omegaconf import DictConfig


# the resolvers the defaults below call (``"${name:${a.b}}"``): flows.config registers them with OmegaConf,
# bench/gpu_check.py applies them without it
RESOLVERS = {"agent_batching": agent_batching}
DEVICES = ("auto", "cpu", "cuda")
# a compute dtype's names -> torch's name for it (auto: bf16 on CUDA, float32 on the CPU: rl_core.device)
COMPUTE_DTYPE_NAMES = {
    "auto": None,
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


# ---------------------------------------------------------------------------------------------- data
@dataclass
class SyntheticDataConfig:
    """The demo task (``data.train_files=null``, :mod:`rl_core.data.synthetic`): ``addition`` (``a+b=`` prompts with
    operands up to ``max_operand``) or ``calc`` (``a*b=`` with 2-digit operands, answered with the calculator tool: a
    multi-turn rollout; its profile is ``configs/profile/demo_calc.yaml``) or ``shapes`` (an image of coloured shapes:
    which colour is the largest? A tiny vision-language model; ``configs/profile/demo_shapes.yaml``)."""

    task: str = "addition"
    train_size: int = 2000
    val_size: int = 200
    max_operand: int = 9  # addition only


@dataclass
class DataConfig:
    train_files: Any = None  # a parquet/jsonl path or a list of them (verl's format); null = the synthetic demo task
    val_files: Any = None
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024  # prompts per step (each gets actor_rollout_ref.rollout.n responses)
    val_batch_size: int | None = None  # null = the whole validation set at once
    train_max_samples: int = -1  # -1 = all rows
    val_max_samples: int = -1
    shuffle: bool = True
    seed: int = 1  # the sampler's shuffling seed (verl: null = unseeded; here runs repeat and resume exactly)
    filter_overlong_prompts: bool = False
    truncation: str = "error"  # error | left | right: a prompt longer than max_prompt_length (when not filtered)
    use_chat_template: bool = True  # false (or a tokenizer without a template): prompts are tokenized as raw text
    image_key: str = "images"  # a vision-language run's image column (rl_core.data.images)
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)


# ---------------------------------------------------------------------------------------------- models and optimizers
@dataclass
class OptimConfig:
    """AdamW and the LR schedule (see rl_core.models.optim)."""

    lr: float = 1.0e-6  # the actor's; the critic's default is 1e-5 (CriticConfig.optim)
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps_ratio: float = 0.0
    lr_warmup_steps: int = -1  # >= 0 wins over the ratio
    lr_scheduler_type: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5
    total_training_steps: int = -1  # set by the trainer from its resolved step count


@dataclass
class ModelConfig:
    path: str | None = None  # a local HF checkpoint folder; null = the embedded tiny demo model
    tokenizer_path: str | None = None  # null = path
    trust_remote_code: bool = False
    custom_chat_template: str | None = None  # a Jinja chat template used for the prompts instead of the tokenizer's
    external_lib: str | None = None  # a module to import first (registers custom model classes)
    override_config: dict[str, Any] = field(default_factory=dict)
    # the stored weights (verl's model_dtype; float32 = fp32 master weights) | bfloat16 (float16: refused)
    dtype: str = "float32"
    # null (verl: true): on where a micro-batch of the actor's ppo_max_token_len_per_gpu tokens would not fit
    # (rl_core/models/checkpointing.py)
    enable_gradient_checkpointing: bool | None = None
    # padding-free forward (packed sequences) for log-probs, values and updates; flash-attention varlen kernels when
    # flash_attn is installed and the model runs on CUDA, SDPA otherwise
    use_remove_padding: bool = True
    lora_rank: int = 0  # > 0 trains a LoRA adapter instead of the full model
    lora_alpha: int = 16
    target_modules: Any = "all-linear"  # a module-name list or "all-linear"
    # module names (a list) or a regex peft leaves without an adapter; null: none, or a vision-language model's image
    # side (rl_core.models.multimodal.VISION_LORA_EXCLUDE: LoRA on the language part)
    exclude_modules: Any = None
    lora_adapter_path: str | None = None  # start from a saved adapter


@dataclass
class FSDPConfig:
    param_offload: bool = False
    optimizer_offload: bool = False
    # forward/backward compute dtype (mixed precision over the model.dtype weights): auto = bfloat16 on CUDA, float32
    # on CPU | float32 | bfloat16 (float16 is refused: training in it needs loss scaling, which is not built)
    dtype: str = "auto"


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"  # see `ppoflow algos`
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1


@dataclass
class ActorConfig:
    strategy: str = "fsdp"  # fsdp | fsdp2: both are FSDP2 (fully_shard) here
    ppo_mini_batch_size: int = 256  # in prompts; x rollout.n responses per optimizer step
    # responses per forward/backward (gradient accumulation); null (verl: must be set): packed by tokens, as with
    # use_dynamic_bsz (rl_core.workers.micro_batches.micro_batch_limits)
    ppo_micro_batch_size_per_gpu: int | None = None
    # true: micro-batches packed by tokens (at most ppo_max_token_len_per_gpu real tokens), not by count
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    shuffle: bool = False
    # false: skip the old-log-prob pass and use the update's own forward pass, detached, as the old log-probs. Only
    # with one epoch and one mini-batch per step (the policy has not moved yet, so both are the same numbers). null:
    # skipped wherever that holds and nothing needs them before the update (recomputes_old_log_prob)
    recompute_old_log_prob: bool | None = None
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual-clip bound
    tau_pos: float = 1.0  # SAPO temperatures
    tau_neg: float = 1.05
    freeze_vision_tower: bool = False  # a vision-language policy: train its language part only
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float = 1.0
    entropy_from_logits_chunk_size: int = 2048
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int | None = None  # null: packed by log_prob_max_token_len_per_gpu tokens
    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    log_prob_max_token_len_per_gpu: int = (  # type: ignore[assignment]
        "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"
    )


@dataclass
class ValKwargsConfig:
    """Sampling for validation (greedy by default)."""

    n: int = 1
    do_sample: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class CheckpointEngineConfig:
    """verl's ``rollout.checkpoint_engine``: how the actor's weights reach a rollout on workers of its own
    (infra/weight_transport.py)."""

    # naive: through Ray's object store, any worker fetches them when it next generates (the actor never waits) |
    # gloo (CPUs) / nccl (GPUs): broadcast to each rollout worker over a torch.distributed channel of its own, the
    # worker receiving at the same time (verl's nccl engine)
    backend: str = "naive"
    update_weights_bucket_megabytes: int = 2048  # the weights move in buckets of at most this size


@dataclass
class RolloutConfig:
    name: str = "hf"  # hf (CPU or GPU) | vllm (GPU: `pip install 'ppoflow[gpu]'`; CPU: vLLM's CPU build, README)
    # the dtype generation computes in (verl's rollout.dtype; verl's HF rollout always samples under bf16 autocast):
    # auto = bfloat16 on CUDA and on a CPU with bf16 instructions (AMX or AVX512_BF16) for a model >= 256 wide,
    # float32 otherwise (emulated bf16, or a model too narrow to gain) | bfloat16 | float32 | float16. The trainer's
    # passes keep fsdp_config.dtype: the samples' log-probs then differ slightly from the recomputed ones, as with
    # vLLM (training/rollout_probs_diff_*)
    dtype: str = "auto"
    n: int = 1  # responses per prompt (GRPO, RLOO, ... need several)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    do_sample: bool = True
    prompt_length: int = "${data.max_prompt_length}"  # type: ignore[assignment]
    response_length: int = "${data.max_response_length}"  # type: ignore[assignment]
    generation_batch_size: int = 256  # sequences generated at once; bounds memory
    log_prob_micro_batch_size_per_gpu: int | None = None  # null: packed by log_prob_max_token_len_per_gpu tokens
    log_prob_use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    log_prob_max_token_len_per_gpu: int = (  # type: ignore[assignment]
        "${actor_rollout_ref.actor.ppo_max_token_len_per_gpu}"
    )
    # also return the sampler's own log-probs (rollout_log_probs); the step then logs how far they are from the
    # recomputed old log-probs (training/rollout_probs_diff_*: ~0 when the samples come from the trained policy)
    calculate_log_probs: bool = True
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's EOS
    # false: compiled decoding — vllm captures CUDA graphs; hf uses a static KV cache, which transformers compiles
    # with torch.compile on CUDA (on CPU the static cache runs uncompiled)
    enforce_eager: bool = True
    # give the KV-cache memory back after each rollout (vllm: sleep/wake_up; hf: empty the CUDA cache)
    free_cache_engine: bool = True
    # vllm: the share of the GPU its weights + KV cache may take (vLLM's CPU build: of the machine's memory, for the
    # whole worker process)
    gpu_memory_utilization: float = 0.5
    tensor_model_parallel_size: int = 1  # vllm: GPUs per engine (a divisor of the workers per node)
    max_num_seqs: int = 256  # vllm: sequences scheduled at once
    max_model_len: int | None = None  # vllm: null = data.max_prompt_length + data.max_response_length
    seed: int = 42  # sampling is seeded by (seed, step, rank, chunk): a re-run step draws the same samples
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    checkpoint_engine: CheckpointEngineConfig = field(default_factory=CheckpointEngineConfig)


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = True  # rollout shares the actor's weights in the same worker (the only mode built)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class CriticModelConfig:
    """The value model; by default the policy's checkpoint with a fresh value head."""

    path: str | None = "${actor_rollout_ref.model.path}"
    tokenizer_path: str | None = "${actor_rollout_ref.model.tokenizer_path}"
    trust_remote_code: bool = "${actor_rollout_ref.model.trust_remote_code}"  # type: ignore[assignment]
    external_lib: str | None = "${actor_rollout_ref.model.external_lib}"
    override_config: dict[str, Any] = field(default_factory=dict)
    dtype: str = "${actor_rollout_ref.model.dtype}"
    enable_gradient_checkpointing: bool | None = None  # null (verl: true): as the actor's, with this token budget
    use_remove_padding: bool = "${actor_rollout_ref.model.use_remove_padding}"  # type: ignore[assignment]
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: Any = "all-linear"
    lora_adapter_path: str | None = None


@dataclass
class CriticConfig:
    enable: bool | None = None  # null = only when the estimator needs values (gae)
    strategy: str = "fsdp"
    rollout_n: int = "${actor_rollout_ref.rollout.n}"  # type: ignore[assignment]
    ppo_mini_batch_size: int = "${actor_rollout_ref.actor.ppo_mini_batch_size}"  # type: ignore[assignment]
    ppo_micro_batch_size_per_gpu: int | None = None  # null: packed by ppo_max_token_len_per_gpu tokens
    forward_micro_batch_size_per_gpu: int | None = "${critic.ppo_micro_batch_size_per_gpu}"  # type: ignore[assignment]
    use_dynamic_bsz: bool = "${actor_rollout_ref.actor.use_dynamic_bsz}"  # type: ignore[assignment]
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = "${critic.ppo_max_token_len_per_gpu}"  # type: ignore[assignment]
    ppo_epochs: int = "${actor_rollout_ref.actor.ppo_epochs}"  # type: ignore[assignment]
    shuffle: bool = "${actor_rollout_ref.actor.shuffle}"  # type: ignore[assignment]
    cliprange_value: float = 0.5
    loss_agg_mode: str = "${actor_rollout_ref.actor.loss_agg_mode}"
    grad_clip: float = 1.0
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1.0e-5))


# ---------------------------------------------------------------------------------------------- reward
@dataclass
class RewardModelModelConfig:
    path: str | None = None
    input_tokenizer: str | None = None  # the policy's tokenizer path when it differs from the reward model's
    trust_remote_code: bool = False
    dtype: str = "float32"


@dataclass
class RewardModelConfig:
    enable: bool = False
    micro_batch_size_per_gpu: int = 8
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)


@dataclass
class CustomRewardFunctionConfig:
    path: str | None = None  # a .py file with compute_score(data_source, solution_str, ground_truth, extra_info)
    name: str = "compute_score"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments for the function


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment."""

    enable: bool = False
    len: int = 4
    penalty_factor: float = 1.0


@dataclass
class RewardConfig:
    reward_manager: str = "naive"  # naive (one call per sample) | batch (one call with lists)
    on_error: str = "raise"  # raise: the step fails naming the sample; zero: it scores 0 and is counted
    lenient_answers: bool = False  # accept near-misses verl's rule scorers reject (a trailing period after #### N)
    # a batch's scoring (the reward function, or the reward model's call) that takes longer fails the step naming the
    # sample it was on; null = no limit
    timeout_s: float | None = 600.0
    # multi-turn: also put each policy turn's reward (its tool calls' step rewards + the interaction's score of the
    # reply to it) on the turn's last token, besides the outcome score on the response's last (see
    # algorithm.adv_estimator=turn_rloo, which gives each turn its own advantage); validation scores the outcome only
    turn_rewards: bool = False
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


# ---------------------------------------------------------------------------------------------- algorithm
@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: keep only the prompts whose responses differ in ``metric``."""

    enable: bool = False
    # reward (= seq_reward, seq_final_reward: the summed score) | acc (or any per-sample value the scorer returns)
    metric: str = "reward"
    max_num_gen_batches: int = 0  # 0 = no limit


@dataclass
class RolloutCorrectionConfig:
    """verl's rollout correction (rl_core/algos/rollout_correction.py): importance weights and rejection for samples
    whose sampler's log-probs differ from the trained policy's (needs rollout.calculate_log_probs). Its metrics
    (``rollout_corr/*``) are logged whenever the rollout's log-probs and the old log-probs both exist."""

    rollout_is: str | None = None  # null | token | sequence: importance weights in the policy loss
    rollout_is_threshold: Any = 2.0  # truncate the weights at this bound (TIS), or "lower_upper": zero outside (IcePop)
    rollout_rs: str | None = None  # rejection filters, comma-separated: token_k1, seq_mean_k3, ... (see the module)
    rollout_rs_threshold: Any = None  # one bound for all filters or one per filter; "lower_upper" for k1 filters
    # false: decoupled (old log-probs recomputed; weights = pi_old / pi_rollout); true: bypass (the rollout's
    # log-probs are the old ones, no old-log-prob pass; weights and rejection per micro-batch from pi_theta)
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"  # bypass mode: ppo_clip (the PPO ratio is the correction) | reinforce (weighted)
    rollout_is_batch_normalize: bool = False  # divide the weights by their batch mean


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"  # see `ppoflow algos`; gae needs a critic (added automatically)
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


# ---------------------------------------------------------------------------------------------- trainer
@dataclass
class RayConfig:
    address: str | None = None  # null = RAY_ADDRESS, else a local cluster on 127.0.0.1
    num_cpus: int | None = None  # the local cluster's CPUs; null = the machine's


@dataclass
class TrainerConfig:
    project_name: str = "ppoflow"  # the MLflow experiment
    experiment_name: str = "demo"  # the MLflow run name
    total_epochs: int = 30  # training stops at whichever of total_epochs / total_training_steps comes first
    total_training_steps: int | None = None  # null = total_epochs passes over the data
    device: str = "auto"  # auto (cuda when the cluster has GPUs) | cpu | cuda
    n_gpus_per_node: int = 1  # workers per node (one per GPU; on CPU, one per process)
    nnodes: int = 1
    cpus_per_worker: int | None = None  # null = a node's CPUs shared out evenly between its workers
    critic_warmup: int = 0  # steps that train only the critic
    balance_batch: bool = True  # reorder a step's batch so that every rank gets a similar token count
    val_before_train: bool = True
    test_freq: int = 25  # validate every N steps (and after the last); -1 = never
    save_freq: int = 25  # checkpoint every N steps (and after the last); -1 = never
    max_ckpt_to_keep: int | None = 2  # null = keep all
    # a folder, or a URL of remote storage (s3://bucket/prefix: the `team` extra), worked on in a local copy under
    # checkpoint_cache_dir (rl_core/step_checkpoint.py)
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    checkpoint_cache_dir: str = "~/.cache/ppoflow/checkpoints"
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: str | None = None  # a global_step_N folder, with resume_mode=resume_path
    # a resume under a config other than its checkpoint's (flows/resume.py lists what may change without it): refused
    # unless true; then the run goes on under the new config (workers rebuilt, new optimizer settings in force)
    resume_allow_config_change: bool = False
    log_samples_freq: int = 25  # rollout samples table every N steps; -1 = never
    num_logged_samples: int = 16
    register_model_name: str | None = None  # register the final actor in the MLflow model registry under this name
    max_worker_restarts: int = 2  # a dead worker: rebuild the group from the latest checkpoint at most this often
    # a failed run leaves its workers alive for the next controller of the same run (a retry, or `ppoflow train`
    # again); null = yes on a persistent cluster, no on the embedded one (a pending Prefect flow-run retry keeps them)
    keep_workers: bool | None = None
    worker_timeout_s: float = 600.0  # every remote call's timeout
    # building workers (the start, a rebuild after a lost node) waits this long for the cluster to have room for them
    # (a node replaced or added) before the run fails naming what is missing; 0 = refuse at once
    capacity_wait_s: float = 0.0
    stage_retries: int = 1  # retries of idempotent stages (generate, log-probs, values) on transient errors
    # the flow run keeps the stage task runs of its last N steps in Prefect (older ones are deleted: Prefect's
    # database stays bounded on long runs); -1 = keep all
    prefect_history_steps: int = 1000
    tracking_uri: str = "sqlite:///mlflow.db"  # MLFLOW_TRACKING_URI wins when set
    # a new experiment's artifact folder; null = the tracking server's artifact store (`mlflow server
    # --artifacts-destination`: the stack's S3 bucket on its postgres backend), or mlartifacts/ beside a SQLite store
    artifact_location: str | None = None
    cache_dir: str = ".ppoflow"  # the embedded demo model and data are built here once
    ray: RayConfig = field(default_factory=RayConfig)


@dataclass
class RolloutPoolConfig:
    """verl's recipes' ``rollout`` section: the rollout on workers of its own (rl_core/separate_rollout.py)."""

    nnodes: int = 1
    n_gpus_per_node: int = 0  # rollout workers per node (one per GPU); 0 = on the trainer's workers (colocated)
    cpus_per_worker: int | None = None  # null = a node's CPUs shared out evenly between both pools' workers


@dataclass
class AsyncTrainingConfig:
    """How far a rollout of its own runs ahead of the trainer (rl_core/rollout_schedule.py); stale samples are
    corrected by ``algorithm.rollout_correction``."""

    # sync: generate, then train | one_step_off: the next step's generation overlaps this step's training (verl's
    # one_step_off_policy) | fully_async: the window below (verl's fully_async_policy); the last two need
    # rollout.n_gpus_per_node > 0
    mode: str = "sync"
    staleness_threshold: float = 0.0  # fully_async: steps generated between syncs = (1 + this) x the next key
    trigger_parameter_sync_step: int = 1  # fully_async: trainer steps between weight syncs to the rollout
    # fully_async: a generation in flight at a weight sync takes the new weights between two tokens and goes on
    # (verl's; rl_core/rollout/partial.py: needs checkpoint_engine.backend gloo / nccl and the hf engine)
    partial_rollout: bool = False


@dataclass
class PPOTrainerConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutPoolConfig = field(default_factory=RolloutPoolConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)


def default_config() -> DictConfig:
    """The whole default config as a typed OmegaConf node (what ``ppoflow config`` prints with no overrides)."""
    from omegaconf import OmegaConf  # imported here: rl_core's workers run without OmegaConf (bench/gpu_check.py)

    return OmegaConf.structured(PPOTrainerConfig)
