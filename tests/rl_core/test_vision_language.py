"""Vision-language models: tiny checkpoints of three families load with their processors, verl's multimodal rows
(``<image>`` placeholders, an ``images`` column) load and are refused when bad, and the rollout, the log-probs and the
update take the images (batched rows equal the same rows alone; the sampler's log-probs equal the recomputed ones)."""

import base64
import io
import pickle

import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from flows.cli import main as cli_main
from flows.config import demo_profile
from rl_core.algos.kl import get_kl_controller
from rl_core.batch import Batch
from rl_core.batch_fields import MULTI_MODAL_INPUTS, OLD_LOG_PROBS, RESPONSE_MASK, ROLLOUT_LOG_PROBS
from rl_core.checkpoint import save_model_weights
from rl_core.config import ModelConfig, default_config
from rl_core.data.dataset import RLDataset
from rl_core.data.images import IMAGE_PLACEHOLDER
from rl_core.data.rows import DatasetError, write_rows
from rl_core.data.sampler import ResumableSampler
from rl_core.data.synthetic import SHAPES_QUESTION, shapes_rows
from rl_core.input_checks import image_problems
from rl_core.models.loading import load_policy_model, load_policy_processor
from rl_core.models.lora import apply_lora
from rl_core.models.multimodal import (
    SUPPRESSED_LOGIT,
    placeholder_token_ids,
    vision_model_inputs,
    vision_modules,
)
from rl_core.models.tiny_vlm import make_tiny_vlm
from rl_core.ppo_step import StepWorkers, run_ppo_step
from rl_core.reward.manager import RewardManager
from rl_core.reward.scorers import geo3k_score, shapes_score
from rl_core.rollout.hf_engine import SuppressPlaceholders
from rl_core.workers.actor_rollout_ref import ActorRolloutRefWorker
from rl_core.workers.trainable_state import load_model_weights

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "llava")


@pytest.fixture(scope="module")
def vlm_folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("vlm")
    return {family: make_tiny_vlm(base / family, family=family) for family in FAMILIES}


@pytest.fixture()
def vlm_config(vlm_folders, tmp_path):
    config = OmegaConf.merge(default_config(), demo_profile())
    config.actor_rollout_ref.model.path = str(vlm_folders["qwen2_5_vl"])
    config.data.max_prompt_length, config.data.max_response_length = 40, 4
    config.data.train_batch_size, config.actor_rollout_ref.rollout.n = 4, 2
    config.actor_rollout_ref.actor.ppo_mini_batch_size = 4
    config.actor_rollout_ref.rollout.calculate_log_probs = True
    return config


def processor_of(folder):
    model_config = ModelConfig(path=str(folder))
    model, tokenizer = load_policy_model(model_config)
    return model, tokenizer, load_policy_processor(model_config, tokenizer)


def png(colour, size=(48, 48)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


def image_row(question=SHAPES_QUESTION, images=None, data_source="ppoflow/shapes", answer="red"):
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": f"{IMAGE_PLACEHOLDER}{question}"}],
        "images": images if images is not None else [{"bytes": png((220, 40, 40)), "path": None}],
        "reward_model": {"style": "rule", "ground_truth": answer},
    }


# ---------------------------------------------------------------------------------------------- models and data
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_loads_with_its_processor_and_expands_the_image_placeholder(vlm_folders, family, tmp_path):
    model, tokenizer, processor = processor_of(vlm_folders[family])
    assert type(model).__name__.endswith("ForConditionalGeneration") and processor is not None
    assert processor.tokenizer is tokenizer and tokenizer.padding_side == "left"
    data_config = OmegaConf.create({**default_config().data, "max_prompt_length": 64})
    path = write_rows([image_row()], tmp_path / "rows.parquet")
    data = RLDataset(str(path), tokenizer, data_config, processor=processor)
    (placeholder,) = [i for i in placeholder_token_ids(model) if i in data.prompt_ids[0]]
    # a 48 x 48 image in 8-pixel patches: Qwen merges 2 x 2 patches into a token (9), LLaVA keeps each patch (36)
    assert data.prompt_ids[0].count(placeholder) == (36 if family == "llava" else 9)
    inputs = data.vision_inputs(0)
    assert inputs["pixel_values"].shape[0] == (1 if family == "llava" else 36)


def test_make_tiny_model_writes_a_vision_language_checkpoint(tmp_path, capsys):
    assert cli_main(["make-tiny-model", str(tmp_path / "llava"), "--family", "llava", "--hidden-size", "32"]) == 0
    assert str(tmp_path / "llava") in capsys.readouterr().out
    model, _, processor = processor_of(tmp_path / "llava")
    assert type(model).__name__ == "LlavaForConditionalGeneration" and type(processor).__name__ == "LlavaProcessor"
    assert model.config.text_config.hidden_size == 32


