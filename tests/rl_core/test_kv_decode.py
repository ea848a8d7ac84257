"""The KV-cache decoding loop (rl_core.rollout.kv_decode) computes what transformers' ``generate`` computes: greedy, the
same tokens and log-probs on each family it runs (left-padded rows, stop tokens, a stopping criterion, a LoRA
adapter); sampled, log-probs equal to a full forward's over the drawn tokens, drawn from the processed distribution
(checked against the probabilities); the HF engine uses it where it runs and ``generate`` elsewhere."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from rl_core.config import RolloutConfig
from rl_core.models.families import FAMILIES
from rl_core.models.loading import load_policy_model
from rl_core.rollout import build_rollout_engine, hf_engine
from rl_core.rollout.base import SamplingParams, sampling_params
from rl_core.rollout.hf_engine import SampledTokenLogProbs, sampling_processors
from rl_core.rollout.kv_decode import KV_DECODE_MODEL_TYPES, draw_categorical, kv_decodable, kv_generate

STOPS, PAD, WIDTH, BUDGET = [7, 9], 0, 7, 12
# model_type -> what a tiny one needs: the experts of a MoE, a pad token inside the vocabulary (Phi-3's is 32000),
# caps low enough to bite on random weights (Gemma 2's attention scores and logits; defaults 50 and 30)
FAMILY_SETTINGS = {
    **dict(FAMILIES.values()),
    "phi3": {"pad_token_id": PAD},
    "gemma2": {"attn_logit_softcapping": 0.002, "final_logit_softcapping": 0.05},
}


def random_model(model_type: str, **settings) -> torch.nn.Module:
    """A randomly initialised tiny model of ``model_type`` with its FAMILY_SETTINGS, ``settings`` over them."""
    settings = {**FAMILY_SETTINGS.get(model_type, {}), **settings}
    config = AutoConfig.for_model(
        model_type,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=50,
        head_dim=16,
        **settings,
    )
    config._attn_implementation = "eager" if model_type == "gemma2" else "sdpa"  # Gemma 2: no SDPA (its caps)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def left_padded(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 50, (rows, WIDTH), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, padding in enumerate([0, 3, 1, 6, 0, 2, 0, 4][:rows]):
        input_ids[row, :padding], attention_mask[row, :padding] = PAD, 0
    return input_ids, attention_mask


def draw(model, do_sample: bool, stopping: StoppingCriteria | None = None, kv: bool = True):
    """(sequences, recorded log-probs) from kv_generate or generate, same processors and stop tokens."""
    input_ids, attention_mask = left_padded()
    recorder = SampledTokenLogProbs()
    params = SamplingParams(do_sample=do_sample, temperature=0.9, top_k=20, top_p=0.95)
    processors = LogitsProcessorList([*sampling_processors(params), recorder])
    criteria = StoppingCriteriaList([stopping] if stopping else [])
    if kv:
        generator = torch.Generator().manual_seed(5)
        sequences = kv_generate(
            model, input_ids, attention_mask, BUDGET, do_sample, processors, criteria, STOPS, PAD, generator
        )
    else:
        torch.manual_seed(5)
        sequences = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=BUDGET,
            do_sample=do_sample,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            eos_token_id=STOPS,
            pad_token_id=PAD,
            logits_processor=processors,
            stopping_criteria=criteria,
        )
    return sequences, recorder.log_probs(sequences[:, WIDTH:])


def live(generated: torch.Tensor) -> torch.Tensor:
    """Which drawn tokens a sample keeps: each row's up to and including its first stop token (the pads after it are
    drawn from no computed distribution: the loop no longer runs a finished row)."""
    is_stop = torch.isin(generated, torch.tensor(STOPS)).long()
    return torch.cumsum(is_stop, -1) - is_stop == 0


def assert_same_draws(ours, theirs) -> None:
    assert torch.equal(ours[0], theirs[0])
    kept = live(ours[0][:, WIDTH:])
    torch.testing.assert_close(ours[1][kept], theirs[1][kept], rtol=0, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("model_type", sorted(KV_DECODE_MODEL_TYPES))
def test_greedy_the_kv_loop_gives_what_generate_gives(model_type):
    model = random_model(model_type, attention_bias=model_type == "llama")
    ours = draw(model, do_sample=False)
    assert_same_draws(ours, draw(model, do_sample=False, kv=False))
    generated = ours[0][:, WIDTH:]
    assert generated.shape[1] > 1 and generated.unique().numel() > 3  # real tokens, not one repeated
    stopped = torch.isin(generated, torch.tensor(STOPS)).any(-1)
    assert stopped.any() and (~stopped).any()  # rows that stopped (padded after, as generate pads) and rows that ran


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "gemma2"])
def test_under_bf16_autocast_the_kv_loop_gives_what_generate_gives(model_type):
    """The worker samples under autocast in rollout.dtype (bf16 where it is the faster): the cache takes the
    projections' dtype, and the tokens and log-probs stay generate's."""
    model = random_model(model_type)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, theirs = draw(model, do_sample=False), draw(model, do_sample=False, kv=False)
    assert_same_draws(ours, theirs)
    in_float32 = draw(model, do_sample=False)[1]
    assert (ours[1] - in_float32).nan_to_num().abs().max() > 1e-4  # bf16 did compute: other log-probs


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "gemma3_text"])
def test_sampled_log_probs_are_a_full_forwards_over_the_drawn_tokens(model_type):
    """The recorded log-probs of sampled tokens (temperature, top-k, top-p) equal those of one padded forward of the
    whole sequences through transformers, the same processors applied: the cache holds what a full forward sees."""
    model = random_model(model_type)
    sequences, recorded = draw(model, do_sample=True)
    input_ids, attention_mask = left_padded()
    mask = torch.cat([attention_mask, torch.ones_like(sequences[:, WIDTH:])], dim=-1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=mask, position_ids=positions).logits[:, WIDTH - 1 : -1]
    processors = sampling_processors(SamplingParams(do_sample=True, temperature=0.9, top_k=20, top_p=0.95))
    expected = []
    for step in range(logits.shape[1]):
        scores = logits[:, step].float()
        for processor in processors:
            scores = processor(sequences[:, : WIDTH + step], scores)
        expected.append(scores.log_softmax(-1).gather(-1, sequences[:, WIDTH + step, None]).squeeze(-1))
    kept = live(sequences[:, WIDTH:])
    assert kept.sum() > 20 and (~kept).any()  # tokens up to each row's stop, and padding after some
    torch.testing.assert_close(recorded[kept], torch.stack(expected, 1)[kept], rtol=0, atol=1e-4)


def test_a_categorical_draw_follows_the_probabilities_and_never_draws_an_excluded_token():
    """40,000 draws per row against softmax(scores): each frequency within 5 standard errors; a -inf score is never
    drawn, nor in a row whose whole mass sits on one token; the same generator seed draws the same tokens."""
    scores = torch.tensor(
        [[0.0, 1.0, 2.0, -float("inf"), 0.5], [3.0, -float("inf"), -1.0, 0.0, -float("inf")], [-float("inf")] * 4 + [0]]
    )
    draws = 40_000
    tokens = draw_categorical(scores.repeat_interleave(draws, 0), torch.Generator().manual_seed(0)).view(3, draws)
    probabilities = scores.softmax(-1)
    counts = torch.stack([torch.bincount(row, minlength=5) for row in tokens]).double() / draws
    standard_error = (probabilities * (1 - probabilities) / draws).sqrt().double()
    assert ((counts - probabilities.double()).abs() <= 5 * standard_error + 1e-12).all()
    assert counts[probabilities == 0].sum() == 0 and (tokens[2] == 4).all()
    again = draw_categorical(scores.repeat_interleave(draws, 0), torch.Generator().manual_seed(0)).view(3, draws)
    assert torch.equal(tokens, again)


class StopAtColumn(StoppingCriteria):
    """Ends every row once the sequences reach ``width`` columns (as a partial rollout's criterion ends a call)."""

    def __init__(self, width: int) -> None:
        self.width = width

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.width, dtype=torch.bool)


