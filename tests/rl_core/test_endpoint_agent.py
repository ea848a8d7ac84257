"""The endpoint agent loop (rl_core/agent/endpoint.py): a user's agent trains through an OpenAI-compatible endpoint.

Agents here talk to it with the real ``openai`` client (and raw ``httpx`` for malformed requests) over loopback HTTP.
The exactness tests use ``ScriptedEngine`` (fixed turns, test_agent_loop.py); one runs the real HF engine on the tiny
model and recomputes the log-probs of the assembled batch."""

import json
import sys
import time

import httpx
import openai
import pytest
import torch
from omegaconf import OmegaConf

from rl_core.agent.checks import check_multi_turn
from rl_core.agent.loops import AgentLoopBase, AgentLoopOutput
from rl_core.agent.runner import MultiTurnRollout
from rl_core.agent.tools.registry import load_tools
from rl_core.config import DataConfig, RolloutConfig
from rl_core.config_checks import ConfigValueError
from rl_core.metrics import multi_turn_metrics
from rl_core.models.loading import load_policy_model
from rl_core.rollout import build_rollout_engine
from tests.rl_core.helpers import addition_dataset, response_logits
from tests.rl_core.test_agent_loop import (
    CALC_TOOLS,
    ScriptedEngine,
    batch_rows,
    prompt_keys,
    prompts_of,
    run,
    turn,
    write,
)

AGENTS = "tests.rl_core.test_endpoint_agent"


def endpoint_config(
    agent: str | None = None, command: list[str] | None = None, timeout_s: float = 60.0, batching="rounds", **multi_turn
):
    config = OmegaConf.structured(RolloutConfig(prompt_length=16, response_length=256, generation_batch_size=2))
    endpoint = {"function": agent, "command": command, "timeout_s": timeout_s}
    agent_config = {"default_agent_loop": "endpoint_agent", "endpoint": endpoint, "batching": batching}
    return OmegaConf.merge(config, {"multi_turn": multi_turn, "agent": agent_config})


def run_endpoint(tokenizer, prompts, script, config, tools=None):
    engine = ScriptedEngine(dict(zip(prompt_keys(prompts), script)), [tokenizer.eos_token_id])
    rollout = MultiTurnRollout(engine, tokenizer, config, tools or {})
    return rollout.generate_sequences(prompts), engine


def client(base_url, api_key):
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)


# ---------------------------------------------------------------------------------------------- the trajectory
@pytest.mark.parametrize("batching", ["rounds", "continuous"])
def test_the_calc_agent_through_the_endpoint_gives_the_tool_loops_batch_exactly(tmp_path, tokenizer, batching):
    """The demo's calc agent (an OpenAI client that runs the calculator itself) and the built-in tool loop with the
    calculator (format tag, two assistant turns) over the same scripted policy: the same token ids, masks, log-probs,
    prompts and turn counts; in rounds generated in the same chunks with the same seeds."""
    prompts = prompts_of(tmp_path, tokenizer, 5)
    script = [
        [turn(tokenizer, "<call>37*48</call>"), turn(tokenizer, "1776")],
        [turn(tokenizer, "12")],  # no call: one turn
        [turn(tokenizer, "<call>2*3</call>"), turn(tokenizer, "<call>1+1</call>")],  # the second call is not run
        [turn(tokenizer, "<call>2*</call><call>5-1</call>"), turn(tokenizer, "4")],  # an error and an answer
        [turn(tokenizer, "<call>9*9"), turn(tokenizer, "81")],  # a call without its end tag: told so
    ]
    settings = {"enable": True, "format": "tag", "max_assistant_turns": 2, "max_parallel_calls": 4}
    loop, loop_engine = run(tokenizer, prompts, script, load_tools(CALC_TOOLS), batching, **settings)
    config = endpoint_config("rl_core.agent.demo_agents:calc_agent", batching=batching, **settings)
    endpoint, endpoint_engine = run_endpoint(tokenizer, prompts, script, config, load_tools(CALC_TOOLS))
    assert set(endpoint.tensors) == set(loop.tensors)
    for key in loop.tensors:
        assert torch.equal(endpoint.tensors[key], loop.tensors[key]), key
    if batching == "rounds":  # the same contexts, budgets and seeds, chunk by chunk
        assert endpoint_engine.calls == loop_engine.calls
    assert list(endpoint.non_tensors["num_turns"]) == list(loop.non_tensors["num_turns"]) == [4, 2, 4, 4, 4]
    answers = [[c["answer"] for c in info["tool_calls"]] for info in endpoint.non_tensors["multi_turn"]]
    assert answers == [[c["answer"] for c in info["tool_calls"]] for info in loop.non_tensors["multi_turn"]]
    assert answers[0] == ["1776"] and answers[3][1] == "4" and answers[3][0].startswith("error:")
    info = endpoint.non_tensors["multi_turn"][0]
    assert info["finish_reason"] == "stop" and info["endpoint_calls"] == 2 and info["agent_error"] is None


