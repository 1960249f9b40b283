"""The build's BigQuery route (``requests_table``): request tables written by SQL inside BigQuery.

For Vertex AI batch prediction reading BigQuery (``bigquerySource``), the build never fetches a
row: every statement runs in BigQuery and only counts and names come back. The chat
``messages`` are compiled once in Python into SQL that writes, per row, exactly what the file
route writes for it:

* ``custom_id``: :func:`airflow_batch_provider.keys.custom_id_for` rendered in SQL for INT64
  and STRING keys (readable ids kept, others ``k-`` + base32 of the SHA-256 of the tagged
  key's JSON);
* ``request_hash``: the first 32 hex characters of the SHA-256 of the canonical ``{url, body}``
  JSON with sorted keys (:mod:`airflow_batch_provider.request_hash`);
* ``request``: the dialect's ``encode_line`` of the canonical line (one encoding, the dialect's).

How one encoding serves every row: the body is built in Python with a unique sentinel in place
of each ``{{ column }}``; the canonical dump, the hash dump and the encoded request are split at
the sentinels, and SQL ``CONCAT``\\ s the literal pieces with the row's text escaped as orjson
escapes the inside of a JSON string (``"``, ``\\`` and the control characters 0x00-0x1f as
``\\b \\t \\n \\f \\r`` or ``\\u00XX``; everything else raw). The escape is nested ``REPLACE``
calls (:func:`json_escape_sql`), never ``TO_JSON_STRING``, which on BigQuery escapes ``<``,
``>`` and ``&`` too.

Restrictions (refused by name, before any statement): the body comes from ``messages`` given as
a list whose strings are plain text plus ``{{ column }}`` (no filters, control blocks or
``row[...]``: compute such text in ``sql``); template columns are STRING or INT64; key columns
are INT64 or STRING; no query ``parameters``; no ``skip_unchanged``, ``deduplicate`` or
estimate on this route.

Tables written, for ``requests_table="dataset.prefix"``, each named with the run's token
(:func:`run_token`, from the run's staging directory) so overlapping runs (a backfill,
``max_active_runs`` > 1) never share a table, each replaced by a rerun of the same run and each
expiring after ``TABLE_DAYS`` days: ``prefix_<token>_shard_000``... (key columns,
``custom_id``, ``request_hash``, ``request``; at most ``max_lines`` rows each, each row's place
computed once in the work table) and ``prefix_<token>_rejects`` (``row``, the key columns,
``custom_id``, ``code``, ``reason``: the codes of the file route's rejects.jsonl:
``null_key``, ``null_value``, ``line_too_large``). Two rows with one key fail the build
(``DuplicateKeyError``), as on the file route.

A shard's fingerprint (:func:`fingerprint_sql`) is the SHA-256 of the encoding's template digest
(the request's literal pieces: model, generation config...) and every row's
``custom_id:request_hash`` (which covers url and body), never the requests themselves (a value
over BigQuery's 100 MB limit at scale). The submit (before a create) and the merge recompute it
(:func:`check_table`) and refuse a table that changed since the build, by name.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from airflow_batch_provider import keys as keymod
from airflow_batch_provider.exceptions import ConfigurationError, DuplicateKeyError
from airflow_batch_provider.request_hash import HASH_CHARS

#: Days a request, rejects or work table lives before BigQuery drops it.
TABLE_DAYS = 7
#: Key and template column types rendered exactly (BigQuery type names as the API reports them).
INTEGER_TYPES = frozenset({"INTEGER", "INT64"})
TEXT_TYPES = frozenset({"STRING"})
#: Columns of a request table besides the keys (a key column may not reuse them).
REQUEST_COLUMNS = ("custom_id", "request_hash", "request")
#: Columns Vertex AI adds to an output row (a key column may not reuse them either).
OUTPUT_COLUMNS = ("response", "status", "processed_time")
_SHORT_ESCAPES = {0x08: "\\b", 0x09: "\\t", 0x0A: "\\n", 0x0C: "\\f", 0x0D: "\\r"}
#: Hex characters of the run token in the table names.
TOKEN_CHARS = 10
_PREFIX = re.compile(r"(?:([a-z0-9][a-z0-9.:-]{0,99})\.)?([A-Za-z0-9_]{1,1024})\.([A-Za-z0-9_]{1,200})")


def run_token(identity: str) -> str:
    """The token naming one run's tables: the first ``TOKEN_CHARS`` hex of the SHA-256 of the
    run's identity (its staging directory), so two runs of one ``requests_table`` never write,
    drop or read each other's tables.

    :param identity: what tells the run apart (the build's staging directory).
    """
    return hashlib.sha256(identity.encode()).hexdigest()[:TOKEN_CHARS]


def fingerprint_sql(table: str, template: str, quote: Any) -> str:
    """SQL for ``(lines, bytes, fingerprint)`` of a request table: the SHA-256 of the encoding's
    template digest and every ``custom_id:request_hash``, in custom_id order.

    :param table: ``project.dataset.table``.
    :param template: the plan's :attr:`RequestsPlan.template` digest.
    :param quote: identifier quoting.
    """
    return (
        f"SELECT COUNT(*), SUM(BYTE_LENGTH(request)), TO_HEX(SHA256(CONCAT({sql_literal(template)}, "
        f"IFNULL(STRING_AGG(CONCAT(custom_id, ':', request_hash), '\\n' ORDER BY custom_id), '')))) "
        f"FROM {quote(table)}"
    )


def check_table(client: Any, uri: str, template: str, fingerprint: str) -> None:
    """Refuse a request table that is gone or changed since the build wrote it.

    :param client: a ``google.cloud.bigquery.Client``.
    :param uri: the shard's ``bq://project.dataset.table``.
    :param template: the build's template digest (manifest ``extra.bigquery.template``).
    :param fingerprint: the shard's fingerprint in the manifest.
    :raises ConfigurationError: the table is missing or its fingerprint differs.
    """
    table = uri.removeprefix("bq://")
    if "`" in table or "\\" in table:
        raise ConfigurationError(f"not a BigQuery table name: {uri!r}")
    try:
        found_rows = client.query(fingerprint_sql(table, template, _backquote)).result()
        rows = [tuple(r.values()) for r in found_rows]
    except Exception as exc:
        if type(exc).__name__ != "NotFound":
            raise
        raise ConfigurationError(
            f"requests table {table} is gone (expired or dropped); rebuild the requests"
        ) from None
    found = str(rows[0][2]) if rows else ""
    if found != fingerprint:
        raise ConfigurationError(
            f"requests table {table} changed since the build (fingerprint {fingerprint[:12]}... is now "
            f"{found[:12]}...): another run or a person rewrote it; rebuild the requests"
        )


def _backquote(name: str) -> str:
    return f"`{name}`"


def sql_literal(text: str) -> str:
    """SQL for the text ``text``: a string literal (``\\`` and ``'`` escaped), with each control
    character spliced in by its code point (a literal escape such as ``\\x01`` is read
    differently by some BigQuery-compatible servers)."""
    pieces: list[str] = []
    run: list[str] = []
    for char in text:
        if ord(char) < 0x20:
            pieces.append("'" + "".join(run) + "'")
            pieces.append(f"CODE_POINTS_TO_STRING([{ord(char)}])")
            run = []
        else:
            run.append("\\" + char if char in ("\\", "'") else char)
    pieces.append("'" + "".join(run) + "'")
    pieces = [p for p in pieces if p != "''"] or ["''"]
    return pieces[0] if len(pieces) == 1 else f"CONCAT({', '.join(pieces)})"


def json_escape_sql(expression: str) -> str:
    """SQL for the inside of the JSON string of the STRING ``expression``, as orjson writes it.

    Backslashes first (the later replacements add backslashes of their own), then quotes, then
    each control character, found by its code point (not a literal escape, which some
    BigQuery-compatible servers read differently).
    """
    sql = f"REPLACE(REPLACE({expression}, '\\\\', '\\\\\\\\'), '\"', '\\\\\"')"
    for code in range(0x20):
        escaped = _SHORT_ESCAPES.get(code, f"\\u{code:04x}")
        sql = f"REPLACE({sql}, CODE_POINTS_TO_STRING([{code}]), {sql_literal(escaped)})"
    return sql


def split_requests_table(value: str, default_project: str) -> tuple[str, str, str]:
    """``(project, dataset, prefix)`` of a ``requests_table`` option (``[project.]dataset.prefix``)."""
    found = _PREFIX.fullmatch(value.strip())
    if found is None:
        raise ConfigurationError(
            f"requests_table {value!r} must be dataset.prefix (or project.dataset.prefix): letters, "
            "digits and underscores"
        )
    return found.group(1) or default_project, found.group(2), found.group(3)


@dataclass(frozen=True)
class Slots:
    """Sentinels standing for template substitutions in a body built in Python.

    :param token: the random part that makes every sentinel unique to one build.
    :param columns: the column each slot renders, by slot number.
    """

    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    columns: list[str] = field(default_factory=list)

    def add(self, column: str) -> str:
        self.columns.append(column)
        return self.sentinel(len(self.columns) - 1)

    def sentinel(self, index: int) -> str:
        # Letters, digits and @: written unchanged by every JSON encoder.
        return f"@@abp{self.token}s{index}@@"

    @property
    def custom_id(self) -> str:
        return f"@@abp{self.token}cid@@"

    @property
    def pattern(self) -> re.Pattern[str]:
        return re.compile(f"@@abp{self.token}(cid|s[0-9]+)@@")


def compile_messages(messages: Any, columns: Sequence[str], slots: Slots) -> list[Any]:
    """The ``messages`` structure with each ``{{ column }}`` replaced by a slot's sentinel.

    :raises ConfigurationError: a template that is not plain text plus ``{{ column }}``.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise ConfigurationError(
            "requests_table: messages must be a list of {role, content} (one template string "
            "rendering JSON is not compiled to SQL); compute the text in sql"
        )
    return [_compile(m, columns, slots) for m in messages]


def _compile(value: Any, columns: Sequence[str], slots: Slots) -> Any:
    if isinstance(value, str):
        if "{{" not in value and "{%" not in value and "{#" not in value:
            return value
        return _compile_template(value, columns, slots)
    if isinstance(value, Mapping):
        return {str(k): _compile(v, columns, slots) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_compile(v, columns, slots) for v in value]
    return value


def _compile_template(source: str, columns: Sequence[str], slots: Slots) -> str:
    from jinja2 import Environment, nodes
    from jinja2.exceptions import TemplateSyntaxError

    refused = (
        f"requests_table: template {source[:80]!r} is not plain text with {{{{ column }}}} "
        "substitutions (filters, control blocks, expressions and row[...] are not rendered "
        "inside BigQuery); compute the text in sql"
    )
    try:
        # Jinja's own parser, set as the row templates' environment is (trailing newline kept).
        ast = Environment(keep_trailing_newline=True, autoescape=False).parse(source)  # noqa: S701  (parsed, never rendered)
    except TemplateSyntaxError as exc:
        raise ConfigurationError(f"requests_table: template {source[:80]!r}: {exc}") from None
    out: list[str] = []
    for node in ast.body:
        if not isinstance(node, nodes.Output):
            raise ConfigurationError(refused)
        for child in node.nodes:
            if isinstance(child, nodes.TemplateData):
                out.append(child.data)
            elif isinstance(child, nodes.Name) and child.ctx == "load":
                if child.name not in columns:
                    raise ConfigurationError(
                        f"template {source[:80]!r} uses {child.name}, which the query does not return "
                        f"(columns: {', '.join(columns)})"
                    )
                out.append(slots.add(child.name))
            else:
                raise ConfigurationError(refused)
    return "".join(out)


def split_at_slots(text: str, slots: Slots) -> list[str | tuple[str, int]]:
    """``text`` as literal pieces and ``("cid", 0)`` / ``("slot", n)`` markers, in order."""
    pieces: list[str | tuple[str, int]] = []
    last = 0
    for found in slots.pattern.finditer(text):
        pieces.append(text[last : found.start()])
        name = found.group(1)
        pieces.append(("cid", 0) if name == "cid" else ("slot", int(name[1:])))
        last = found.end()
    pieces.append(text[last:])
    return [p for p in pieces if p != ""]


def concat_sql(pieces: Sequence[str | tuple[str, int]], cid: str, texts: Sequence[str]) -> str:
    """SQL ``CONCAT`` of literal pieces, the custom_id expression and the escaped slot texts."""
    parts = [
        sql_literal(p) if isinstance(p, str) else (cid if p[0] == "cid" else texts[p[1]]) for p in pieces
    ]
    return f"CONCAT({', '.join(parts)})" if len(parts) > 1 else (parts[0] if parts else "''")


def check_slots(text: str, slots: Slots, what: str, with_cid: bool) -> None:
    """Every sentinel once in ``text`` (an encoding that dropped or repeated a substitution
    could not be rendered row by row)."""
    found = [m.group(1) for m in slots.pattern.finditer(text)]
    wanted = [*(["cid"] if with_cid else []), *(f"s{i}" for i in range(len(slots.columns)))]
    if sorted(found) != sorted(wanted):
        raise ConfigurationError(
            f"requests_table: the {what} does not carry each templated value exactly once, so it "
            "cannot be rendered in SQL; compute the text in sql and use the file route"
        )


def custom_id_sql(keys: Sequence[tuple[str, str]], prefix: str, quote: Any) -> tuple[str, str]:
    """SQL for ``keys.custom_id_for`` of the key columns ``(name, BigQuery type)``: the tagged
    key's JSON text (hashed when the id is not readable), and the custom_id reading that text
    from the column ``abp_kc`` (two steps: some BigQuery-compatible servers cannot translate the
    expression nested in one).

    :raises ConfigurationError: a key type whose custom_id SQL cannot render exactly.
    """
    for name, kind in keys:
        if kind not in INTEGER_TYPES | TEXT_TYPES:
            raise ConfigurationError(
                f"requests_table: key column {name!r} is {kind}; the BigQuery route renders the "
                "custom_id of INT64 and STRING keys only (cast the key in sql)"
            )
    tagged = []
    for name, kind in keys:
        column = quote(name)
        if kind in INTEGER_TYPES:
            tagged.append(f"'[\"i\",\"', CAST({column} AS STRING), '\"]'")
        else:
            tagged.append(f"'[\"s\",\"', {json_escape_sql(column)}, '\"]'")
    comma = ", ',', "
    canonical = f"CONCAT('[', {comma.join(tagged)}, ']')"
    hashed = (
        f"CONCAT({sql_literal(prefix + keymod.HASH_PREFIX)}, "
        f"SUBSTR(LOWER(TO_BASE32(SHA256(abp_kc))), 1, {keymod.MAX_CUSTOM_ID - 2 - keymod.MAX_PREFIX}))"
    )
    if len(keys) != 1:
        return canonical, hashed
    name, kind = keys[0]
    column = quote(name)
    if kind in INTEGER_TYPES:
        # Up to 20 characters after a prefix of at most MAX_PREFIX: always within 64, readable.
        return "''", f"CONCAT({sql_literal(prefix)}, CAST({column} AS STRING))"
    readable = (
        f"REGEXP_CONTAINS({column}, r'^[A-Za-z0-9_-]+$') AND NOT REGEXP_CONTAINS({column}, r'^-?[0-9]+$') "
        f"AND NOT STARTS_WITH({column}, {sql_literal(keymod.HASH_PREFIX)}) "
        f"AND LENGTH({column}) <= {keymod.MAX_CUSTOM_ID - len(prefix)}"
    )
    return canonical, f"CASE WHEN {readable} THEN CONCAT({sql_literal(prefix)}, {column}) ELSE {hashed} END"


def grouped(expression: str) -> str:
    """SQL for an integer written with thousands separators, as Python's ``f"{n:,}"``.

    ``FORMAT("%'d")`` groups digits; BigQuery separates them with commas, a server that follows
    another locale with apostrophes, made commas here.
    """
    return f"REPLACE(FORMAT(\"%'d\", {expression}), \"'\", ',')"


@dataclass
class RequestsPlan:
    """The SQL of one BigQuery build, from the query's schema and the body."""

    source: str
    keys: list[tuple[str, str]]
    text_columns: dict[str, str]
    line: list[str | tuple[str, int]]
    hash_text: list[str | tuple[str, int]]
    request: list[str | tuple[str, int]]
    slots: Slots
    prefix: str
    on_null: str
    max_line: int
    quote: Any
    #: The canonical body with a sentinel for each substitution (every row's has its shape).
    body: dict[str, Any] = field(default_factory=dict)

    @property
    def template(self) -> str:
        """Digest of the encoded request's literal pieces (model, generation config and every
        other part no row changes): part of each shard's fingerprint."""
        pieces = [p if isinstance(p, str) else list(p) for p in self.request]
        return hashlib.sha256(orjson.dumps(pieces)).hexdigest()[:32]

    def slot_texts(self) -> list[str]:
        """Per slot, the SQL of its JSON-escaped text (NULL stays NULL unless on_null='empty')."""
        texts = []
        for column in self.slots.columns:
            value = self.quote(column)
            if self.text_columns[column] in INTEGER_TYPES:
                value = f"CAST({value} AS STRING)"
            if self.on_null == "empty":
                value = f"COALESCE({value}, '')"
            texts.append(json_escape_sql(value))
        return texts

    def work_select(self) -> str:
        """Every row of the source with its custom_id, request, request_hash, row number and,
        for a row that cannot be sent, the reject code and reason.

        Built in layers (escaped texts, then the texts that use them, then their hashes): some
        BigQuery-compatible servers cannot translate the whole expression nested in one.
        """
        q = self.quote
        canonical_key, cid = custom_id_sql(self.keys, self.prefix, q)
        texts = [f"abp_t{i}" for i in range(len(self.slots.columns))]
        escaped = "".join(f", {sql} AS abp_t{i}" for i, sql in enumerate(self.slot_texts()))
        key_cols = ", ".join(q(k) for k, _ in self.keys)
        line = concat_sql(self.line, "abp_cid", texts)
        digest = concat_sql(self.hash_text, "abp_cid", texts)
        request = concat_sql(self.request, "abp_cid", texts)
        whens = [
            (f"{q(k)} IS NULL", "null_key", sql_literal(f"key column {k!r} is NULL")) for k, _ in self.keys
        ]
        if self.on_null == "reject":
            used = list(dict.fromkeys(self.slots.columns))
            whens += [(f"{q(c)} IS NULL", "null_value", sql_literal(f"column {c!r} is NULL")) for c in used]
        whens.append(
            (
                f"abp_bytes > {self.max_line}",
                "line_too_large",
                f"CONCAT('line is ', {grouped('abp_bytes')}, ' bytes; the limit is ', "
                f"{sql_literal(f'{self.max_line:,}')})",
            )
        )
        code = "CASE " + " ".join(f"WHEN {w} THEN {sql_literal(c)}" for w, c, _ in whens) + " END"
        reason = "CASE " + " ".join(f"WHEN {w} THEN {r}" for w, _, r in whens) + " END"
        null_key = " OR ".join(f"{q(k)} IS NULL" for k, _ in self.keys)
        used_cols = ", ".join(q(c) for c in dict.fromkeys(self.slots.columns) if c not in dict(self.keys))
        layer0 = f"SELECT *, ROW_NUMBER() OVER () AS abp_row FROM ({self.source})"
        kept = f"{key_cols}, {used_cols}" if used_cols else key_cols
        layer1 = f"SELECT {kept}, abp_row, {canonical_key} AS abp_kc{escaped} FROM ({layer0})"
        layer2 = f"SELECT *, {cid} AS abp_cid FROM ({layer1})"
        layer3 = (
            f"SELECT *, {line} AS abp_line, {digest} AS abp_digest, {request} AS abp_request FROM ({layer2})"
        )
        layer4 = (
            f"SELECT *, BYTE_LENGTH(abp_line) AS abp_bytes, "
            f"SUBSTR(TO_HEX(SHA256(abp_digest)), 1, {HASH_CHARS}) AS abp_hash FROM ({layer3})"
        )
        return (
            f"SELECT {kept}, abp_row, "
            f"IF({null_key}, NULL, abp_cid) AS custom_id, abp_hash AS request_hash, "
            f"abp_request AS request, {code} AS abp_code, {reason} AS abp_reason FROM ({layer4})"
        )


def plan_requests(
    *,
    source: str,
    schema: Mapping[str, str],
    key_columns: Sequence[str],
    messages: Any,
    canonical_body: Any,
    endpoint: str,
    encode_request: Any,
    prefix: str,
    on_null: str,
    max_line: int,
    quote: Any,
) -> RequestsPlan:
    """Compile a build into SQL (see the module docstring).

    :param source: the query whose rows become requests.
    :param schema: its columns and their BigQuery types.
    :param key_columns: the key columns.
    :param messages: the operator's ``messages``.
    :param canonical_body: ``compiled messages -> canonical body`` (defaults and model merged,
        as the file route's body builder does).
    :param endpoint: the url of every line.
    :param encode_request: ``canonical line -> the request object the job reads``.
    :param prefix: the custom_id prefix.
    :param on_null: ``reject``, ``empty`` or ``fail`` (checked by the caller before the writes).
    :param max_line: the largest canonical line in bytes.
    :param quote: the identifier quoting of the source database.
    """
    missing = [k for k in key_columns if k not in schema]
    if missing:
        raise ConfigurationError(
            f"key column(s) {', '.join(missing)} not in the query result (columns: {', '.join(schema)})"
        )
    clash = [k for k in key_columns if k in (*REQUEST_COLUMNS, *OUTPUT_COLUMNS) or k.startswith("abp_")]
    if clash:
        raise ConfigurationError(
            f"requests_table: key column(s) {', '.join(clash)} clash with the request or prediction "
            "tables' own columns; rename them in sql"
        )
    own = [c for c in schema if c.lower().startswith("abp_")]
    if own:
        raise ConfigurationError(
            f"requests_table: column(s) {', '.join(own)} use the prefix abp_, which the build's SQL "
            "keeps for its own columns; rename them in sql"
        )
    slots = Slots()
    compiled = compile_messages(messages, list(schema), slots)
    taken = sorted({c for c in slots.columns if c in (*REQUEST_COLUMNS, *OUTPUT_COLUMNS)} - set(key_columns))
    if taken:
        raise ConfigurationError(
            f"requests_table: template column(s) {', '.join(taken)} clash with the request tables' own "
            "columns; rename them in sql"
        )
    for column in slots.columns:
        kind = schema[column]
        if kind not in INTEGER_TYPES | TEXT_TYPES:
            raise ConfigurationError(
                f"requests_table: template column {column!r} is {kind}; the BigQuery route renders "
                "STRING and INT64 values only (format the text in sql)"
            )
    body = canonical_body(compiled)
    canonical = {"custom_id": slots.custom_id, "method": "POST", "url": endpoint, "body": body}
    line = orjson.dumps(canonical).decode()
    digest = orjson.dumps({"url": endpoint, "body": body}, option=orjson.OPT_SORT_KEYS).decode()
    request = orjson.dumps(encode_request(canonical)).decode()
    check_slots(line, slots, "canonical line", True)
    check_slots(digest, slots, "request hash text", False)
    check_slots(request, slots, "encoded request", False)
    return RequestsPlan(
        source=source,
        keys=[(k, schema[k]) for k in key_columns],
        text_columns={c: schema[c] for c in slots.columns},
        line=split_at_slots(line, slots),
        hash_text=split_at_slots(digest, slots),
        request=split_at_slots(request, slots),
        slots=slots,
        prefix=prefix,
        on_null=on_null,
        max_line=max_line,
        quote=quote,
        body=body,
    )


def key_type(kind: str) -> str:
    """The manifest's portable key type of a BigQuery key column type."""
    return "integer" if kind in INTEGER_TYPES else "text"


def duplicate_error(rows: Sequence[tuple[Any, ...]], key_columns: Sequence[str]) -> DuplicateKeyError:
    """The error of keys given to more than one row (``(count, key values...)`` rows)."""
    shown = "; ".join(f"{dict(zip(key_columns, r[1:], strict=False))} x{r[0]}" for r in rows)
    return DuplicateKeyError(
        f"key(s) of ({', '.join(key_columns)}) appear on more than one row: {shown}. "
        "Make key_columns unique per row (add a column or deduplicate in the query)."
    )


@dataclass
class BuiltTables:
    """What a BigQuery build wrote: per shard ``(index, bq:// URI, lines, bytes, fingerprint)``,
    the rejects table and the counts."""

    shards: list[tuple[int, str, int, int, str]]
    rejects_table: str
    rows_read: int
    rows_written: int
    rows_rejected: int
    reject_codes: dict[str, int]
    first_reasons: dict[str, str]


def write_tables(
    client: Any,
    plan: RequestsPlan,
    *,
    project: str,
    dataset: str,
    name: str,
    token: str,
    max_lines: int,
    log: Any = None,
) -> BuiltTables:
    """Run the build's statements: the work table, the duplicate check, the rejects table and one
    table per shard (a rerun of the same run replaces them and drops the shard tables of this run
    it no longer writes; another run's tables are never touched).

    :param client: a ``google.cloud.bigquery.Client``.
    :param name: the tables' name prefix in ``dataset``.
    :param token: the run's token (:func:`run_token`), in every table name.
    :param max_lines: rows per shard table.
    """
    q = plan.quote
    where = f"{project}.{dataset}"
    own = f"{name}_{token}"
    work = f"{where}.{own}_work"
    expiry = f"OPTIONS(expiration_timestamp = TIMESTAMP_ADD(CURRENT_TIMESTAMP(), INTERVAL {TABLE_DAYS} DAY))"

    def run(sql: str) -> list[tuple[Any, ...]]:
        return [tuple(r.values()) for r in client.query(sql, api_method="INSERT").result()]

    key_cols = ", ".join(q(k) for k, _ in plan.keys)
    # Each row's place, once, in the work table: rows sent first (in custom_id order), rejects
    # after; shard n is places n*max_lines+1..(n+1)*max_lines. Kept as the bare ROW_NUMBER (the
    # shard number as DIV of it is not computed by some BigQuery-compatible servers, which
    # return a window function's value unchanged when an expression wraps it).
    numbered = (
        f"SELECT *, ROW_NUMBER() OVER (ORDER BY IF(abp_code IS NULL, 0, 1), custom_id) AS abp_place "
        f"FROM ({plan.work_select()})"
    )
    run(f"CREATE OR REPLACE TABLE {q(work)} {expiry} AS {numbered}")
    try:
        if plan.on_null == "fail" and plan.slots.columns:
            nulls = " OR ".join(f"{q(c)} IS NULL" for c in dict.fromkeys(plan.slots.columns))
            found = run(f"SELECT abp_row FROM {q(work)} WHERE custom_id IS NOT NULL AND ({nulls}) LIMIT 1")
            if found:
                from airflow_batch_provider.rows_to_lines import NullValueError

                raise NullValueError(f"row {found[0][0]}: a template column is NULL and on_null='fail'")
        dups = run(
            f"SELECT COUNT(*) AS n, {key_cols} FROM {q(work)} WHERE custom_id IS NOT NULL "
            f"GROUP BY custom_id, {key_cols} HAVING COUNT(*) > 1 ORDER BY n DESC LIMIT 10"
        )
        if dups:
            raise duplicate_error(dups, [k for k, _ in plan.keys])
        codes = run(f"SELECT abp_code, COUNT(*), MIN(abp_reason) FROM {q(work)} GROUP BY abp_code")
        rejects = f"{where}.{own}_rejects"
        run(
            f"CREATE OR REPLACE TABLE {q(rejects)} {expiry} AS SELECT abp_row AS {q('row')}, {key_cols}, "
            f"custom_id, abp_code AS code, abp_reason AS reason FROM {q(work)} WHERE abp_code IS NOT NULL"
        )
        written = sum(int(n) for code, n, _ in codes if code is None)
        count = -(-written // max_lines)
        shards = []
        for index in range(count):
            table = f"{where}.{own}_shard_{index:03d}"
            low, high = index * max_lines + 1, (index + 1) * max_lines
            run(
                f"CREATE OR REPLACE TABLE {q(table)} {expiry} AS SELECT {key_cols}, custom_id, request_hash, "
                f"request FROM {q(work)} WHERE abp_code IS NULL AND abp_place BETWEEN {low} AND {high}"
            )
            ((lines, size, fingerprint),) = run(fingerprint_sql(table, plan.template, q))
            shards.append((index, f"bq://{table}", int(lines), int(size or 0), str(fingerprint)))
            if log is not None:
                log.info("Wrote shard table %s: %d request(s)", table, lines)
        kept = {f"{own}_shard_{i:03d}" for i in range(count)}
        _drop_stale(client, project, dataset, f"{own}_shard_", kept)
    finally:
        client.delete_table(work, not_found_ok=True)
    rejected = {str(code): int(n) for code, n, _ in codes if code is not None}
    return BuiltTables(
        shards=shards,
        rejects_table=f"bq://{rejects}",
        rows_read=sum(int(n) for _, n, _ in codes),
        rows_written=written,
        rows_rejected=sum(rejected.values()),
        reject_codes=rejected,
        first_reasons={str(code): str(reason) for code, _, reason in codes if code is not None},
    )


def _drop_stale(client: Any, project: str, dataset: str, start: str, keep: set[str]) -> None:
    """Drop the shard tables of an earlier try of this run that this one did not write (``start``
    carries the run's token: another run's tables never match)."""
    for table in client.list_tables(f"{project}.{dataset}"):
        if table.table_id.startswith(start) and table.table_id not in keep:
            client.delete_table(f"{project}.{dataset}.{table.table_id}", not_found_ok=True)
