"""The agent loops' keys: ``actor_rollout_ref.rollout.multi_turn`` (tool calling) and
``actor_rollout_ref.rollout.agent`` (which loop a row runs, an endpoint agent, how trajectories are batched). Part
of the run's configuration (:mod:`rl_core.config`, where the rest of the keys and their one default live)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts that call tools (:mod:`rl_core.agent.runner`); verl's names, and ppoflow's own last five.
    ``rollout.response_length`` bounds the whole response: the policy's turns, the tool answers and the glue."""

    enable: bool = False
    max_assistant_turns: int | None = None  # null: until a turn calls no tool or the response is full
    max_user_turns: int | None = None  # rounds of tool answers; null: no limit
    max_parallel_calls: int = 1  # calls per turn; the further ones are answered with an error
    max_tool_response_length: int = 256  # characters of one tool answer
    tool_response_truncate_side: str = "middle"  # left: keep the tail | middle: both ends | right: keep the head
    tool_config_path: str | None = None  # verl's tool YAML (rl_core.agent.tools.registry); null: no tools
    # verl's interaction YAML (rl_core.agent.interactions): simulated users a row picks by extra_info.interaction_kwargs
    interaction_config_path: str | None = None
    format: str = "hermes"  # hermes: <tool_call>{"name", "arguments"}</tool_call> | tag: <call>TEXT</call> (one tool)
    tool_timeout_s: float = 10.0  # one call's wall-clock limit; it is then cancelled and answered with an error
    max_concurrent_tools: int = 4  # calls in flight at once, per rollout worker
    max_tool_response_tokens: int = 64  # tokens of one tool answer (after the character cut)
    on_parse_error: str = "feedback"  # feedback: the error is the call's answer | stop: the trajectory ends


@dataclass
class EndpointAgentConfig:
    """The ``endpoint_agent`` loop (:mod:`rl_core.agent.endpoint`): a user's agent talks to the policy through an
    OpenAI-compatible chat-completions endpoint served on loopback for the rollout; set ``function`` or ``command``."""

    # "module:callable", called in the rollout worker as callable(base_url=..., api_key=..., row=...) in a thread
    function: str | None = None
    # or a program (argv list): OPENAI_BASE_URL, OPENAI_API_KEY and PPOFLOW_ROW (the row, JSON) in its environment
    command: list[str] | None = None
    # an agent's own time (wall clock outside its requests); past it the trajectory ends (agent_timeout)
    timeout_s: float = 60.0


@dataclass
class AgentConfig:
    """verl's ``rollout.agent``: which agent loop a row without an ``agent_name`` column runs."""

    # single_turn_agent | tool_agent (rl_core.agent.runner) | endpoint_agent (rl_core.agent.endpoint) | a loop of
    # agent_loop_config_path; null: tool_agent with multi_turn.enable, else single turn
    default_agent_loop: str | None = None
    endpoint: EndpointAgentConfig = field(default_factory=EndpointAgentConfig)
    # verl's agent-loop YAML, [{name, _target_: module.Class}]: loops of one's own (rl_core.agent.loops) rows may name
    agent_loop_config_path: str | None = None
    # rounds: every running trajectory's next turn generated together (the batch does not depend on timing: a re-run
    # step draws the same samples) | continuous: each trajectory proceeds on its own, a batch generated from whichever
    # wait for tokens (one waiting on a tool holds no one); by default rounds for async_training.mode=sync, else
    # continuous (rl_core.rollout_schedule.agent_batching)
    batching: str = "${agent_batching:${async_training.mode}}"