def system_and_follow_up_agent(base_url, api_key, row):
    """A system message of its own, then a user follow-up after the first reply; asks for log-probs; returns them."""
    messages = [{"role": "system", "content": "Add."}, *row["prompt"]]
    received = []
    for follow_up in ("Again?", None):
        reply = client(base_url, api_key).chat.completions.create(
            model="any", messages=messages, logprobs=True, max_tokens=6
        )
        received += [entry.logprob for entry in reply.choices[0].logprobs.content]
        if follow_up is None:
            return received
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
        messages += [{"role": "user", "content": follow_up}]


@pytest.mark.parametrize("batching", ["rounds", "continuous"])
def test_the_trained_sequence_is_what_the_policy_was_sampled_from(tmp_path, config, batching):
    """Real sampling (the HF engine on the tiny model): the batch's prompt is the agent's first request as the chat
    template renders it (its own system message included), the follow-up is in the response unmasked-out, and the
    log-probs the model gives the assembled sequence at the trained positions are the sampler's, which are also the
    ones the agent received."""
    model, tokenizer = load_policy_model(config.actor_rollout_ref.model)
    rollout = config.actor_rollout_ref.rollout
    rollout.agent.default_agent_loop = "endpoint_agent"
    rollout.agent.endpoint.function = f"{AGENTS}:system_and_follow_up_agent"
    rollout.response_length, rollout.calculate_log_probs, rollout.agent.batching = 32, True, batching
    data = OmegaConf.structured(DataConfig(max_prompt_length=40, max_response_length=32))
    prompts = addition_dataset(tmp_path, tokenizer, data, count=3).collate([0, 1, 2])
    engine = build_rollout_engine("hf", model=model, tokenizer=tokenizer, rollout_config=rollout)
    out = MultiTurnRollout(engine, tokenizer, rollout, tools={}).generate_sequences(prompts)

    first = [{"role": "system", "content": "Add."}, *prompts.non_tensors["raw_prompt"][0]]
    rendered = tokenizer(tokenizer.apply_chat_template(first, add_generation_prompt=True, tokenize=False))
    width = out.tensors["prompts"].shape[1]
    prompt = out.tensors["prompts"][0][out.tensors["attention_mask"][0, :width].bool()]
    assert prompt.tolist() == rendered["input_ids"]
    mask = out.tensors["response_mask"].bool()
    predicted = torch.log_softmax(response_logits(model, out).float(), dim=-1)
    recomputed = predicted.gather(-1, out.tensors["responses"].unsqueeze(-1)).squeeze(-1)
    sampled = out.tensors["rollout_log_probs"]
    assert torch.allclose(recomputed[mask], sampled[mask], atol=1e-4)
    for row, info in enumerate(out.non_tensors["multi_turn"]):
        assert info["endpoint_calls"] == 2 and info["untrained_calls"] == 0
        assert torch.allclose(torch.tensor(info["agent_output"]), sampled[row][mask[row]], atol=1e-6)
        length = int(out.tensors["attention_mask"][row, width:].sum())
        untrained = out.tensors["responses"][row, :length][~mask[row, :length]]
        assert "Again?" in tokenizer.decode(untrained)


def sleepy_agent(base_url, api_key, row):
    """Asks twice; the first row's agent works 1 s on its own between its requests."""
    messages = list(row["prompt"])
    for follow_up in ("Again?", None):
        reply = client(base_url, api_key).chat.completions.create(model="m", messages=messages)
        if follow_up is None:
            return reply.choices[0].message.content
        if row["extra_info"]["index"] == 0:
            time.sleep(1.0)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
        messages += [{"role": "user", "content": follow_up}]


