"""The defaults are verl's: every key the schema shares with verl 0.9's ``ppo_trainer.yaml`` defaults to verl's value,
except an explicit list of deliberate differences, each documented in the README. The embedded demo's own values are
a profile applied only when no model path is given."""

from omegaconf import OmegaConf

from flows.config import compose_config, demo_profile
from rl_core.config import default_config
from tests.conftest import ROOT

# verl 0.9.1, verl/trainer/config/_generated_ppo_trainer.yaml, resolved: the keys ppoflow's schema shares with it
# (a copy of the numbers, so that the test does not depend on verl)
VERL_DEFAULTS = {
    "actor_rollout_ref.actor.clip_ratio": 0.2,
    "actor_rollout_ref.actor.clip_ratio_c": 3.0,
    "actor_rollout_ref.actor.clip_ratio_high": 0.2,
    "actor_rollout_ref.actor.clip_ratio_low": 0.2,
    "actor_rollout_ref.actor.entropy_coeff": 0,
    "actor_rollout_ref.actor.entropy_from_logits_chunk_size": 2048,
    "actor_rollout_ref.actor.fsdp_config.dtype": "bfloat16",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": False,
    "actor_rollout_ref.actor.fsdp_config.param_offload": False,
    "actor_rollout_ref.actor.grad_clip": 1.0,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
    "actor_rollout_ref.actor.optim.betas": [0.9, 0.999],
    "actor_rollout_ref.actor.optim.lr": 1e-06,
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "constant",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": -1,
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.0,
    "actor_rollout_ref.actor.optim.min_lr_ratio": 0.0,
    "actor_rollout_ref.actor.optim.num_cycles": 0.5,
    "actor_rollout_ref.actor.optim.total_training_steps": -1,
    "actor_rollout_ref.actor.optim.weight_decay": 0.01,
    "actor_rollout_ref.actor.policy_loss.clip_cov_lb": 1.0,
    "actor_rollout_ref.actor.policy_loss.clip_cov_ratio": 0.0002,
    "actor_rollout_ref.actor.policy_loss.clip_cov_ub": 5.0,
    "actor_rollout_ref.actor.policy_loss.kl_cov_ratio": 0.0002,
    "actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla",
    "actor_rollout_ref.actor.policy_loss.ppo_kl_coef": 0.1,
    "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    "actor_rollout_ref.actor.shuffle": False,
    "actor_rollout_ref.actor.strategy": "fsdp",
    "actor_rollout_ref.actor.tau_neg": 1.05,
    "actor_rollout_ref.actor.tau_pos": 1.0,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.use_dynamic_bsz": False,
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 16384,
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": False,
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": 16384,
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": False,
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 16384,
    "critic.use_dynamic_bsz": False,
    "critic.ppo_max_token_len_per_gpu": 32768,
    "critic.forward_max_token_len_per_gpu": 32768,
    "actor_rollout_ref.hybrid_engine": True,
    "actor_rollout_ref.model.custom_chat_template": None,
    "actor_rollout_ref.model.enable_gradient_checkpointing": True,
    "actor_rollout_ref.model.external_lib": None,
    "actor_rollout_ref.model.lora_adapter_path": None,
    "actor_rollout_ref.model.lora_alpha": 16,
    "actor_rollout_ref.model.lora_rank": 0,
    "actor_rollout_ref.model.override_config": {},
    "actor_rollout_ref.model.path": "~/models/deepseek-llm-7b-chat",
    "actor_rollout_ref.model.target_modules": "all-linear",
    "actor_rollout_ref.model.tokenizer_path": None,
    "actor_rollout_ref.model.trust_remote_code": False,
    "actor_rollout_ref.model.use_remove_padding": True,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.rollout.calculate_log_probs": True,
    "actor_rollout_ref.rollout.do_sample": True,
    "actor_rollout_ref.rollout.dtype": "bfloat16",
    "actor_rollout_ref.rollout.enforce_eager": False,
    "actor_rollout_ref.rollout.free_cache_engine": True,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.rollout.max_model_len": None,
    "actor_rollout_ref.rollout.max_num_seqs": 256,
    "actor_rollout_ref.rollout.n": 1,
    "actor_rollout_ref.rollout.name": "???",
    "actor_rollout_ref.rollout.prompt_length": 512,
    "actor_rollout_ref.rollout.response_length": 512,
    "actor_rollout_ref.rollout.seed": 42,
    "actor_rollout_ref.rollout.temperature": 1.0,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
    "actor_rollout_ref.rollout.top_k": -1,
    "actor_rollout_ref.rollout.top_p": 1,
    "actor_rollout_ref.rollout.val_kwargs.do_sample": False,
    "actor_rollout_ref.rollout.val_kwargs.n": 1,
    "actor_rollout_ref.rollout.val_kwargs.temperature": 0,
    "actor_rollout_ref.rollout.val_kwargs.top_k": -1,
    "actor_rollout_ref.rollout.val_kwargs.top_p": 1.0,
    "algorithm.adv_estimator": "gae",
    "algorithm.filter_groups.enable": False,
    "algorithm.filter_groups.max_num_gen_batches": 0,
    "algorithm.filter_groups.metric": "reward",
    "algorithm.gamma": 1.0,
    "algorithm.kl_ctrl.horizon": 10000,
    "algorithm.kl_ctrl.kl_coef": 0.001,
    "algorithm.kl_ctrl.target_kl": 0.1,
    "algorithm.kl_ctrl.type": "fixed",
    "algorithm.kl_penalty": "kl",
    "algorithm.lam": 1.0,
    "algorithm.norm_adv_by_std_in_grpo": True,
    "algorithm.use_kl_in_reward": False,
    "critic.cliprange_value": 0.5,
    "critic.enable": None,
    "critic.forward_micro_batch_size_per_gpu": None,
    "critic.fsdp.dtype": "bfloat16",
    "critic.fsdp.optimizer_offload": False,
    "critic.fsdp.param_offload": False,
    "critic.grad_clip": 1.0,
    "critic.loss_agg_mode": "token-mean",
    "critic.model.enable_gradient_checkpointing": True,
    "critic.model.external_lib": None,
    "critic.model.lora_adapter_path": None,
    "critic.model.lora_alpha": 16,
    "critic.model.lora_rank": 0,
    "critic.model.override_config": {},
    "critic.model.path": "~/models/deepseek-llm-7b-chat",
    "critic.model.target_modules": "all-linear",
    "critic.model.tokenizer_path": None,
    "critic.model.trust_remote_code": False,
    "critic.model.use_remove_padding": True,
    "critic.optim.betas": [0.9, 0.999],
    "critic.optim.lr": 1e-05,
    "critic.optim.lr_scheduler_type": "constant",
    "critic.optim.lr_warmup_steps": -1,
    "critic.optim.lr_warmup_steps_ratio": 0.0,
    "critic.optim.min_lr_ratio": 0.0,
    "critic.optim.num_cycles": 0.5,
    "critic.optim.total_training_steps": -1,
    "critic.optim.weight_decay": 0.01,
    "critic.ppo_epochs": 1,
    "critic.ppo_micro_batch_size_per_gpu": None,
    "critic.ppo_mini_batch_size": 256,
    "critic.rollout_n": 1,
    "critic.shuffle": False,
    "critic.strategy": "fsdp",
    "custom_reward_function.name": None,
    "custom_reward_function.path": None,
    "data.filter_overlong_prompts": False,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.prompt_key": "prompt",
    "data.reward_fn_key": "data_source",
    "data.seed": None,
    "data.shuffle": True,
    "data.train_batch_size": 1024,
    "data.train_files": "~/data/rlhf/gsm8k/train.parquet",
    "data.train_max_samples": -1,
    "data.truncation": "error",
    "data.val_batch_size": None,
    "data.val_files": "~/data/rlhf/gsm8k/test.parquet",
    "data.val_max_samples": -1,
    "reward_model.enable": None,
    "reward_model.model.path": None,
    "reward_model.model.trust_remote_code": None,
    "trainer.balance_batch": True,
    "trainer.critic_warmup": 0,
    "trainer.default_local_dir": "checkpoints/verl_examples/gsm8k",
    "trainer.device": "cuda",
    "trainer.experiment_name": "gsm8k",
    "trainer.n_gpus_per_node": 8,
    "trainer.nnodes": 1,
    "trainer.project_name": "verl_examples",
    "trainer.resume_from_path": None,
    "trainer.resume_mode": "auto",
    "trainer.save_freq": -1,
    "trainer.test_freq": -1,
    "trainer.total_epochs": 30,
    "trainer.total_training_steps": None,
    "trainer.val_before_train": True,
}

