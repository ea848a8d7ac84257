"""The names of a step's Batch fields: one home for the strings that stages, workers, engines and metrics share.

verl's names are kept (so a verl user's reward function or estimator reads the same keys), including its
inconsistent ones (``old_log_probs`` plural, ``ref_log_prob`` singular, ``entropys``). Shapes: B rows (one per
response, or per prompt before generation), P prompt tokens (left-padded), R response tokens (right-padded).
"""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------- tensors
# a prompt batch (rl_core.data.dataset) and, after generation, the whole sequence: [prompt | response]
INPUT_IDS = "input_ids"  # (B, P) prompts; (B, P + R) sequences
ATTENTION_MASK = "attention_mask"  # same shape: 1 on real tokens
POSITION_IDS = "position_ids"  # same shape: 0.. from the first real token
# generation (rl_core.rollout.base)
PROMPTS = "prompts"  # (B, P) the left-padded prompt part of each sequence
RESPONSES = "responses"  # (B, R) sampled tokens, pad after the first stop token
# (B, R) 1 on the tokens the policy produced (up to and including the stop token); a multi-turn response has holes:
# tool answers and template glue are real tokens (attention 1) the policy did not sample (mask 0)
RESPONSE_MASK = "response_mask"
ROLLOUT_LOG_PROBS = "rollout_log_probs"  # (B, R) the sampler's own log-probs (rollout.calculate_log_probs)
# (B, R) a separate rollout: the actor's version (updates done) whose weights sampled each response token
ROLLOUT_VERSION = "rollout_version"
# reward
RM_SCORES = "rm_scores"  # (B, R) a reward model's score on the last response token
TOKEN_LEVEL_SCORES = "token_level_scores"  # (B, R) the score on the last response token
REWARD_BASELINES = "reward_baselines"  # (B,) ReMax: the greedy response's score
# the policies and the critic
OLD_LOG_PROBS = "old_log_probs"  # (B, R) under the policy that sampled (before this step's update)
ENTROPYS = "entropys"  # (B, R) its entropy per token
REF_LOG_PROB = "ref_log_prob"  # (B, R) under the reference policy
VALUES = "values"  # (B, R) the critic's V(s_t)
# advantage
TOKEN_LEVEL_REWARDS = "token_level_rewards"  # (B, R) scores minus the KL penalty (when it is in the reward)
ADVANTAGES = "advantages"  # (B, R)
RETURNS = "returns"  # (B, R)
# (B, R) rollout correction's importance weights in the policy loss (algorithm.rollout_correction.rollout_is)
ROLLOUT_IS_WEIGHTS = "rollout_is_weights"

# the tensors every worker stage reads: only these (plus the stage's own inputs) travel to the workers
SEQUENCE = (INPUT_IDS, ATTENTION_MASK, POSITION_IDS, RESPONSES, RESPONSE_MASK)

# ---------------------------------------------------------------------------------------------- per-sample objects
UID = "uid"  # the prompt's id: the samples of one prompt share it (GRPO's groups)
AGENT_NAME = "agent_name"  # the row's agent loop (verl's column; "" = the run's default)
DATA_SOURCE = "data_source"  # picks the rule scorer (data.reward_fn_key names the column)
REWARD_MODEL = "reward_model"  # {"ground_truth": ...}
EXTRA_INFO = "extra_info"  # the dataset row's extra_info dict
RAW_PROMPT = "raw_prompt"  # the prompt's messages (the reward model re-templates them)
# multi-turn rollouts (rl_core.agent.runner)
NUM_TURNS = "num_turns"  # verl's count: the prompt + assistant turns + tool answers (2 for a single turn)
MULTI_TURN = "multi_turn"  # {"messages", "tool_calls", "finish_reason", "final_answer"} of the trajectory
# a vision-language run: each row's processor tensors for the model, or None (rl_core.models.multimodal)
MULTI_MODAL_INPUTS = "multi_modal_inputs"
MULTI_MODAL_DATA = "multi_modal_data"  # verl's: each row's {"image": [decoded images]}, or None (the samples' views)

# ---------------------------------------------------------------------------------------------- meta info
TEMPERATURE = "temperature"  # the sampling temperature (log-probs are of the distribution sampled)
GLOBAL_STEP = "global_step"  # seeds sampling: a re-run step draws the same samples
VALIDATE = "validate"  # sample with val_kwargs
VAL_KWARGS = "val_kwargs"  # an evaluation's own sampling settings
GREEDY = "greedy"  # one greedy response per prompt (ReMax's baseline)
ROLLOUT_CORRECTION = "rollout_correction"  # the update's RolloutCorrection settings in the bypass mode
