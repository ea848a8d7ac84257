"""The calls to Prefect's API that the training run makes off the step's path (flows/prefect_view.py::ApiCalls)."""

from __future__ import annotations

import logging
import threading

from flows.prefect_view import ApiCalls


def test_a_step_never_waits_for_the_api_and_only_the_latest_call_of_a_kind_is_made():
    made: list[str] = []
    first_started, server_answers = threading.Event(), threading.Event()

    def slow_progress() -> None:  # the server busy: the call waits until the test lets it answer
        first_started.set()
        server_answers.wait(30)
        made.append("progress 1")

    calls = ApiCalls()
    calls.submit("progress", slow_progress)
    assert first_started.wait(10)
    # while that call waits on the server, the step goes on: these submissions return at once (a blocking submit
    # would hang here, the answer being released only below)
    calls.submit("progress", lambda: made.append("progress 2"))
    calls.submit("prune", lambda: made.append("prune 1"))
    calls.submit("progress", lambda: made.append("progress 3"))
    calls.submit("prune", lambda: made.append("prune 2"))
    assert made == []
    server_answers.set()
    calls.close(timeout_s=10)
    assert not calls.is_alive()
    # progress 2 and prune 1 were replaced before they were made; the kinds in the order first submitted
    assert made == ["progress 1", "progress 3", "prune 2"]


def test_a_failing_call_is_logged_and_the_next_ones_are_still_made(caplog):
    made: list[str] = []

    def api_away() -> None:
        raise ConnectionError("the Prefect server is restarting")

    calls = ApiCalls()
    with caplog.at_level(logging.WARNING, logger="ppoflow"):
        calls.submit("progress", api_away)
        calls.submit("prune", lambda: made.append("prune"))
        calls.close(timeout_s=10)
    assert made == ["prune"]
    assert "Prefect API call 'progress' failed: the Prefect server is restarting" in caplog.text