def test_a_text_only_checkpoint_has_no_processor(tiny_model_path):
    model_config = ModelConfig(path=str(tiny_model_path))
    _, tokenizer = load_policy_model(model_config)
    assert load_policy_processor(model_config, tokenizer) is None


def test_bad_image_rows_are_refused_naming_the_row(vlm_folders, tmp_path, tiny_model_path):
    _, tokenizer, processor = processor_of(vlm_folders["qwen2_vl"])
    data_config = OmegaConf.create({**default_config().data, "max_prompt_length": 64})
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "blue.png").write_bytes(png((40, 80, 220)))
    blue = "pics/blue.png"
    cases = {  # (a file type that holds the row's images: parquet holds bytes, JSON lines paths and URLs)
        "not an image Pillow can read": ("parquet", image_row(images=[{"bytes": b"no png here", "path": None}])),
        "no such image file": ("jsonl", image_row(images=["pics/missing.png"])),
        "1 <image> placeholder\\(s\\) for 2 image\\(s\\)": ("jsonl", image_row(images=[blue, blue])),
    }
    for expected, (suffix, bad) in cases.items():
        good = image_row(images=[blue] if suffix == "jsonl" else None)
        path = write_rows([good, bad], tmp_path / f"rows.{suffix}")
        with pytest.raises(DatasetError, match=f"rows.{suffix}: row 1(, images\\[.\\])?: .*{expected}"):
            RLDataset(str(path), tokenizer, data_config, processor=processor)
    # a path relative to the dataset file's folder, and a data URL, load
    url = "data:image/png;base64," + base64.b64encode(png((40, 170, 60))).decode()
    ok = write_rows([image_row(images=[blue]), image_row(images=[url])], tmp_path / "ok.jsonl")
    assert len(RLDataset(str(ok), tokenizer, data_config, processor=processor).images) == 2
    # a text-only checkpoint cannot take rows with images
    _, text_tokenizer = load_policy_model(ModelConfig(path=str(tiny_model_path)))
    with pytest.raises(DatasetError, match="row 0 has images .* text-only model"):
        RLDataset(str(ok), text_tokenizer, data_config)


def test_vision_inputs_are_laid_over_the_batch_by_row():
    input_ids = torch.zeros((3, 6), dtype=torch.long)
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    rows = [
        {"pixel_values": torch.full((2, 3), 1.0), "mm_token_type_ids": torch.tensor([1, 1, 0])},
        None,
        {"pixel_values": torch.full((1, 3), 2.0), "mm_token_type_ids": torch.tensor([0, 1])},
    ]
    inputs = vision_model_inputs(rows, input_ids, attention_mask)
    assert inputs["pixel_values"].tolist() == [[1.0] * 3, [1.0] * 3, [2.0] * 3]  # rows' images in row order
    # each row's per-token values at its first real tokens (its prompt's), 0 elsewhere
    assert inputs["mm_token_type_ids"].tolist() == [[0, 0, 1, 1, 0, 0], [0] * 6, [0, 1, 0, 0, 0, 0]]
    assert vision_model_inputs([None, None], input_ids[:2], attention_mask[:2]) == {}


def test_image_placeholders_are_never_sampled():
    scores = torch.zeros((2, 6))
    scores[:, 4] = 50.0  # the placeholder would be all but certain
    suppressed = SuppressPlaceholders([4])(torch.zeros((2, 1), dtype=torch.long), scores)
    assert torch.equal(suppressed[:, 4], torch.full((2,), SUPPRESSED_LOGIT))
    assert float(torch.softmax(suppressed, -1)[:, 4].max()) == 0.0 and torch.equal(suppressed[:, :4], scores[:, :4])