def test_a_stopping_criterion_ends_the_call_where_generate_ends_it():
    model = random_model("qwen2")
    ours = draw(model, False, StopAtColumn(WIDTH + 4))
    assert ours[0].shape[1] == WIDTH + 4
    assert_same_draws(ours, draw(model, False, StopAtColumn(WIDTH + 4), kv=False))
    assert draw(model, True, StopAtColumn(WIDTH + 3))[0].shape[1] == WIDTH + 3


@pytest.mark.parametrize("do_sample", [False, True])
def test_finished_rows_leave_the_batch_the_draws_unchanged(do_sample):
    """Once an eighth of the rows the layers run have finished, the loop drops them (their cached keys and values
    too): the tokens stay generate's (greedy) and the log-probs a full forward's (sampled: the other tests), and the
    layers ran fewer rows as rows finished, never fewer than the unfinished ones."""
    model = random_model("qwen2")
    rows_run = []
    model.model.layers[0].input_layernorm.register_forward_hook(lambda module, args, out: rows_run.append(len(out)))
    sequences, log_probs = draw(model, do_sample)
    if not do_sample:
        assert_same_draws((sequences, log_probs), draw(model, do_sample, kv=False))
    unfinished = live(sequences[:, WIDTH:]).sum(0)  # rows not finished before each step
    ran = rows_run[: len(unfinished)]  # the KV loop's steps (generate's forwards come after, when compared)
    assert ran[0] == 8 and ran[-1] < 8 and ran == sorted(ran, reverse=True)
    assert all(run >= int(left) for run, left in zip(ran, unfinished))