def test_with_continuous_batching_a_slow_agent_holds_no_one(tmp_path, tokenizer):
    """Three agents ask twice; the first one works 1 s between its requests. In rounds the others' second requests
    wait for it (one batch of all three); continuously they are answered meanwhile and its own comes last, alone."""
    prompts = prompts_of(tmp_path, tokenizer, 3)
    script = [[turn(tokenizer, "12"), turn(tokenizer, "34")]] * 3
    for batching in ("rounds", "continuous"):
        config = OmegaConf.merge(
            endpoint_config(f"{AGENTS}:sleepy_agent", batching=batching), {"generation_batch_size": 4}
        )
        out, engine = run_endpoint(tokenizer, prompts, script, config)
        batches = batch_rows(prompts, engine)
        assert [info["final_answer"] for info in out.non_tensors["multi_turn"]] == ["34"] * 3
        waited = multi_turn_metrics(list(out.non_tensors["num_turns"]), list(out.non_tensors["multi_turn"]))
        assert 0.9 <= waited["timing_s/tools"] < 1.5, batching  # generation waited for the slow agent's second once
        if batching == "rounds":
            assert batches == [[0, 1, 2], [0, 1, 2]]
        else:
            assert batches[-1] == [0] and sorted(row for batch in batches[:-1] for row in batch) == [0, 1, 1, 2, 2]


# ---------------------------------------------------------------------------------------------- bad input
def misbehaving_agent(base_url, api_key, row):
    """What each row's agent does wrong (by the row's index)."""
    index = row["extra_info"]["index"]
    messages = list(row["prompt"])
    if index == 0:  # malformed requests, then one good call
        errors = []
        headers = {"Authorization": f"Bearer {api_key}"}
        answer = httpx.post(f"{base_url}/chat/completions", content=b"{not json", headers=headers)
        errors.append((answer.status_code, answer.json()["error"]["type"]))
        for call in (
            lambda: client(base_url, "wrong-key").chat.completions.create(model="m", messages=messages),
            lambda: client(base_url, api_key).chat.completions.create(model="m", messages=messages, n=2),
            lambda: client(base_url, api_key).chat.completions.create(model="m", messages=[]),
            lambda: client(base_url, api_key).chat.completions.create(model="m", messages=messages, stop=["x"]),
        ):
            try:
                call()
            except openai.APIStatusError as error:
                errors.append((error.status_code, error.body["type"] if error.body else None))
        client(base_url, api_key).chat.completions.create(model="m", messages=messages)
        return errors
    if index == 1:  # raises after one call
        client(base_url, api_key).chat.completions.create(model="m", messages=messages)
        raise RuntimeError("the agent's own bug")
    if index == 2:  # hangs after one call
        client(base_url, api_key).chat.completions.create(model="m", messages=messages)
        time.sleep(30)
    if index == 3:  # makes no request
        return None
    # a retried request, then one that rewrites the conversation
    first = client(base_url, api_key).chat.completions.create(model="m", messages=messages)
    again = client(base_url, api_key).chat.completions.create(model="m", messages=messages)
    assert again.choices[0].message.content == first.choices[0].message.content
    rewritten = [*messages, {"role": "assistant", "content": "not what it said"}, {"role": "user", "content": "?"}]
    client(base_url, api_key).chat.completions.create(model="m", messages=rewritten)
    return "rewrote"