# ---------------------------------------------------------------------------------------------- rollout and training
def worker_and_data(config, tmp_path, rows, role="actor_rollout_ref"):
    worker = ActorRolloutRefWorker(config.actor_rollout_ref, role)
    worker.init_model()
    processor = load_policy_processor(config.actor_rollout_ref.model, worker.tokenizer)
    path = write_rows(rows, tmp_path / "train.parquet")
    return worker, RLDataset(str(path), worker.tokenizer, config.data, processor=processor)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_sampled_log_probs_equal_recomputed_ones_and_batched_rows_equal_rows_alone(
    vlm_config, vlm_folders, tmp_path, family
):
    vlm_config.actor_rollout_ref.model.path = str(vlm_folders[family])
    vlm_config.data.max_prompt_length = 64
    # prompts of different lengths (different left padding), one without an image
    rows = [image_row(), image_row(question="Colour?"), shapes_rows(1, 3)[0]]
    rows.append({**image_row(question="No picture here."), "images": None})
    rows[3]["prompt"] = [{"role": "user", "content": "No picture here."}]
    worker, data = worker_and_data(vlm_config, tmp_path, rows, role="actor_rollout")
    prompts = data.collate([0, 1, 2, 3], uid_prefix="v-")
    assert prompts.non_tensors[MULTI_MODAL_INPUTS][3] is None
    assert data.collate([3]).non_tensors[MULTI_MODAL_INPUTS].tolist() == [None]  # batches of a dataset concat
    sequences = worker.generate_sequences(prompts.repeat_interleave(2))
    mask = sequences.tensors[RESPONSE_MASK].bool()
    responses = sequences.tensors["responses"][mask]
    assert not any(int(token) in placeholder_token_ids(worker.module) for token in responses)
    recomputed = worker.compute_log_prob(sequences).tensors[OLD_LOG_PROBS]
    sampled = sequences.tensors[ROLLOUT_LOG_PROBS]
    assert float((recomputed - sampled)[mask].abs().max()) < 1e-4
    alone = torch.cat([worker.compute_log_prob(sequences[[row]]).tensors[OLD_LOG_PROBS] for row in range(8)])
    assert float((alone - recomputed)[mask].abs().max()) < 1e-4
    # the images are what the model looks at: other pixels, other log-probs
    blanked = sequences[[0, 1]]
    blanked.non_tensors[MULTI_MODAL_INPUTS] = [
        {**inputs, "pixel_values": torch.zeros_like(inputs["pixel_values"])}
        for inputs in blanked.non_tensors[MULTI_MODAL_INPUTS]
    ]
    changed = worker.compute_log_prob(blanked).tensors[OLD_LOG_PROBS] - recomputed[:2]
    assert float(changed[mask[:2]].abs().max()) > 1e-3


def varied_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    return float(len(solution_str) % 3)


def test_a_grpo_step_on_verl_format_image_rows_trains_the_language_part_only_when_the_tower_is_frozen(
    vlm_config, tmp_path
):
    vlm_config.actor_rollout_ref.actor.freeze_vision_tower = True
    geo3k = image_row(question="Find x.", data_source="hiyouga/geometry3k", answer="3")  # verl's geo3k row layout
    geo3k["ability"], geo3k["extra_info"] = "math", {"split": "train", "index": 0, "answer": "3"}
    worker, data = worker_and_data(vlm_config, tmp_path, shapes_rows(6, 0) + [geo3k, geo3k])
    before = {name: p.detach().clone() for name, p in worker.module.named_parameters()}
    # a random policy's answers are all wrong: a reward that varies between samples makes a gradient
    reward = RewardManager(worker.tokenizer, varied_score, vlm_config.reward, vlm_config.data)
    sampler = ResumableSampler(len(data), 4, True, 0)
    kl = get_kl_controller(vlm_config.algorithm.kl_ctrl)
    for step in (1, 2):
        batch, metrics = run_ppo_step(vlm_config, StepWorkers(actor=worker), data, sampler, reward, kl, step)
        assert metrics["training/rollout_probs_diff_max"] < 1e-4
    changed = {name for name, p in worker.module.named_parameters() if not torch.equal(p, before[name])}
    vision = {f"{name}." for name, module in worker.module.named_modules() if module in vision_modules(worker.module)}
    assert changed and not any(name.startswith(tuple(vision)) for name in changed)
    assert any("language_model" in name for name in changed)
    # the checkpoint is a vision-language checkpoint again: its processor saved beside the weights
    worker.save_checkpoint(tmp_path / "checkpoint")
    model, tokenizer, processor = processor_of(tmp_path / "checkpoint")
    assert type(processor).__name__ == "Qwen2_5_VLProcessor" and processor.chat_template == tokenizer.chat_template
    trained = worker.module.state_dict()
    assert all(torch.equal(tensor, trained[name]) for name, tensor in model.state_dict().items())
    # and resumes: transformers saves it under the legacy names (model.layers.*), read back by the module's own
    resumed = ActorRolloutRefWorker(vlm_config.actor_rollout_ref, "actor")
    resumed.init_model()
    resumed.load_checkpoint(tmp_path / "checkpoint")
    assert all(torch.equal(tensor, trained[name]) for name, tensor in resumed.module.state_dict().items())


