"""``airflow-batch validate`` and ``airflow-batch prepare`` through the real CLI entry point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from airflow_batch_provider.cli import main


def line(cid: str, url: str = "/v1/chat/completions", **body: Any) -> bytes:
    body = body or {"messages": [{"role": "user", "content": f"hi {cid}"}]}
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
            line("b", url="/v1/embeddings", input="x"),
            orjson.dumps(
                {"custom_id": "c", "method": "GET", "url": "/v1/chat/completions", "body": {"x": 1}}
            ),
            line("d", messages=[], stream=True),
            b"\xff\xfe",
        ],
    )
    assert main(["validate", str(f)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert f"{f}:line 2: line is not valid JSON" in out[0]
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
    with pytest.raises(Exception, match="unknown dialect"):
        main(["validate", str(f), "--dialect", "nope"])


def test_prepare_sets_model_in_place_and_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = write(
        tmp_path / "in.jsonl",
        [line("1"), b"", line("2", model="old", messages=[{"role": "user", "content": "é😀"}])],
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
    assert "line 2: not a JSON object" in capsys.readouterr().out
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
