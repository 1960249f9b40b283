"""Run ``airflow dags test`` for several DAGs in one process and report each run as JSON.

``python -m tests.e2e.dags_test_runner PLAN.json RESULT.json``

Every ``airflow dags test`` process spends most of its time importing Airflow and building the
in-process execution API (cached per process). Running the example DAGs one after another in
one process, through Airflow's own CLI parser and ``dags test`` command, keeps the suite within
minutes. The plan is a list of ``{"dag_id", "dag_file", "conf", "env"}``; ``env`` is applied
for that run only (connections are read from the environment when a task runs). The result
maps each dag_id to ``{"ok", "error", "seconds", "run_id", "tasks": {task_id[map]: state},
"xcom": {task_id[map]: return value}}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def _task_states(dag_id: str) -> tuple[str | None, dict[str, str | None], dict[str, Any]]:
    """States and return values (XCom) of the task instances of the newest run of ``dag_id``."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        run = session.scalars(
            select(DagRun).where(DagRun.dag_id == dag_id).order_by(DagRun.id.desc()).limit(1)
        ).first()
        if run is None:
            return None, {}, {}
        states: dict[str, str | None] = {}
        for ti in session.scalars(
            select(TaskInstance).where(TaskInstance.dag_id == dag_id, TaskInstance.run_id == run.run_id)
        ):
            name = ti.task_id if ti.map_index < 0 else f"{ti.task_id}[{ti.map_index}]"
            states[name] = None if ti.state is None else str(getattr(ti.state, "value", ti.state))
        values: dict[str, Any] = {}
        for row in session.scalars(
            select(XComModel).where(
                XComModel.dag_id == dag_id, XComModel.run_id == run.run_id, XComModel.key == "return_value"
            )
        ):
            name = row.task_id if row.map_index < 0 else f"{row.task_id}[{row.map_index}]"
            values[name] = XComModel.deserialize_value(row)
        return run.run_id, states, values


def run_plan(plan: list[dict[str, Any]], result_file: Path) -> None:
    from airflow.cli import cli_parser

    parser = cli_parser.get_parser()
    results: dict[str, Any] = {}
    for item in plan:
        dag_id = item["dag_id"]
        saved = {k: os.environ.get(k) for k in item.get("env", {})}
        os.environ.update(item.get("env", {}))
        argv = ["dags", "test", dag_id]
        if item.get("dag_file"):
            argv += ["-f", item["dag_file"]]
        if item.get("conf"):
            argv += ["-c", json.dumps(item["conf"])]
        started = time.monotonic()
        error = None
        try:
            args = parser.parse_args(argv)
            args.func(args)
        except SystemExit as exc:  # "DagRun failed" or a bad argument
            error = f"SystemExit: {exc.code}"
        except Exception:
            error = traceback.format_exc()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        run_id, tasks, xcom = _task_states(dag_id)
        results[dag_id] = {
            "ok": error is None,
            "error": error,
            "seconds": round(time.monotonic() - started, 1),
            "run_id": run_id,
            "tasks": tasks,
            "xcom": xcom,
        }
        # Written after every DAG, so a crash or timeout still leaves the earlier results.
        result_file.write_text(json.dumps(results, indent=2, default=str))
        print(f"[dags_test_runner] {dag_id}: {'ok' if error is None else 'FAILED'}", flush=True)


def run_in_subprocess(
    plan: list[dict[str, Any]], work: Path, env: dict[str, str], timeout: float
) -> tuple[dict[str, Any], str]:
    """Run ``plan`` in a child process (``env``, in ``work``): its results and what it printed."""
    import subprocess

    plan_file, result_file = work / "plan.json", work / "results.json"
    plan_file.write_text(json.dumps(plan))
    result_file.unlink(missing_ok=True)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.e2e.dags_test_runner", str(plan_file), str(result_file)],
            env=env,
            cwd=work,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
        )
        log = proc.stdout
    except subprocess.TimeoutExpired as exc:
        log = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        log += f"\n(the runs did not finish within {timeout}s)"
    (work / "runner.log").write_text(log)
    return (json.loads(result_file.read_text()) if result_file.exists() else {}), log


def main(argv: list[str]) -> int:
    if os.environ.get("BATCH_TEST_SNOWFLAKE_HTTP"):
        # The Snowflake emulator speaks HTTP, which the provider's hook cannot ask for.
        from tests.fixtures.snowflake import use_http

        use_http()
    plan_file, result_file = Path(argv[0]), Path(argv[1])
    run_plan(json.loads(plan_file.read_text()), result_file)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