def test_lora_on_a_vision_language_model_adapts_the_language_part(vlm_folders, tmp_path):
    model, _, _ = processor_of(vlm_folders["qwen2_vl"])
    config = OmegaConf.merge(ModelConfig(), {"lora_rank": 4})
    lora = apply_lora(model, config)
    adapted = [name for name, _ in lora.named_parameters() if "lora_A" in name]
    assert adapted and all("visual" not in name for name in adapted)
    assert any("language_model" in name for name in adapted)
    with torch.no_grad():  # a trained adapter (a fresh one's B is zero), saved and loaded into a fresh one
        for name, parameter in lora.named_parameters():
            if "lora_" in name:
                parameter.normal_()
    save_model_weights(lora, None, tmp_path / "adapter")
    fresh = apply_lora(processor_of(vlm_folders["qwen2_vl"])[0], config)
    load_model_weights(fresh, tmp_path / "adapter")
    saved = lora.state_dict()
    assert all(torch.equal(tensor, saved[name]) for name, tensor in fresh.state_dict().items())


def test_batches_with_images_survive_pickling_and_data_parallel_chunks():
    rows = [{"pixel_values": torch.randn(4, 3), "image_grid_thw": torch.tensor([[1, 2, 2]])}, None]
    batch = Batch({"input_ids": torch.ones((2, 3), dtype=torch.long)}, {MULTI_MODAL_INPUTS: rows})
    copy = pickle.loads(pickle.dumps(batch))
    assert torch.equal(copy.non_tensors[MULTI_MODAL_INPUTS][0]["pixel_values"], rows[0]["pixel_values"])
    first, second = copy.chunk(2)
    assert first.non_tensors[MULTI_MODAL_INPUTS][0]["image_grid_thw"].tolist() == [[1, 2, 2]]
    assert second.non_tensors[MULTI_MODAL_INPUTS][0] is None


# ---------------------------------------------------------------------------------------------- rewards and refusals
def test_the_visual_scorers():
    assert [shapes_score(text, "red") for text in ("red", "Red.", " red blue", "blue red", "")] == [1, 1, 1, 0, 0]
    assert geo3k_score("<think>a</think> so \\boxed{3}", "3") == pytest.approx(1.0)
    assert geo3k_score("\\boxed{3}", "3") == pytest.approx(0.9)  # right, unformatted
    assert geo3k_score("<think>a</think> \\boxed{4}", "3") == pytest.approx(0.1)  # formatted, wrong


def test_what_image_runs_cannot_do_yet_is_refused(vlm_config, vlm_folders, tmp_path):
    _, tokenizer, processor = processor_of(vlm_folders["qwen2_5_vl"])
    data = RLDataset(
        str(write_rows([image_row()], tmp_path / "rows.parquet")), tokenizer, vlm_config.data, processor=processor
    )
    assert image_problems(vlm_config, [data]) == []
    vlm_config.actor_rollout_ref.rollout.name = "vllm"
    vlm_config.actor_rollout_ref.rollout.agent.endpoint.command = ["my-agent"]
    vlm_config.algorithm.adv_estimator = "gae"
    problems = "\n".join(image_problems(vlm_config, [data]))
    assert "rollout.name=vllm" in problems and "agents of one's own" in problems and "adv_estimator=gae" in problems


@pytest.mark.parametrize("batching", ["rounds", "continuous"])
def test_every_turn_of_a_multi_turn_trajectory_sees_the_images(vlm_config, tmp_path, batching):
    """The built-in loop with a simulated user (test_agent_surface's GuessInteraction: "try again" until it is right)
    on the real HF engine: each later turn is sampled from prompt + earlier turns + replies with the prompt's images
    (a turn without them would not run: the image tokens would find no features), and the sampler's log-probs of every
    turn equal the recomputed ones."""
    config_file = tmp_path / "interactions.yaml"
    config_file.write_text(
        "interaction:\n  - name: guess\n    class_name: tests.rl_core.test_agent_surface.GuessInteraction\n"
    )
    rollout = vlm_config.actor_rollout_ref.rollout
    rollout.multi_turn.enable, rollout.multi_turn.interaction_config_path = True, str(config_file)
    rollout.multi_turn.max_assistant_turns, rollout.agent.batching = 3, batching
    vlm_config.data.max_response_length = 48
    rows = shapes_rows(3, 0)
    for row in rows:
        row["extra_info"]["interaction_kwargs"] = {"name": "guess", "ground_truth": "a colour it never says"}
    worker, data = worker_and_data(vlm_config, tmp_path, rows, role="actor_rollout")
    rollout.stop_token_ids = list(range(10, 200))  # turns of a few tokens from a random model
    worker.rollout = worker._build_rollout()
    out = worker.generate_sequences(data.collate([0, 1, 2], uid_prefix="m-"))
    turns = [sum(m["role"] == "assistant" for m in info["messages"]) for info in out.non_tensors["multi_turn"]]
    assert max(turns) >= 2, turns
    mask = out.tensors[RESPONSE_MASK].bool()
    recomputed = worker.compute_log_prob(out).tensors[OLD_LOG_PROBS]
    assert float((recomputed - out.tensors[ROLLOUT_LOG_PROBS])[mask].abs().max()) < 1e-4
