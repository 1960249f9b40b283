"""``airflow-batch validate`` and ``airflow-batch prepare`` through the real CLI entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from airflow_batch_provider.cli import main
from airflow_batch_provider.dialects import DIALECTS


def line(cid: str, url: str = "/v1/chat/completions", **body: Any) -> bytes:
    body = body or {"model": "m", "messages": [{"role": "user", "content": f"hi {cid}"}]}
    return orjson.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_validate_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = write(tmp_path / "ok.jsonl", [line(str(i)) for i in range(3)])
    assert main(["validate", str(f)]) == 0
    out = capsys.readouterr().out
    assert "ok, 3 line(s)" in out and "dialect openai" in out


def test_validate_prints_every_problem_with_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = write(
        tmp_path / "bad.jsonl",
        [
            line("a"),
            b"{not json",
            line("a"),
            line("b", url="/v1/embeddings", input="x", model="m"),
            orjson.dumps(
                {
                    "custom_id": "c",
                    "method": "GET",
                    "url": "/v1/chat/completions",
                    "body": {"model": "m", "messages": []},
                }
            ),
            line("d", messages=[], stream=True),
            b"\xff\xfe",
        ],
    )
    assert main(["validate", str(f)]) == 1
    out = capsys.readouterr().out.splitlines()
    # One line number: the parser's own "line 1 column N" would name a second one.
    assert (
        f"{f}:line 2: not valid JSON: unexpected character, expected a string key at column 2 [invalid_json]"
        == out[0]
    )
    assert "line 3" in out[1] and "[duplicate_custom_id]" in out[1]
    assert "line 4" in out[2] and "[mismatched_url]" in out[2]
    assert "line 5" in out[3] and "[invalid_method]" in out[3]
    assert "line 6" in out[4] and "[stream_not_supported]" in out[4]
    assert "line 7" in out[5] and "[invalid_utf8]" in out[5]
    assert out[-1].endswith("6 problem(s) in 7 line(s), " + f"{f.stat().st_size:,} bytes [dialect openai]")


def test_validate_limits_endpoint_and_dialect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = write(tmp_path / "f.jsonl", [line(str(i)) for i in range(5)])
    assert main(["validate", str(f), "--max-lines", "4"]) == 1
    assert "file: file has 5 lines; the limit is 4 [too_many_lines]" in capsys.readouterr().out
    assert main(["validate", str(f), "--endpoint", "/v1/embeddings"]) == 1
    assert capsys.readouterr().out.count("[mismatched_url]") == 5
    assert main(["validate", str(f), "--max-line-bytes", "20", "--max-problems", "2"]) == 1
    out = capsys.readouterr().out
    assert out.count("[line_too_large]") == 2 and "5 problem(s) (3 not shown)" in out
    assert main(["validate", str(f), "--dialect", "xai"]) == 0


def test_prepare_sets_model_in_place_and_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = write(
        tmp_path / "in.jsonl",
        [
            line("1", messages=[{"role": "user", "content": "hi"}]),
            b"",
            line("2", model="old", messages=[{"role": "user", "content": "é😀"}]),
        ],
    )
    out = tmp_path / "out.jsonl"
    assert (
        main(["prepare", str(f), "--model", "gpt-x", "--output", str(out), "--endpoint", "/v1/responses"])
        == 0
    )
    rows = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    assert [r["body"]["model"] for r in rows] == ["gpt-x", "gpt-x"]
    assert {r["url"] for r in rows} == {"/v1/responses"}
    assert rows[1]["body"]["messages"][0]["content"] == "é😀"
    before = f.read_bytes()
    assert orjson.loads(before.splitlines()[0])["body"].get("model") is None  # input untouched
    assert main(["prepare", str(f), "--model", "m2"]) == 0
    rows = [orjson.loads(x) for x in f.read_bytes().splitlines()]
    assert [r["body"]["model"] for r in rows] == ["m2", "m2"]
    assert {r["url"] for r in rows} == {"/v1/chat/completions"}
    assert "set model 'm2' on 2 line(s)" in capsys.readouterr().out
    assert main(["validate", str(f)]) == 0


def test_prepare_refuses_a_bad_line_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = write(tmp_path / "in.jsonl", [line("1"), b"[1, 2]", line("3")])
    before = f.read_bytes()
    assert main(["prepare", str(f), "--model", "m"]) == 1
    assert f"airflow-batch prepare: {f}:line 2: not a JSON object" in capsys.readouterr().err
    assert f.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_cli_entry_point_runs_as_a_process(tmp_path: Path) -> None:
    f = write(tmp_path / "bad.jsonl", [line("a"), line("a")])
    proc = subprocess.run(
        [sys.executable, "-m", "airflow_batch_provider.cli", "validate", str(f)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert "line 2: custom_id 'a' is repeated [duplicate_custom_id]" in proc.stdout


def _cli(*args: str, stdin: bytes | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "airflow_batch_provider.cli", *args],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        cwd=cwd,
        capture_output=True,
        text=True,
        input=None if stdin is None else stdin.decode(),
        timeout=120,
    )


def _one_line_error(proc: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_unknown_dialect_is_a_usage_error_like_serve(tmp_path: Path) -> None:
    f = write(tmp_path / "f.jsonl", [line("1")])
    err = _one_line_error(_cli("validate", str(f), "--dialect", "nope"), 2, "--dialect", "'nope'")
    for name in ("doubleword", "openai", "xai", "zerogpu"):
        assert name in err
    _one_line_error(_cli("serve", "--dialect", "nope"), 2, "--dialect", "'nope'")


def test_bad_flag_and_missing_argument_are_usage_errors(tmp_path: Path) -> None:
    f = write(tmp_path / "f.jsonl", [line("1")])
    _one_line_error(_cli("validate", str(f), "--no-such-flag"), 2, "--no-such-flag")
    _one_line_error(_cli("prepare", str(f)), 2, "--model")
    _one_line_error(_cli("validate", str(f), "--max-lines", "many"), 2, "--max-lines", "'many'")
    _one_line_error(_cli("frobnicate"), 2, "frobnicate")


def test_missing_file_is_one_line_and_exit_1(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    _one_line_error(_cli("validate", str(missing)), 1, str(missing), "No such file")
    _one_line_error(_cli("prepare", str(missing), "--model", "m"), 1, str(missing), "No such file")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    f = write(tmp_path / "f.jsonl", [line("1")])
    _one_line_error(_cli("validate", str(f), "--endpoint", "/v1/nope"), 1, "/v1/nope")


def test_prepare_failure_names_the_output_it_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = write(tmp_path / "in.jsonl", [line("1"), b"[1]"])
    new = tmp_path / "new.jsonl"
    assert main(["prepare", str(f), "--model", "m", "--output", str(new)]) == 1
    out = capsys.readouterr().err
    assert f"airflow-batch prepare: {f}:line 2: not a JSON object" in out
    assert f"{new} was not created" in out and not new.exists()
    old = write(tmp_path / "old.jsonl", [line("x")])
    before = old.read_bytes()
    assert main(["prepare", str(f), "--model", "m", "--output", str(old)]) == 1
    assert f"{old} was not changed" in capsys.readouterr().err
    assert old.read_bytes() == before


def test_prepare_from_stdin_writes_stdout(tmp_path: Path) -> None:
    stdin = line("1") + b"\n" + line("2") + b"\n"
    proc = _cli("prepare", "-", "--model", "m9", stdin=stdin, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = [orjson.loads(x) for x in proc.stdout.splitlines()]
    assert [r["body"]["model"] for r in rows] == ["m9", "m9"]
    assert "set model 'm9' on 2 line(s)" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_prepare_keeps_the_mode_of_the_file_it_replaces(tmp_path: Path) -> None:
    from airflow_batch_provider import staging

    f = write(tmp_path / "in.jsonl", [line("1")])
    f.chmod(0o640)
    assert main(["prepare", str(f), "--model", "m"]) == 0
    assert f.stat().st_mode & 0o777 == 0o640
    # The CLI writes through the staging module's one atomic writer, which takes a plain path.
    target = tmp_path / "plain.txt"
    target.write_bytes(b"old")
    target.chmod(0o604)
    with staging.atomic_writer(str(target)) as handle:
        handle.write(b"new")
    assert target.read_bytes() == b"new" and target.stat().st_mode & 0o777 == 0o604


def test_validate_reports_the_first_line_whose_model_differs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    f = write(
        tmp_path / "models.jsonl",
        [line(str(i), model=model, messages=messages) for i, model in enumerate(["m1", "m1", "m2"])],
    )
    assert main(["validate", str(f)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        f"{f}:line 3: body.model 'm2' differs from 'm1' on line 1; "
        "this vendor runs one model per batch file [mismatched_model]"
    )
    # Doubleword routes each request by its own model.
    assert main(["validate", str(f), "--dialect", "doubleword"]) == 0


def test_validate_holds_hand_made_doubleword_files_to_unique_short_custom_ids(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = write(tmp_path / "ids.jsonl", [line("a"), line("a"), line("x" * 65)])
    assert main(["validate", str(f), "--dialect", "doubleword"]) == 1
    out = capsys.readouterr().out
    assert "line 2: custom_id 'a' is repeated [duplicate_custom_id]" in out
    assert "line 3: custom_id is 65 characters; the limit is 64 [custom_id_too_long]" in out


@pytest.mark.parametrize("endpoint", ["/v1/foo", "foo"])
def test_prepare_refuses_an_endpoint_the_dialect_does_not_support(tmp_path: Path, endpoint: str) -> None:
    f = write(tmp_path / "in.jsonl", [line("1")])
    before = f.read_bytes()
    err = _one_line_error(
        _cli("prepare", str(f), "--model", "m", "--endpoint", endpoint),
        1,
        "airflow-batch prepare: ",
        repr(endpoint),
    )
    assert err.startswith("airflow-batch prepare: ") and "/v1/chat/completions" in err
    assert f.read_bytes() == before


def test_prepare_checks_the_endpoint_against_the_dialect_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = write(tmp_path / "in.jsonl", [line("1")])
    assert main(["prepare", str(f), "--model", "m", "--endpoint", "/v1/fim/completions"]) == 1
    assert "dialect 'openai'" in capsys.readouterr().err
    assert (
        main(["prepare", str(f), "--model", "m", "--endpoint", "/v1/fim/completions", "--dialect", "mistral"])
        == 0
    )
    assert orjson.loads(f.read_bytes())["url"] == "/v1/fim/completions"


def test_help_has_no_literal_double_backticks() -> None:
    from airflow_batch_provider.cli import COMMANDS

    for args in [[], *([name] for name in COMMANDS)]:
        proc = _cli(*args, "--help")
        assert proc.returncode == 0, proc.stderr
        assert "``" not in proc.stdout, (args, proc.stdout)


def test_every_subcommand_error_has_the_one_prefix(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    bad = write(tmp_path / "bad.jsonl", [b"[1]"])
    for args in [
        ("validate", str(missing)),
        ("prepare", str(bad), "--model", "m"),
        ("summary", "--duckdb", str(missing), "--table", "t"),
    ]:
        _one_line_error(_cli(*args), 1, f"airflow-batch {args[0]}: ")


@pytest.mark.parametrize("name", sorted(DIALECTS))
def test_validate_refuses_lines_without_a_model_where_the_dialect_needs_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    bare = {"messages": [{"role": "user", "content": "hi"}]}
    f = write(tmp_path / "f.jsonl", [line("1"), line("2", **bare)])
    code = main(["validate", str(f), "--dialect", name])
    out = capsys.readouterr().out
    if DIALECTS[name].needs_line_model("/v1/chat/completions"):
        assert code == 1, out
        assert f"{f}:line 2: body.model" in out and f"dialect {name!r}" in out and "[missing_model]" in out
        assert "model= on the build or the submit" in out and "prepare --model" in out
    else:
        # The model goes on the job (submit's model= may give it): a line may go without.
        assert code == 0, out


@pytest.mark.parametrize(
    ("url", "body", "missing", "meant"),
    [
        ("/v1/embeddings", {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "input", "chat"),
        ("/v1/chat/completions", {"model": "m", "input": "x"}, "messages", "/v1/embeddings"),
    ],
)
def test_validate_refuses_a_body_shaped_for_another_endpoint(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    url: str,
    body: dict[str, Any],
    missing: str,
    meant: str,
) -> None:
    f = write(tmp_path / "f.jsonl", [line("1", url=url, **body)])
    assert main(["validate", str(f)]) == 1
    out = capsys.readouterr().out
    assert f"line 1: body has no {missing!r}, which {url} needs" in out and "[missing_body_field]" in out
    assert meant in out