# key -> why ppoflow's default differs (each also in the README's "Deliberate differences from verl")
DELIBERATE_DIFFERENCES = {
    "actor_rollout_ref.model.path": "no placeholder path: null runs the embedded demo",
    "critic.model.path": "the actor's model (null: the embedded demo)",
    "data.train_files": "no placeholder path: null is the demo's synthetic task",
    "data.val_files": "no placeholder path: null is the demo's synthetic task",
    "trainer.project_name": "names: the MLflow experiment",
    "trainer.experiment_name": "names: the MLflow run",
    "trainer.default_local_dir": "follows the two names above",
    "actor_rollout_ref.rollout.name": "verl has no default; hf runs everywhere",
    "actor_rollout_ref.rollout.enforce_eager": "the hf engine's compiled static-cache decoding has not run on a GPU "
    "yet",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "tensor parallelism is vllm's only; 1 runs on one GPU",
    "actor_rollout_ref.actor.fsdp_config.dtype": "auto = bfloat16 on CUDA (verl's), float32 on the CPU",
    "critic.fsdp.dtype": "auto = bfloat16 on CUDA (verl's), float32 on the CPU",
    "actor_rollout_ref.rollout.dtype": "auto = bfloat16 on CUDA (verl's) and where a CPU computes it faster, else "
    "float32",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "null = on where a micro-batch's activations would not "
    "fit: a small model's update without the second forward pass",
    "critic.model.enable_gradient_checkpointing": "as the actor's",
    "data.seed": "verl's null leaves the shuffle unseeded; 1 makes runs repeat and resume exactly",
    "custom_reward_function.name": "verl's null means compute_score",
    "reward_model.enable": "verl's null means false",
    "reward_model.model.trust_remote_code": "verl's null means false",
    "trainer.device": "auto = cuda when the cluster has GPUs, else the CPU",
    "trainer.n_gpus_per_node": "one worker on one machine; set it to the GPUs per node",
    "trainer.save_freq": "resumption after a crash is a promise of ppoflow: checkpoints every 25 steps",
    "trainer.test_freq": "validation every 25 steps",
}