def test_bad_requests_get_openai_errors_and_failing_agents_end_their_trajectories(tmp_path, tokenizer):
    prompts = prompts_of(tmp_path, tokenizer, 5)
    script = [[turn(tokenizer, "12"), turn(tokenizer, "34")]] * 5
    config = endpoint_config(f"{AGENTS}:misbehaving_agent", timeout_s=1.5)
    started = time.perf_counter()
    out, engine = run_endpoint(tokenizer, prompts, script, config)
    assert time.perf_counter() - started < 5  # the hanging agent is given up on after its 1.5 s
    infos = list(out.non_tensors["multi_turn"])
    assert infos[0]["agent_output"] == [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (400, "invalid_request_error"),
        (400, "invalid_request_error"),
        (400, "invalid_request_error"),
    ]
    assert [info["finish_reason"] for info in infos] == ["stop", "agent_error", "agent_timeout", "agent_error", "stop"]
    assert "RuntimeError: the agent's own bug" in infos[1]["agent_error"]
    assert "timed out after 1.5 s" in infos[2]["agent_error"]
    assert infos[3]["agent_error"] == "the agent made no request"
    mask, attention = out.tensors["response_mask"], out.tensors["attention_mask"][:, 16:]
    assert mask[3].sum() == 0 and attention[3].sum() == 1  # one untrained EOS token
    assert out.tensors["responses"][3, 0] == tokenizer.eos_token_id
    # the trajectories that failed keep what they had: one turn each
    assert [int(m.sum()) for m in mask[:3]] == [len(turn(tokenizer, "12"))] * 3
    # the retried request was answered from the record (generated once); the rewritten one served, not trained
    assert infos[4]["endpoint_calls"] == 2 and infos[4]["untrained_calls"] == 1
    assert mask[4].sum() == len(turn(tokenizer, "12"))
    assert sum(len(contexts) for contexts, _, _ in engine.calls) == 1 + 1 + 1 + 0 + 2


def test_a_command_agent_gets_its_url_key_and_row_in_its_environment(tmp_path, tokenizer):
    program = (
        "import json, os, openai\n"
        "row = json.loads(os.environ['PPOFLOW_ROW'])\n"
        "client = openai.OpenAI(max_retries=0)\n"  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
        "reply = client.chat.completions.create(model='m', messages=row['prompt'])\n"
        "if row['extra_info']['index'] == 1:\n"
        "    raise SystemExit('failed on purpose')\n"
        "print('working...')\n"
        "print(json.dumps({'said': reply.choices[0].message.content}))\n"
    )
    prompts = prompts_of(tmp_path, tokenizer, 2)
    script = [[turn(tokenizer, "12")], [turn(tokenizer, "34")]]
    out, _ = run_endpoint(tokenizer, prompts, script, endpoint_config(command=[sys.executable, "-c", program]))
    infos = list(out.non_tensors["multi_turn"])
    assert infos[0]["agent_output"] == {"said": "12"} and infos[0]["finish_reason"] == "stop"
    assert infos[1]["finish_reason"] == "agent_error" and "failed on purpose" in infos[1]["agent_error"]
    assert out.tensors["response_mask"].sum(-1).tolist() == [len(turn(tokenizer, "12"))] * 2


def test_the_config_refuses_an_endpoint_agent_that_cannot_run():
    def check(**endpoint):
        config = OmegaConf.structured(RolloutConfig())
        config.agent.default_agent_loop, config.agent.batching = "endpoint_agent", "rounds"
        config.agent.endpoint = OmegaConf.merge(config.agent.endpoint, endpoint)
        check_multi_turn(config)

    with pytest.raises(ConfigValueError, match="endpoint_agent needs an agent: set .*endpoint.function"):
        check()
    with pytest.raises(ConfigValueError, match="exactly one of"):
        check(function=f"{AGENTS}:misbehaving_agent", command=["true"])
    with pytest.raises(ConfigValueError, match="cannot be loaded"):
        check(function="no_such_module:agent")
    with pytest.raises(ConfigValueError, match="module.path:callable"):
        check(function="misbehaving_agent")
    check(function=f"{AGENTS}:misbehaving_agent")


def tools_agent(base_url, api_key, row):
    """Lists the models, then asks with the calculator's schema as its tools."""
    api = client(base_url, api_key)
    tools = [load_tools(CALC_TOOLS)["calculator"].tool_schema]
    reply = api.chat.completions.create(model="m", messages=row["prompt"], tools=tools)
    return [model.id for model in api.models.list()], reply


def test_a_served_request_carries_openais_shape(tmp_path, tokenizer):
    """The reply as the client reads it: one choice, the usage in tokens, the model listed; tool calls parsed when the
    request gave tools (format hermes)."""
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    prompts = prompts_of(tmp_path, tokenizer, 1)
    out, _ = run_endpoint(tokenizer, prompts, [[turn(tokenizer, call)]], endpoint_config(f"{AGENTS}:tools_agent"))
    models, reply = out.non_tensors["multi_turn"][0]["agent_output"]
    assert models == ["ppoflow-policy"]
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "calculator" and json.loads(tool_call.function.arguments) == {"expression": "2*3"}
    assert reply.usage.completion_tokens == len(turn(tokenizer, call))
    assert reply.usage.prompt_tokens == int(out.tensors["attention_mask"][0, :16].sum())


