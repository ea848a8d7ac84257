"""The OpenAI chat-completions protocol as the endpoint agent loop serves it (rl_core/agent/endpoint.py): requests
read and checked, answers and errors in OpenAI's shapes, and the loopback HTTP server with token auth.

Served, per trajectory (``base_url`` = ``http://127.0.0.1:PORT/trajectories/N/v1``)::

    POST {base_url}/chat/completions   messages, max_tokens | max_completion_tokens, tools, logprobs,
                                       skip_special_tokens (vLLM's extension; default false: the reply keeps the
                                       tokenizer's special tokens, the turn's stop token excepted)
    GET  {base_url}/models             the one model

Sampling is the run's (``rollout.temperature``/``top_p``/``top_k``, or ``val_kwargs`` in validation): a request's
``temperature``, ``top_p``, ``seed``, ``presence_penalty``, ... are read and not applied, so that the tokens trained
are drawn from the distribution whose log-probs are trained. What cannot be honoured is refused with a 400 naming the
field: ``n`` > 1, ``stream``, ``stop`` strings, content other than text. Every error is OpenAI's
``{"error": {"message", "type", "param", "code"}}``; a missing or wrong key is a 401.
"""

from __future__ import annotations

import hmac
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_BODY_BYTES = 8 << 20
ROUTE = re.compile(r"^/trajectories/(\d+)/v1/(chat/completions|models)$")
REFUSED_FIELDS = {
    "stream": "streaming is not served: ask for the whole reply",
    "stop": "stop strings are not applied: a turn ends on the policy's own stop tokens",
    "response_format": "structured output is not applied to the policy's sampling",
}


class ApiError(Exception):
    """A request answered with an OpenAI-style error."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "not_found_error", 409: "conflict_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error"
        )
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """A checked chat-completions request: ``messages`` as ``{"role", "content": str}`` (text parts joined; an
    assistant message's ``tool_calls`` dropped: the trajectory compares roles and texts), the OpenAI ``tools``, the
    token limit or None, whether to return log-probs and special tokens."""

    messages: list[dict[str, str]]
    tools: list[dict[str, Any]] | None
    max_tokens: int | None
    logprobs: bool
    skip_special_tokens: bool


def read_request(body: bytes) -> ChatRequest:
    """``body`` as a :class:`ChatRequest`, or an :class:`ApiError` (400) naming the field at fault."""
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"the request body is not JSON: {error}") from None
    if not isinstance(request, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, why in REFUSED_FIELDS.items():
        if request.get(name) not in (None, False, [], ""):
            raise ApiError(400, why, param=name, code="unsupported_parameter")
    if request.get("n", 1) not in (1, None):
        raise ApiError(400, "n must be 1: each trajectory's replies form one response", "n", "unsupported_parameter")
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages")
    limit = request.get("max_completion_tokens", request.get("max_tokens"))
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ApiError(400, f"max_tokens must be a positive integer, not {limit!r}", "max_tokens")
    tools = request.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(_is_function(tool) for tool in tools)):
        raise ApiError(400, 'tools must be a list of {"type": "function", "function": {"name", ...}}', "tools")
    return ChatRequest(
        [_message(message, index) for index, message in enumerate(messages)],
        tools or None,
        limit,
        bool(request.get("logprobs")),
        bool(request.get("skip_special_tokens", False)),
    )


def _is_function(tool: Any) -> bool:
    return isinstance(tool, dict) and isinstance(tool.get("function"), dict) and "name" in tool["function"]


def _message(message: Any, index: int) -> dict[str, str]:
    param = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user", "assistant", "tool"):
        raise ApiError(400, f"{param} must be an object with a role of system, user, assistant or tool", param)
    content = message.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        text = "".join(str(part.get("text", "")) for part in content)
    else:
        raise ApiError(400, f"{param}.content must be text (a string or text parts)", f"{param}.content")
    role = "system" if message["role"] == "developer" else message["role"]
    return {"role": role, "content": text}


def completion_body(
    model: str,
    content: str | None,
    tool_calls: list[dict[str, Any]],
    finish_reason: str,
    usage: tuple[int, int],
    token_log_probs: list[tuple[str, float]] | None,
) -> dict[str, Any]:
    """A chat.completion object with one choice; ``usage`` = (prompt tokens, completion tokens)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
    if token_log_probs is not None:
        choice["logprobs"] = {
            "content": [
                {"token": token, "logprob": value, "bytes": list(token.encode()), "top_logprobs": []}
                for token, value in token_log_probs
            ]
        }
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)},
    }