def test_every_shared_default_is_verls_or_a_listed_difference():
    config = default_config()
    OmegaConf.resolve(config)
    wrong = {}
    for key, verl_value in VERL_DEFAULTS.items():
        value = OmegaConf.select(config, key)
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        differs = value != verl_value
        if differs != (key in DELIBERATE_DIFFERENCES):
            wrong[key] = (value, verl_value)
    assert wrong == {}, "a default differs from verl's without being listed (or is listed and agrees): (ours, verl's)"


def test_every_deliberate_difference_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Deliberate differences from verl's defaults") :]
    assert [key for key in DELIBERATE_DIFFERENCES if f"`{key}`" not in section] == []


def test_a_users_model_gets_verls_values_and_the_demo_its_profile():
    own = compose_config(["actor_rollout_ref.model.path=/models/Qwen2.5-0.5B-Instruct"])
    assert own.actor_rollout_ref.actor.optim.lr == 1e-6 and own.critic.optim.lr == 1e-5
    assert own.actor_rollout_ref.actor.clip_ratio_high == 0.2 and own.actor_rollout_ref.actor.use_kl_loss is False
    assert (own.data.max_prompt_length, own.data.max_response_length, own.data.train_batch_size) == (512, 512, 1024)
    demo = compose_config([])
    profile = demo_profile()
    for key in (
        "actor_rollout_ref.actor.optim.lr",
        "algorithm.adv_estimator",
        "actor_rollout_ref.rollout.n",
        "data.max_response_length",
        "trainer.total_training_steps",
    ):
        assert OmegaConf.select(demo, key) == OmegaConf.select(profile, key) != OmegaConf.select(own, key), key
    # an override wins over the profile; a model path turns the profile off
    assert compose_config(["actor_rollout_ref.actor.optim.lr=3e-4"]).actor_rollout_ref.actor.optim.lr == 3e-4
    assert (
        compose_config(["actor_rollout_ref.model.path=/m", "algorithm.adv_estimator=grpo"]).actor_rollout_ref.rollout.n
        == 1
    )