def test_a_lora_adapter_is_applied_in_the_kv_loop():
    model = get_peft_model(random_model("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    ours = draw(model, False)
    assert_same_draws(ours, draw(model, False, kv=False))
    with model.disable_adapter():
        assert not torch.equal(draw(model, False)[0], ours[0])


def test_phi3_with_partial_rotary_dimensions_gives_what_generate_gives():
    """Phi-3.5 / Phi-4-mini rotate only part of each head (``partial_rotary_factor``); the rest passes unrotated."""
    model = random_model("phi3", partial_rotary_factor=0.5)
    assert model.model.rotary_emb(torch.zeros(1), torch.arange(3)[None])[0].shape[-1] == 8  # half of head_dim 16
    assert_same_draws(draw(model, do_sample=False), draw(model, do_sample=False, kv=False))


def test_what_the_kv_loop_does_not_run():
    assert kv_decodable(random_model("qwen2"), 10_000)
    assert not kv_decodable(random_model("olmo"), 16)  # another family: generate
    windowed = random_model("mistral", sliding_window=12)
    assert kv_decodable(windowed, 12) and not kv_decodable(windowed, 13)  # the window would be reached
    layered = random_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert not kv_decodable(layered, 16)
    alternating = random_model("gemma3_text", sliding_window=12)  # Gemma 3: sliding and full layers
    assert kv_decodable(alternating, 12) and not kv_decodable(alternating, 13)


def test_the_hf_engine_draws_with_the_kv_loop_where_it_runs(config, monkeypatch):
    """On the project's tiny Qwen2 the engine's rollout goes through kv_generate (never generate); with
    rollout.enforce_eager=false on the CPU too (no compiled decode there)."""
    model, tokenizer = load_policy_model(config.actor_rollout_ref.model)
    calls = []
    monkeypatch.setattr(
        hf_engine, "kv_generate", lambda *args, **kwargs: calls.append(args) or kv_generate(*args, **kwargs)
    )
    monkeypatch.setattr(model, "generate", lambda **_: pytest.fail("generate ran"))
    for eager in (True, False):
        rollout = RolloutConfig(enforce_eager=eager, response_length=4, calculate_log_probs=True)
        engine = build_rollout_engine("hf", model=model, tokenizer=tokenizer, rollout_config=rollout)
        samples = engine.generate_tokens([[5, 6, 7], [8]], [4, 2], sampling_params(rollout, {}), seed=3)
        assert [len(sample.token_ids) <= budget for sample, budget in zip(samples, [4, 2])] == [True, True]
        assert all(len(sample.log_probs) == len(sample.token_ids) for sample in samples)
    assert len(calls) == 2
