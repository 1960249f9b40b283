"""Result lines read by the warehouse: raw lines staged as text, their rows computed in SQL.

The worker only streams the raw lines of the result files into a staging
table; one ``INSERT ... SELECT`` renders the vendor dialect's :class:`LineShape` as SQL (the
SQL dialect provides the JSON primitives) and computes the very columns
:class:`~airflow_batch_provider.warehouse.rows.ResultMapper` computes in Python. A line whose
row SQL would not give exactly (not JSON, no custom_id, an answer that is JSON text, odd
token counts or error fields...) is flagged and read by Python, the same code as the Python
path, so both paths write the same rows.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Any

from airflow_batch_provider.warehouse.rows import MAX_TOKEN_COUNT

if TYPE_CHECKING:
    from airflow_batch_provider.dialects.base import LineShape
    from airflow_batch_provider.models import ResultLine


@dataclass(frozen=True)
class ResultFile:
    """One result file: its id (for messages), its source and the batch it belongs to."""

    file_id: str
    source: str
    batch_id: str | None


@dataclass
class RawResults:
    """The raw lines of a merge's result files, for the warehouse to parse.

    :param files: the result files, in reading order (it may grow while ``lines`` is read; the
        rows' batch ids are rendered once the lines are loaded).
    :param lines: ``(file index, line number, bytes)`` of every non-blank line, in order.
    :param shape: the vendor dialect's line shape (None: Python reads every line).
    :param parse: reads one line in Python exactly as the hook does, ``(file index, line
        number, bytes) -> ResultLine`` (raising, or recording, an unreadable line).
    """

    files: Sequence[ResultFile]
    lines: Iterable[tuple[int, int, bytes]]
    shape: LineShape | None
    parse: Callable[[int, int, bytes], ResultLine]
    #: The same lines as the result files' bytes, ``(file index, chunk)`` in reading order and
    #: split anywhere, where the caller has the files as they are: a database that stages lines
    #: as text then takes them in chunks instead of line by line (see :func:`raw_blocks`).
    chunks: Iterable[tuple[int, bytes]] | None = None

    def parsed(self) -> Iterator[tuple[ResultLine, str | None]]:
        """Every line read by Python: the Python path's ``(result line, batch id)`` pairs."""
        for f, number, data in self.lines:
            yield self.parse(f, number, data), self.files[f].batch_id


def raw_records(lines: Iterable[tuple[int, int, bytes]]) -> Iterator[bytes]:
    """Staging records ``seq \\x01 file \\x01 line number \\x01 line \\x01 hex`` (the line, or
    for a line that cannot travel as text, its bytes in hex), one per line, without line end.

    A line with a surrogate escape (``\\ud800``) also goes as hex, for Python to read: DuckDB's
    ``json_valid`` raises on a lone one (failing the statement) where orjson refuses the line."""
    for seq, (f, number, data) in enumerate(lines, start=1):
        # ``in`` is a memchr-speed scan; a regular expression class took ~25 us a line.
        safe = not (
            b"\x01" in data
            or b"\x02" in data
            or b"\r" in data
            or b"\x00" in data
            or (b"\\u" in data and (b"\\ud" in data or b"\\uD" in data))
        )
        if safe and not data.isascii():
            try:
                data.decode()
            except UnicodeDecodeError:
                safe = False
        if safe:
            yield b"%d\x01%d\x01%d\x01%s\x01" % (seq, f, number, data)
        else:
            yield b"%d\x01%d\x01%d\x01\x01%s" % (seq, f, number, data.hex().encode())


@dataclass
class SharedParse:
    """A second connection computes the rows of a share of the raw lines, in rounds, while the
    first stages the rest: parsing JSON is most of the database's work, and one backend uses one
    core (see ``SqlDialect.load_raw_lines_shared``).

    :param connect: opens the second connection (the loader closes it, having committed nothing).
    :param parse: ``(connection, raw lines FROM item, results table)``: computes the rows of the
        FROM item's lines into the results table (``ROW_COLUMNS``, ``py``) on that connection.
    :param results: the first connection's results table, which also gets the ``line`` of each
        line the second connection flagged for Python.
    :param columns: the SQL column list of a results table (``ROW_COLUMNS``, ``py``, ``line``).
    :param before: statements the second connection runs first (those the first ran).
    :param meanwhile: work of the first connection once it has parsed its share, while the
        second may still parse (staging the keys).
    """

    connect: Callable[[], Any]
    parse: Callable[[Any, str, str], None]
    results: str
    columns: str
    before: Sequence[str] = ()
    meanwhile: Callable[[], None] | None = None


#: First byte of a staged line that travels as hex (a byte no line that travels as text holds).
HEXED = b"\x03"


@dataclass
class LineNumbers:
    """Where each staged line came from, kept as runs ``(first seq, file index, first line
    number)``: a run ends where the file changes or a blank line was skipped."""

    runs: list[tuple[int, int, int]] = field(default_factory=list)

    def locate(self, seq: int) -> tuple[int, int]:
        """``(file index, line number)`` of staged line ``seq``."""
        start, f, number = self.runs[bisect.bisect_right(self.runs, (seq, 1 << 62, 0)) - 1]
        return f, number + seq - start

    def file_sql(self, seq: str) -> str:
        """SQL giving the file index of the staged line whose number is the expression ``seq``."""
        starts = [
            (start, f) for i, (start, f, _) in enumerate(self.runs) if i == 0 or self.runs[i - 1][1] != f
        ]
        if not starts:
            return "NULL"
        return "CASE " + " ".join(f"WHEN {seq} >= {start} THEN {f}" for start, f in reversed(starts)) + " END"


def _travels(data: bytes) -> bool:
    """Whether bytes of whole lines can travel as they are in the staging COPY: no byte the
    COPY reads (its delimiter, quote, ``HEXED``, a carriage return, NUL), no line ``\\.`` (the
    end of data; never in valid JSON), valid UTF-8."""
    # ``in`` is a memchr-speed scan; a regular expression class took ~25 us a line.
    if b"\x01" in data or b"\x02" in data or b"\x03" in data or b"\r" in data or b"\x00" in data:
        return False
    # A backslash first: a one-byte search is memchr-fast, a longer one ~50 times slower.
    if b"\\" in data and (data == b"\\." or data.startswith(b"\\.\n") or b"\n\\.\n" in data):
        return False
    if not data.isascii():
        try:
            data.decode()
        except UnicodeDecodeError:
            return False
    return True


def _record(data: bytes) -> bytes:
    """One line as it travels: as it is, or ``HEXED`` + its hex."""
    return data if _travels(data) else HEXED + data.hex().encode()


def bare_records(lines: Iterable[tuple[int, int, bytes]], numbers: LineNumbers) -> Iterator[bytes]:
    """The lines as they are, for a one-column COPY that numbers them itself (their files and
    line numbers go to ``numbers``); a line that cannot travel as text goes as ``HEXED`` + hex."""
    runs = numbers.runs
    f_run = n_next = -1
    for seq, (f, number, data) in enumerate(lines, start=1):
        if number != n_next or f != f_run:
            runs.append((seq, f, number))
            f_run = f
        n_next = number + 1
        yield _record(data)


def raw_blocks(raw: RawResults, numbers: LineNumbers) -> Iterator[tuple[bytes, int]]:
    """The COPY text of the raw lines for a one-column COPY that numbers rows itself, in blocks
    ``(text, rows)``; where each row came from goes to ``numbers``.

    From ``raw.chunks``, whole lines go as they are, a chunk at a time, blank lines included
    (rows the database must skip: empty, or only the blanks ``bytes.strip`` drops); only a
    chunk holding bytes that cannot travel is split into lines (blank ones skipped, the others
    as :func:`bare_records` sends them).
    """
    if raw.chunks is None:
        records = bare_records(raw.lines, numbers)
        # Joined in C: a Python step per record measured ~0.7 us a line.
        while batch := list(islice(records, 2048)):
            yield b"\n".join(batch) + b"\n", len(batch)
        return
    runs = numbers.runs
    seq = 1
    f_now, number, carry = -1, 1, b""

    def note(f: int, line: int) -> None:
        # A run starts where rows stop continuing the last one.
        if not runs or runs[-1][1] != f or runs[-1][2] + seq - runs[-1][0] != line:
            runs.append((seq, f, line))

    def whole(f: int, body: bytes) -> Iterator[tuple[bytes, int]]:
        """Whole lines of file ``f`` (``body`` ends with a newline) starting at line ``number``."""
        nonlocal seq, number
        rows = body.count(b"\n")
        if _travels(body):
            note(f, number)
            seq += rows
            number += rows
            yield body, rows
            return
        records = []
        for data in body.split(b"\n")[:-1]:
            if data.strip():
                note(f, number)
                records.append(_record(data))
                seq += 1
            number += 1
        if records:
            yield b"\n".join(records) + b"\n", len(records)

    for f, chunk in raw.chunks:
        if f != f_now:
            if carry:
                yield from whole(f_now, carry + b"\n")
            f_now, number, carry = f, 1, b""
        data = carry + chunk if carry else chunk
        cut = data.rfind(b"\n") + 1
        carry = data[cut:]
        if cut:
            yield from whole(f, data[:cut])
    if carry:
        yield from whole(f_now, carry + b"\n")


class JsonSql:
    """The JSON primitives one database offers to :func:`result_row_sql` (PostgreSQL jsonb,
    DuckDB json...). Kinds are ``object, array, string, integer, number, boolean, null``,
    NULL for a path that is absent."""

    #: Appended to a subquery whose columns must be computed once, not inlined into each use.
    fence: str = ""
    #: Statements run before the rows are computed, and after (to restore the session).
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    #: Rows are computed from each chunk of raw lines as it is loaded, and only the lines Python
    #: must read are kept (see ``SqlDialect.load_raw_lines``).
    while_loading: bool = False
    #: Why ``parse_in="auto"`` leaves the lines to Python on this database (None: it does not).
    not_auto: str | None = None
    #: The common lines are first read by :func:`common_row_sql` (a few leaves), the others by
    #: :func:`result_row_sql`; the primitives ``parse`` to ``spelled`` below are then needed.
    common_rows: bool = False

    def parse(self, line: str) -> str:
        """The JSON value of a line of text."""
        raise NotImplementedError

    def value(self, doc: str, path: tuple[str | int, ...]) -> str:
        """The JSON value at ``path`` in ``doc``, NULL where there is none."""
        raise NotImplementedError

    def kind(self, value: str) -> str:
        """The database's kind of a JSON value: ``object, array, string, number, boolean, null``."""
        raise NotImplementedError

    def numeric(self, value: str) -> str:
        """A number value as an exact decimal."""
        raise NotImplementedError

    def whole(self, numeric: str) -> str:
        """Whether an exact decimal from ``numeric`` was written without a fraction."""
        raise NotImplementedError

    def spelled(self, line: str) -> str:
        """Whether the text of a line may give a member a number written with an exponent
        (``"total_tokens": 1e2``), a spelling the database does not keep (it reads 100 where
        Python reads a float); FALSE where the database keeps it."""
        return "FALSE"

    def digits(self, text: str) -> str:
        """Whether a text expression is a non-negative integer written in digits."""
        raise NotImplementedError

    def ambiguous(self, line: str, doc: str) -> str:
        """Whether the database may read the line otherwise than Python does (which then reads
        it): an object that may repeat a key (Python calls the line unreadable, see
        ``jsonl.repeated_key``), more nesting or numbers than orjson reads (see
        :func:`beyond_orjson`). ``line`` is its text, ``doc`` its parsed value (``parse``)."""
        raise NotImplementedError

    def leaves(self, raw: str, paths: Sequence[tuple[str | int, ...]]) -> str:
        """A FROM item over the staging table ``raw`` giving ``seq, f``, ``ex`` (``spelled`` of the
        line), ``amb`` (``ambiguous``) and, for each path ``i``, ``l{i}`` (its JSON value or NULL)
        and ``k{i}`` (its kind)."""
        raise NotImplementedError

    def text(self, leaf: str) -> str:
        """The value of a string leaf."""
        raise NotImplementedError

    def number(self, leaf: str) -> str:
        """The value of a number leaf (for its truth)."""
        raise NotImplementedError

    def integer(self, leaf: str) -> str:
        """The exact value of an integer leaf, or of a text expression of digits."""
        raise NotImplementedError

    def length(self, leaf: str) -> str:
        """The length of an array leaf."""
        raise NotImplementedError

    def json_text(self, leaf: str) -> str:
        """A leaf as JSON text."""
        raise NotImplementedError

    def int_text(self, expression: str) -> str:
        """An exact integer as decimal text."""
        return f"CAST({expression} AS VARCHAR)"


#: Numbers orjson reads otherwise than a database, after a ``:``, ``,`` or ``[`` (in text too:
#: such a line only goes to Python): 19 digits or more, or in quotes (past 64 bits an integer is
#: a float to orjson, and exact to the database; a digit-string status past 128 bits is NULL to
#: DuckDB), and three-digit exponents (past a double's range orjson refuses the line, which the
#: database reads). One leading class: an alternation per position cost PostgreSQL ~40% more.
ODD_NUMBERS = r'[:,\[][[:space:]]*("?-?[0-9]{19}|-?[0-9.]+[eE][-+]?[0-9]{3})'

#: The nesting orjson reads (a deeper line is unreadable to Python, not to a database).
ORJSON_DEPTH = 1024


def beyond_orjson(line: str, matches: Callable[[str, str], str], size: str) -> str:
    """SQL true where the text ``line`` may hold what orjson reads otherwise than a database:
    :data:`ODD_NUMBERS`, or more opening brackets than :data:`ORJSON_DEPTH` (a bound on its
    nesting, counted only in a line long enough to have it).

    :param matches: ``(text, pattern) -> SQL`` whether the text matches the regular expression.
    :param size: the database's function giving a text's size in bytes (no scan, unlike its length).
    """
    brackets = f"{size}({line}) - {size}(replace(replace({line}, '[', ''), '{{', ''))"
    return (
        f"({matches(line, literal(ODD_NUMBERS))} "
        f"OR ({size}({line}) > {2 * ORJSON_DEPTH} AND {brackets} > {ORJSON_DEPTH}))"
    )


def literal(text: str) -> str:
    """``text`` as an SQL string literal."""
    return "'" + text.replace("'", "''") + "'"


class _Leaves:
    """Names the JSON paths a row needs and gives the SQL of each leaf, its kind and tests."""

    def __init__(self, json: JsonSql) -> None:
        self.json = json
        self.paths: list[tuple[str | int, ...]] = []
        self._index: dict[tuple[str | int, ...], int] = {}

    def __call__(self, path: tuple[str | int, ...]) -> int:
        if path not in self._index:
            self._index[path] = len(self.paths)
            self.paths.append(path)
        return self._index[path]

    def is_(self, i: int, *kinds: str) -> str:
        return f"COALESCE(k{i} IN ({', '.join(literal(k) for k in kinds)}), FALSE)"

    def nullish(self, i: int) -> str:
        return f"(k{i} IS NULL OR k{i} = 'null')"

    def text(self, i: int) -> str:
        return self.json.text(f"l{i}")

    def str_or_null(self, i: int) -> str:
        return f"CASE WHEN k{i} = 'string' THEN {self.text(i)} END"

    def strish(self, i: int) -> str:
        """Null, absent or a string: what ``str_or_none`` turns into text without Python's ``str()``."""
        return f"(k{i} IS NULL OR k{i} IN ('string', 'null'))"

    def truthy(self, i: int) -> str:
        """Python's truth of the JSON value."""
        j = self.json
        return (
            f"COALESCE(CASE k{i} WHEN 'string' THEN {j.text(f'l{i}')} <> '' "
            f"WHEN 'integer' THEN {j.number(f'l{i}')} <> 0 WHEN 'number' THEN {j.number(f'l{i}')} <> 0 "
            f"WHEN 'boolean' THEN {j.json_text(f'l{i}')} = 'true' WHEN 'array' THEN {j.length(f'l{i}')} > 0 "
            f"WHEN 'object' THEN {j.json_text(f'l{i}')} <> '{{}}' ELSE FALSE END, FALSE)"
        )

    def count(self, i: int) -> str:
        """A token count as ``extract_usage`` believes it, else NULL."""
        n = self.json.integer(f"l{i}")
        return f"CASE WHEN k{i} = 'integer' AND {n} BETWEEN 0 AND {MAX_TOKEN_COUNT} THEN {n} END"


#: The token counts of ``usage`` that ``extract_usage`` reads.
TOKEN_KEYS = ("prompt_tokens", "input_tokens", "completion_tokens", "output_tokens", "total_tokens")

#: The staged results columns :func:`result_row_sql` gives, in order, before ``py``.
ROW_COLUMNS = (
    "custom_id",
    "seq",
    "status",
    "content",
    "embedding",
    "finish_reason",
    "model",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "error_code",
    "error_message",
    "batch_id",
)


def result_row_sql(json: JsonSql, shape: LineShape, raw: str, batch_ids: Sequence[str | None]) -> str:
    """A SELECT over the staging table ``raw`` giving :data:`ROW_COLUMNS` and ``py``, the flag
    of a line Python must read (its other columns are then not to be used).

    It is ``Dialect.parse_result_line`` (the OpenAI rules) followed by ``ResultMapper.row``
    without extra columns or output schema, clause by clause.
    """
    leaf = _Leaves(json)
    line = leaf(())
    cid = leaf(shape.custom_id)
    resp = shape.response
    sc = leaf((*resp, shape.status_code))
    body_path = (*resp, shape.body)
    body = leaf(body_path)
    err = leaf(shape.error)
    err_code, err_msg = leaf((*shape.error, "code")), leaf((*shape.error, "message"))
    inner = leaf((*body_path, "error"))
    inner_code, inner_msg = leaf((*body_path, "error", "code")), leaf((*body_path, "error", "message"))
    model = leaf((*body_path, "model"))
    choices, c0 = leaf((*body_path, "choices")), leaf((*body_path, "choices", 0))
    msg_path: tuple[str | int, ...] = (*body_path, "choices", 0, "message")
    msg = leaf(msg_path)
    content, tools, refusal = (leaf((*msg_path, k)) for k in ("content", "tool_calls", "refusal"))
    text, finish = leaf((*body_path, "choices", 0, "text")), leaf((*body_path, "choices", 0, "finish_reason"))
    data, obj = leaf((*body_path, "data")), leaf((*body_path, "object"))
    d0, emb = leaf((*body_path, "data", 0)), leaf((*body_path, "data", 0, "embedding"))
    output, otext = leaf((*body_path, "output")), leaf((*body_path, "output_text"))
    details = leaf((*body_path, "incomplete_details"))
    reason, bstatus = leaf((*body_path, "incomplete_details", "reason")), leaf((*body_path, "status"))
    usage = leaf((*body_path, "usage"))
    tokens = {k: leaf((*body_path, "usage", k)) for k in TOKEN_KEYS}
    j = json
    t = leaf.text
    sc_int = (
        f"CASE WHEN k{sc} = 'integer' THEN {j.integer(f'l{sc}')} "
        f"WHEN k{sc} = 'string' AND {j.digits(t(sc))} THEN {j.integer(t(sc))} END"
    )
    ok2xx = "COALESCE(sc_int >= 200 AND sc_int < 300, FALSE)"
    ekind = (
        f"CASE WHEN {leaf.nullish(err)} AND {ok2xx} THEN 'none' WHEN k{err} = 'object' THEN 'obj' "
        f"WHEN k{err} = 'string' AND {t(err)} <> '' THEN 'str' "
        f"WHEN sc_int IS NOT NULL AND NOT {ok2xx} THEN 'http' WHEN {ok2xx} THEN 'none' ELSE 'unknown' END"
    )
    answer = (
        f"CASE WHEN NOT {leaf.is_(body, 'object')} THEN 'none' "
        f"WHEN k{choices} = 'array' AND k{c0} = 'object' THEN 'chat' "
        f"WHEN k{data} = 'array' AND k{obj} = 'string' AND {t(obj)} = 'list' THEN 'emb' "
        f"WHEN k{output} = 'array' OR k{otext} IS NOT NULL THEN 'resp' ELSE 'none' END"
    )
    # Levels of values that later clauses read more than once, each computed once per line
    # (``fence`` keeps a planner from inlining a level into every reference).
    fence = j.fence
    # Token counts as extract_usage believes them (n<leaf>), the prompt's and completion's.
    pt, it, ct, ot, tt = tokens.values()
    counts = ", ".join(f"{leaf.count(i)} AS n{i}" for i in tokens.values())
    prompt = f"CASE WHEN k{usage} = 'object' THEN CASE WHEN {leaf.nullish(pt)} THEN n{it} ELSE n{pt} END END"
    completion = (
        f"CASE WHEN k{usage} = 'object' THEN CASE WHEN {leaf.nullish(ct)} THEN n{ot} ELSE n{ct} END END"
    )
    level1 = (
        f"SELECT y0.*, {ekind} AS e_kind, {prompt} AS p_tok, {completion} AS c_tok FROM (SELECT x.*, "
        f"{sc_int} AS sc_int, {answer} AS a_kind, {counts} "
        f"FROM {j.leaves(raw, leaf.paths)} x{fence}) y0{fence}"
    )
    http = j.int_text("sc_int")
    code = (
        f"CASE e_kind WHEN 'none' THEN NULL WHEN 'obj' THEN {leaf.str_or_null(err_code)} "
        f"WHEN 'str' THEN 'error' WHEN 'http' THEN CASE WHEN k{inner} = 'object' "
        f"AND k{inner_code} = 'string' AND {t(inner_code)} <> '' THEN {t(inner_code)} "
        f"ELSE 'http_' || {http} END ELSE 'unknown_error' END"
    )
    message = (
        f"CASE e_kind WHEN 'obj' THEN {leaf.str_or_null(err_msg)} WHEN 'str' THEN {t(err)} "
        f"WHEN 'http' THEN CASE WHEN k{inner} = 'object' THEN {leaf.str_or_null(inner_msg)} "
        f"WHEN k{inner} = 'string' AND {t(inner)} <> '' THEN {t(inner)} END "
        f"WHEN 'unknown' THEN 'line failed with status None' END"
    )
    chat_content = (
        f"CASE WHEN k{msg} = 'object' THEN CASE WHEN {leaf.nullish(content)} THEN "
        f"CASE WHEN k{refusal} = 'string' AND {t(refusal)} <> '' AND NOT {leaf.truthy(tools)} "
        f"THEN {t(refusal)} END "
        f"WHEN k{content} = 'string' THEN {t(content)} END "
        f"ELSE {leaf.str_or_null(text)} END"
    )
    content_sql = (
        f"CASE a_kind WHEN 'chat' THEN {chat_content} WHEN 'resp' THEN {leaf.str_or_null(otext)} END"
    )
    resp_reason = (
        f"CASE WHEN k{details} = 'object' AND {leaf.truthy(reason)} THEN {leaf.str_or_null(reason)} "
        f"ELSE {leaf.str_or_null(bstatus)} END"
    )
    level2 = f"SELECT y1.*, {code} AS e_code, {content_sql} AS a_content FROM ({level1}) y1{fence}"
    finish_sql = f"CASE a_kind WHEN 'chat' THEN {leaf.str_or_null(finish)} WHEN 'resp' THEN {resp_reason} END"
    single_vector = (
        f"(a_kind = 'emb' AND {j.length(f'l{data}')} = 1 AND k{d0} = 'object' AND NOT {leaf.nullish(emb)})"
    )
    embedding_sql = f"CASE WHEN {single_vector} THEN {j.json_text(f'l{emb}')} END"
    total = (
        f"CASE WHEN k{usage} = 'object' THEN CASE WHEN NOT {leaf.nullish(tt)} THEN n{tt} "
        "WHEN p_tok IS NOT NULL OR c_tok IS NOT NULL THEN COALESCE(p_tok, 0) + COALESCE(c_tok, 0) END END"
    )
    bad_tokens = " OR ".join(f"(NOT {leaf.nullish(i)} AND n{i} IS NULL)" for i in tokens.values())
    integers = " OR ".join(f"k{i} = 'integer'" for i in (sc, *tokens.values()))
    # What only Python reads exactly: each clause names a case of parse_result_line or row().
    python = " OR ".join(
        f"COALESCE({clause}, FALSE)"
        for clause in (
            f"NOT {leaf.is_(line, 'object')}",
            f"NOT {leaf.is_(cid, 'string')}",
            f"{t(cid)} = ''",
            f"(e_kind = 'obj' AND NOT ({leaf.strish(err_code)} AND {leaf.strish(err_msg)}))",
            f"(e_kind = 'http' AND k{inner} = 'object' AND NOT ({leaf.strish(inner_code)} "
            f"AND {leaf.strish(inner_msg)}))",
            f"(e_kind = 'http' AND NOT {leaf.strish(inner)} AND k{inner} <> 'object')",
            # Lines counted as unreadable are counted by the mapper.
            "e_code = 'invalid_result_line'",
            # A body sent as JSON text: Python decodes it (Dialect.parse_result_line).
            f"k{body} = 'string'",
            # Answers that are JSON text or joined parts.
            f"(a_kind = 'chat' AND k{msg} = 'object' AND {leaf.nullish(content)} AND {leaf.truthy(tools)})",
            f"(a_kind = 'chat' AND k{msg} = 'object' AND k{content} = 'array')",
            f"(a_kind = 'emb' AND NOT {single_vector})",
            f"(a_kind = 'resp' AND k{otext} IS DISTINCT FROM 'string' AND k{output} = 'array' "
            f"AND {j.length(f'l{output}')} > 0)",
            # No answer this mapper knows: the whole body is the answer, as JSON text.
            f"(e_kind = 'none' AND a_kind <> 'emb' AND {leaf.is_(body, 'object')} AND a_content IS NULL)",
            f"(k{usage} = 'object' AND ({bad_tokens}))",
            # A number read as an integer that the line may have written as 1e2 (a float).
            f"(ex AND ({integers}))",
            # A line the database may read otherwise (a repeated key, orjson's limits).
            "amb",
        )
    )
    status = (
        f"CASE WHEN e_kind = 'none' AND NOT {leaf.is_(body, 'object')} THEN 'invalid_output' "
        "WHEN e_kind = 'none' THEN 'succeeded' ELSE CASE e_code WHEN 'batch_expired' THEN 'expired' "
        f"WHEN 'batch_cancelled' THEN 'cancelled' ELSE 'failed' END END"
    )
    empty = f"e_kind = 'none' AND NOT {leaf.is_(body, 'object')}"
    batch = batch_sql("f", batch_ids)
    columns = (
        f"CASE WHEN k{cid} = 'string' THEN {t(cid)} END",
        "seq",
        status,
        "a_content",
        embedding_sql,
        finish_sql,
        f"{leaf.str_or_null(model)}",
        "p_tok",
        "c_tok",
        total,
        f"CASE WHEN {empty} THEN 'empty_response' ELSE e_code END",
        f"CASE WHEN {empty} THEN 'the response has no JSON object body to read an answer from' "
        f"ELSE {message} END",
        batch,
        f"COALESCE({python}, TRUE)",
    )
    return f"SELECT {', '.join(columns)} FROM ({level2}) y"


def batch_sql(file: str, batch_ids: Sequence[str | None]) -> str:
    """SQL giving the batch id of a line of file index ``file``."""
    if not batch_ids:
        return "NULL"
    whens = " ".join(f"WHEN {i} THEN {'NULL' if b is None else literal(b)}" for i, b in enumerate(batch_ids))
    return f"CASE {file} {whens} END"


def common_row_sql(json: JsonSql, shape: LineShape, raw: str, batch_ids: Sequence[str | None]) -> str:
    """A SELECT over the staging table ``raw`` giving :data:`ROW_COLUMNS` and ``py`` like
    :func:`result_row_sql`, for the two shapes nearly every line has, from ~15 leaves instead of
    ~40: a chat completion answered with text (no error, an integer 2xx status, token counts that
    are believed or absent) and an error object of text fields without a response body. ``py``
    is NULL for a line of any other shape: :func:`result_row_sql` must read it.

    Every column is the one :func:`result_row_sql` gives for such a line (``tests/warehouse/
    test_lines.py`` compares both paths with Python on lines at the edges of these shapes).
    """
    j = json
    body = (*shape.response, shape.body)
    choice: tuple[str | int, ...] = (*body, "choices", 0)
    paths: dict[str, tuple[str | int, ...]] = {
        "cid": shape.custom_id,
        "err": shape.error,
        "code": (*shape.error, "code"),
        "msg": (*shape.error, "message"),
        "sc": (*shape.response, shape.status_code),
        "body": body,
        "choices": (*body, "choices"),
        "c0": choice,
        "content": (*choice, "message", "content"),
        "finish": (*choice, "finish_reason"),
        "model": (*body, "model"),
    }
    tokens = TOKEN_KEYS
    paths.update({t: (*body, "usage", t) for t in tokens})
    values = ", ".join(f"{j.value('j', p)} AS l_{name}" for name, p in paths.items())
    kinds = ", ".join(f"{j.kind(f'l_{name}')} AS k_{name}" for name in paths)
    texts = ", ".join(
        f"CASE WHEN k_{name} = 'string' THEN {j.text(f'l_{name}')} END AS t_{name}"
        for name in ("cid", "code", "msg", "content", "finish", "model")
    )
    numbers = ", ".join(
        f"CASE WHEN k_{name} = 'number' THEN {j.numeric(f'l_{name}')} END AS n_{name}"
        for name in ("sc", *tokens)
    )
    # A token count as extract_usage believes it; absent or null is as good (it reads None).
    believed = " AND ".join(
        f"(k_{t} IS NULL OR k_{t} = 'null' "
        f"OR ({j.whole(f'n_{t}')} AND n_{t} BETWEEN 0 AND {MAX_TOKEN_COUNT}))"
        for t in tokens
    )
    answered = (
        "NOT amb AND t_cid <> '' AND (k_err IS NULL OR k_err = 'null') "
        f"AND {j.whole('n_sc')} AND n_sc >= 200 AND n_sc < 300 "
        f"AND k_choices = 'array' AND k_c0 = 'object' AND k_content = 'string' AND {believed} "
        # Last: the only test that reads the line's text again (error lines read no number).
        f"AND NOT {j.spelled('line')}"
    )
    failed = (
        "NOT amb AND t_cid <> '' AND k_err = 'object' AND (k_code IS NULL OR k_code IN ('null', 'string')) "
        "AND (k_msg IS NULL OR k_msg IN ('null', 'string')) "
        "AND t_code IS DISTINCT FROM 'invalid_result_line' AND k_body IS DISTINCT FROM 'object' "
        # A body sent as JSON text may hold the model and token counts: result_row_sql leaves it
        # to Python.
        "AND k_body IS DISTINCT FROM 'string'"
    )
    fence = j.fence
    parsed = f"SELECT seq, f, line, {j.parse('line')} AS j FROM {raw} r{fence}"
    level1 = f"SELECT seq, f, line, {j.ambiguous('line', 'j')} AS amb, {values} FROM ({parsed}) a{fence}"
    level2 = f"SELECT b.*, {kinds} FROM ({level1}) b{fence}"
    level3 = f"SELECT c.*, {texts}, {numbers} FROM ({level2}) c{fence}"
    level4 = (
        f"SELECT d.*, CASE WHEN {answered} THEN 'answer' WHEN {failed} THEN 'error' END AS common "
        f"FROM ({level3}) d{fence}"
    )
    n = {t: f"CAST(n_{t} AS BIGINT)" for t in tokens}
    prompt = f"COALESCE({n['prompt_tokens']}, {n['input_tokens']})"
    completion = f"COALESCE({n['completion_tokens']}, {n['output_tokens']})"
    answer = "common = 'answer'"
    columns = (
        "CASE WHEN common IS NOT NULL THEN t_cid END",
        "seq",
        "CASE common WHEN 'answer' THEN 'succeeded' WHEN 'error' THEN CASE t_code "
        "WHEN 'batch_expired' THEN 'expired' WHEN 'batch_cancelled' THEN 'cancelled' ELSE 'failed' END END",
        f"CASE WHEN {answer} THEN t_content END",
        "NULL",
        f"CASE WHEN {answer} THEN t_finish END",
        f"CASE WHEN {answer} THEN t_model END",
        f"CASE WHEN {answer} THEN {prompt} END",
        f"CASE WHEN {answer} THEN {completion} END",
        f"CASE WHEN {answer} THEN COALESCE({n['total_tokens']}, CASE WHEN {prompt} IS NOT NULL "
        f"OR {completion} IS NOT NULL THEN COALESCE({prompt}, 0) + COALESCE({completion}, 0) END) END",
        "CASE WHEN common = 'error' THEN t_code END",
        "CASE WHEN common = 'error' THEN t_msg END",
        batch_sql("f", batch_ids),
        "CASE WHEN common IS NOT NULL THEN FALSE END",
    )
    return f"SELECT {', '.join(columns)} FROM ({level4}) e"


def file_line_reader(
    dialect: Any, files: Sequence[ResultFile], on_bad_line: str = "fail"
) -> Callable[[int, int, bytes], ResultLine]:
    """The ``parse`` of :class:`RawResults`: one line read as the hook reads a result file line
    (``on_bad_line``: ``fail`` raises naming file and line, ``record`` gives a failed line)."""
    from airflow_batch_provider.hooks.lines import line_object
    from airflow_batch_provider.hooks.results import result_line, result_line_or_bad

    lenient = on_bad_line == "record"
    read = result_line_or_bad if lenient else result_line

    def parse(f: int, number: int, data: bytes) -> ResultLine:
        file = files[f]
        obj = line_object(data, number, f"file {file.file_id!r}", (), lenient)
        return read(dialect, obj, file.source, file.file_id, number)

    return parse