def openai_tool_calls(calls: list[Any]) -> list[dict[str, Any]]:
    """Parsed calls (:class:`rl_core.agent.parsers.ToolCall` without errors) as a message's ``tool_calls``."""
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for call in calls
    ]


Handler = Callable[[int, ChatRequest], dict[str, Any]]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # every trajectory's agent connects at the start of a rollout: socketserver's backlog of 5 drops the rest, whose
    # connections then wait for TCP's one-second SYN retry (measured: 2.4 s for 64 agents' first requests)
    request_queue_size = 1024


class ChatServer:
    """An HTTP server on 127.0.0.1 (a free port) that serves the routes of the module doc while it is open. Each
    request must carry ``Authorization: Bearer <api_key>``; ``handle(trajectory, request)`` answers a checked
    request (it may block until the reply is generated) or raises :class:`ApiError`."""

    def __init__(self, api_key: str, model: str, handle: Handler):
        self.api_key, self.model, self.handle = api_key, model, handle
        server = self

        class RequestHandler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: an agent's client reuses its connection
            disable_nagle_algorithm = True  # a small answer goes out at once, not after the client's delayed ACK
            timeout = 120  # an idle connection's thread ends after this

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY_BYTES:
                    self.close_connection = True  # its body is not read
                    error = ApiError(413, f"the request body is over {MAX_BODY_BYTES >> 20} MiB")
                    self._answer((error.status, error.body()))
                    return
                body = self.rfile.read(length)
                self._answer(server.route(self.path, self.headers.get("Authorization"), body, post=True))

            def do_GET(self) -> None:
                self._answer(server.route(self.path, self.headers.get("Authorization"), b"", post=False))

            def _answer(self, answer: tuple[int, dict[str, Any]]) -> None:
                status, body = answer
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self._headers_buffer.append(b"\r\n" + data)  # the headers and the body in one write
                self.flush_headers()

            def log_message(self, format: str, *args: Any) -> None:  # quiet: the rollout reports what matters
                pass

        self.httpd = _Server(("127.0.0.1", 0), RequestHandler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(  # its poll interval bounds how long close() waits for the loop to stop
            target=self.httpd.serve_forever, args=(0.02,), name="ppoflow-chat-api", daemon=True
        )
        self.thread.start()

    def base_url(self, trajectory: int) -> str:
        return f"http://127.0.0.1:{self.port}/trajectories/{trajectory}/v1"

    def route(self, path: str, authorization: str | None, body: bytes, post: bool) -> tuple[int, dict[str, Any]]:
        """(status, JSON body) of one request."""
        try:
            expected = f"Bearer {self.api_key}".encode()
            if not hmac.compare_digest((authorization or "").encode(), expected):
                raise ApiError(401, "missing or wrong API key (Authorization: Bearer <key>)", code="invalid_api_key")
            found = ROUTE.match(path.split("?")[0])
            if found is None:
                raise ApiError(404, f"no route {path}: use {{base_url}}/chat/completions", code="unknown_url")
            trajectory, what = int(found.group(1)), found.group(2)
            if what == "models":
                if post:
                    raise ApiError(405, "GET the models", code="method_not_allowed")
                return 200, {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "ppoflow"}]}
            if not post:
                raise ApiError(405, "POST a chat completion", code="method_not_allowed")
            return 200, self.handle(trajectory, read_request(body))
        except ApiError as error:
            return error.status, error.body()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