# ---------------------------------------------------------------------------------------------- loops of one's own
class TwoTurnLoop(AgentLoopBase):
    """Asks twice, with a fixed user message between the turns (its tokens not the policy's); or, for a row whose
    index is 2, returns a mask of the wrong length."""

    async def run(self, sampling_params, **row):
        text = self.tokenizer.apply_chat_template(row["raw_prompt"], add_generation_prompt=True, tokenize=False)
        prompt = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        first = await self.server_manager.generate("a", prompt_ids=prompt, sampling_params=sampling_params)
        nudge = self.tokenizer("\nagain?\n", add_special_tokens=False)["input_ids"]
        second = await self.server_manager.generate("b", prompt_ids=prompt + first.token_ids + nudge)
        ids = first.token_ids + nudge + second.token_ids
        mask = [1] * len(first.token_ids) + [0] * len(nudge) + [1] * len(second.token_ids)
        if row["extra_info"]["index"] == 2:
            mask = mask[:-1]
        log_probs = first.log_probs + [0.0] * len(nudge) + second.log_probs
        return AgentLoopOutput(prompt, ids, mask, log_probs, num_turns=3, extra_fields={"sampling": sampling_params})


def test_an_agent_loop_of_ones_own_runs_from_verls_yaml(tmp_path, tokenizer):
    """A loop class listed in verl's agent-loop YAML runs the rows that name it, beside built-in loops in one batch:
    its trajectory is the tokens it returned (the policy's masked in), its requests generated in rounds; a loop that
    returns a malformed trajectory ends it as an agent error; an unknown name is refused, naming the known ones."""
    loops = write(tmp_path / "loops.yaml", f"- name: two_turns\n  _target_: {AGENTS}.TwoTurnLoop\n")
    prompts = prompts_of(tmp_path, tokenizer, 3)
    prompts.non_tensors["agent_name"][:] = ["two_turns", "single_turn_agent", "two_turns"]
    script = [[turn(tokenizer, "12"), turn(tokenizer, "34")], [turn(tokenizer, "5")], [turn(tokenizer, "6")] * 2]
    config = OmegaConf.merge(endpoint_config(), {"agent": {"default_agent_loop": None}})
    config.agent.agent_loop_config_path = str(loops)
    out, engine = run_endpoint(tokenizer, prompts, script, config)
    nudge = tokenizer("\nagain?\n", add_special_tokens=False)["input_ids"]
    expected = turn(tokenizer, "12") + nudge + turn(tokenizer, "34")
    length = len(expected)
    assert out.tensors["responses"][0, :length].tolist() == expected
    mask = [1] * len(turn(tokenizer, "12")) + [0] * len(nudge) + [1] * len(turn(tokenizer, "34"))
    assert out.tensors["response_mask"][0].tolist() == mask + [0] * (256 - length)
    assert torch.equal(out.tensors["rollout_log_probs"][0, :length], -0.5 * torch.tensor(mask, dtype=torch.float32))
    infos = list(out.non_tensors["multi_turn"])
    assert infos[0]["finish_reason"] == "stop" and infos[0]["final_answer"] == "34"
    assert infos[0]["agent_output"] == {"sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1}}
    assert list(out.non_tensors["num_turns"]) == [3, 2, 1]
    assert infos[2]["finish_reason"] == "agent_error" and "response_mask entries" in infos[2]["agent_error"]
    # round 0: the single-turn row (the tool loop), then the loops' first turns; round 1: their second turns
    assert [len(contexts) for contexts, _, _ in engine.calls] == [1, 2, 2]

    prompts.non_tensors["agent_name"][:] = ["react", "", ""]
    with pytest.raises(ValueError, match="agent_name is react: no agent loop of that name .*two_turns"):
        run_endpoint(tokenizer, prompts, script, config)
    config.agent.agent_loop_config_path = str(write(tmp_path / "bad.yaml", "- name: x\n  _target_: no.such.Loop\n"))
    cannot = "agent_loop_config_path: .*bad.yaml: entry 0: cannot import class_name 'no.such.Loop'"
    with pytest.raises(ConfigValueError, match=cannot):
        check_multi_turn(config)
