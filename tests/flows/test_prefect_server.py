"""Prefect's temporary server (flows/prefect_server.py): a command stops it only after it recorded the command's runs,
so that a run that succeeded ends without the server's shutdown tracebacks, and no task run's last state is lost."""

import os
import sqlite3
import subprocess
import sys

from tests.conftest import ROOT

MANY_TASKS = """
import sys
from prefect import flow
from flows.prefect_server import configure_prefect, start_temporary_server, stop_temporary_server
from flows.stages import StageRunner

def stage(i):
    return i

@flow
def many(n):
    run_stage = StageRunner(retries=0)
    return sum(run_stage("stage", stage, i) for i in range(n))

configure_prefect()
start_temporary_server()()
import os
from prefect.client.orchestration import get_client
from flows.prefect_server import STARTED
threads = os.listdir(f"/proc/{STARTED['process'].pid}/task")  # once it answers: on the CPU time the run leaves idle
assert {os.sched_getscheduler(int(thread)) for thread in threads} == {os.SCHED_IDLE}, threads
assert str(get_client().api_url).startswith(STARTED["api_url"])  # Prefect's clients use the launched server
from flows.prefect_view import prefect_ui_url
assert prefect_ui_url() is None  # no links to a server that ends with the command (it serves no UI either)
many(int(sys.argv[1]))
# a second flow run deletes the task runs recorded so far (as a long run prunes its oldest): the stop does not wait
# for those
from datetime import datetime, timezone
from flows.prefect_view import delete_task_runs_before
import time
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
pruned = str(many(20, return_state=True).state_details.flow_run_id)
with get_client(sync_client=True) as client:  # some of them recorded (the recorder writes every second)
    while not client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[pruned]))):
        time.sleep(0.1)
print("deleted", delete_task_runs_before(pruned, datetime.now(timezone.utc)))
stop_temporary_server(timeout_s=20)
assert "PREFECT_API_URL" not in os.environ  # a later flow of this process is not pointed at the ended server
"""


def test_the_temporary_server_stops_after_recording_every_task_run(tmp_path):
    # 100 + 20 task runs in ~1 s leave the server's task-run recorder a backlog of several seconds at the flow's end
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", MANY_TASKS, "100"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in output and " ERROR " not in output, output[-3000:]
    assert "stops without the rest" not in output, output[-3000:]  # what it had to record, it recorded
    assert "Beginning flow run" in output and "View at" not in output  # Prefect's own link to the UI neither
    deleted = int(output.split("deleted ")[1].split()[0])
    with sqlite3.connect(tmp_path / "prefect.db") as db:
        states = dict(db.execute("select state_type, count(*) from task_run group by state_type").fetchall())
        names = {name for (name,) in db.execute("select distinct name from task_run")}
    assert 0 < deleted <= 20 and states == {"COMPLETED": 120 - deleted}
    assert names == {"step-0/stage"}  # named by the runner's step, read when each task run starts
