"""Load the prompt dataset (`--prompt-data`) into `Prompt` records, once, before any rollout.

A dataset is a `.jsonl` file (one JSON object per line; blank lines are skipped) or a `.parquet`
file. Each row holds the prompt under `--input-key` (a string, or a list of chat messages when
`--apply-chat-template` is on), optionally a label under `--label-key` (kept as a string) and a
dict under `--metadata-key`. Rows are templated and tokenized here so that engines get token ids.

Special tokens. Prompt ids come from `tokenizer(text, add_special_tokens=False)`, then BOS is
prepended when the tokenizer itself adds a BOS by convention (Llama-style: its post-processor puts
one in front) and the text does not already start with it (a chat template usually writes BOS into
the text; tokenizing that with `add_special_tokens=True` would double it). We never add EOS or any
other trailing special token: the prompt is the start of a sequence the engine continues. A
tokenizer that defines a `bos_token` but does not add it (GPT-2, Qwen) gets no BOS.

`Prompt.index` is the 0-based row number in the file (blank JSONL lines not counted); it stays the
row's id when rows are dropped. Bad rows do not stop the scan: up to `MAX_REPORTED_ERRORS` of them
are reported together in one `ConfigError`, each naming the file, the 1-based line (JSONL) or row
(parquet) number, and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from miles.config import ConfigError, DataConfig
from miles.types import Prompt

ACCEPTED_SUFFIXES = (".jsonl", ".parquet")
MAX_REPORTED_ERRORS = 10
MAX_LISTED_ROWS = 5             # rows named in a missing-key line
_PARQUET_BATCH_ROWS = 4096

log = structlog.get_logger("miles.data")


class _BadRow(Exception):
    """A problem with one row; collected, then reported with the others."""


class _MissingKey(_BadRow):
    """A row without the --input-key column: reported as one line for all such rows (`missing_key_problem`)."""


@dataclass(frozen=True)
class _Row:
    where: str                      # "line 3" (JSONL, 1-based) or "row 3" (parquet, 1-based)
    data: dict[str, Any] | None     # None when the row could not be parsed
    error: str | None = None        # why it could not be parsed


def load_prompts(cfg: DataConfig, tokenizer: Any, *, tools: list[dict[str, Any]] | None = None) -> list[Prompt]:
    """Read, template, tokenize and length-filter `cfg.prompt_data`; raise one ConfigError for bad input.

    Prompts longer than `cfg.max_prompt_len` tokens are dropped; how many is logged
    (`prompts_dropped`). An empty result is an error. `tools` (multi-turn tool specs) go to the chat
    template with the messages.
    """
    path = Path(cfg.prompt_data)
    rows = _read_rows(path, cfg)
    encoder = _Encoder(tokenizer, apply_chat_template=cfg.apply_chat_template,
                       template_path=cfg.chat_template_path, template_kwargs=cfg.apply_chat_template_kwargs,
                       tools=tools)
    prompts = _build_prompts(path, rows, cfg, encoder)
    kept = _drop_long_prompts(path, prompts, cfg.max_prompt_len)
    log.info("prompts_loaded", path=str(path), num_prompts=len(kept))
    return kept


def _read_rows(path: Path, cfg: DataConfig) -> Iterator[_Row]:
    suffix = path.suffix.lower()
    if suffix not in ACCEPTED_SUFFIXES:
        raise ConfigError(f"--prompt-data {path}: unsupported file type {path.suffix or '(none)'!r}; "
                          f"accepted suffixes are {', '.join(ACCEPTED_SUFFIXES)}")
    if not path.exists():
        raise ConfigError(f"--prompt-data {path}: file not found; check the path (relative paths start "
                          f"from the working directory {Path.cwd()})")
    if not path.is_file():
        raise ConfigError(f"--prompt-data {path}: not a file; pass a {' or '.join(ACCEPTED_SUFFIXES)} file")
    return _jsonl_rows(path) if suffix == ".jsonl" else _parquet_rows(path, cfg)


def _jsonl_rows(path: Path) -> Iterator[_Row]:
    # Binary mode: a bad byte sequence is one bad line, not a crash of the whole read.
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"line {lineno}"
            try:
                data = json.loads(line.rstrip(b"\r\n"))
            except json.JSONDecodeError as e:
                yield _Row(where, None, f"malformed JSON ({e.msg} at column {e.colno}); "
                                        "each line must be one complete JSON object")
                continue
            except UnicodeDecodeError as e:
                yield _Row(where, None, f"not UTF-8 text ({e.reason}); re-encode the file as UTF-8")
                continue
            if not isinstance(data, dict):
                yield _Row(where, None, f"expected a JSON object, got a JSON {type(data).__name__}")
                continue
            yield _Row(where, data)


def _parquet_rows(path: Path, cfg: DataConfig) -> Iterator[_Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"--prompt-data {path}: not a readable parquet file ({e})") from e
    names = parquet.schema_arrow.names
    if cfg.input_key not in names:
        raise ConfigError(f"--prompt-data {path}: no column {cfg.input_key!r} for --input-key; "
                          f"the columns are {names}; set --input-key to one of them")
    wanted = [k for k in (cfg.input_key, cfg.label_key, cfg.metadata_key) if k is not None and k in names]
    rownum = 0
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=list(dict.fromkeys(wanted))):
        for data in batch.to_pylist():
            rownum += 1
            yield _Row(f"row {rownum}", data)


class _Encoder:
    """Turns a row's input into (text, ids); the chat template and the BOS rule are decided once."""

    def __init__(self, tokenizer: Any, *, apply_chat_template: bool, template_path: str | None = None,
                 template_kwargs: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None):
        # --chat-template-path replaces the tokenizer's template; --apply-chat-template-kwargs are its
        # variables; the tool specs (--generate-tool-specs-path) go to it as `tools`
        self._template_args: dict[str, Any] = dict(template_kwargs or {})
        if tools:
            self._template_args["tools"] = tools
        if template_path is not None:
            self._template_args["chat_template"] = Path(template_path).read_text()
        if apply_chat_template and template_path is None and not getattr(tokenizer, "chat_template", None):
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise ConfigError(f"--apply-chat-template: the tokenizer {name!r} has no chat template; drop "
                              "--apply-chat-template, pass one with --chat-template-path FILE, or use a tokenizer "
                              "whose tokenizer_config.json (or chat_template.jinja) defines one")
        self._tokenizer = tokenizer
        self._apply_chat_template = apply_chat_template
        self._bos = _conventional_bos(tokenizer)

    def text(self, value: Any) -> str:
        if self._apply_chat_template:
            messages = _as_messages(value)
            try:
                return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                           **self._template_args)
            except Exception as e:  # noqa: BLE001 - a template error (jinja2's), reported with the row
                raise _BadRow(f"the chat template failed on this row: {type(e).__name__}: {e}") from e
        if isinstance(value, list):
            raise _BadRow("input is a list (chat messages?), not a string; pass --apply-chat-template "
                          "to render chat messages")
        if not isinstance(value, str):
            raise _BadRow(f"input must be a string, got {type(value).__name__} {_short(value)}")
        return value

    def ids(self, text: str) -> tuple[int, ...]:
        ids = list(self._tokenizer(text, add_special_tokens=False)["input_ids"])
        if self._bos is not None and ids[:1] != [self._bos]:
            ids.insert(0, self._bos)
        return tuple(ids)


def _conventional_bos(tokenizer: Any) -> int | None:
    """The BOS id when the tokenizer adds one in front by itself, else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos if list(probe[:1]) == [bos] else None


def _as_messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and value and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value
    ):
        return value
    raise _BadRow("input must be a string or a non-empty list of chat messages "
                  f"[{{'role': ..., 'content': ...}}, ...], got {type(value).__name__} {_short(value)}")


def _build_prompts(path: Path, rows: Iterator[_Row], cfg: DataConfig, encoder: _Encoder) -> list[Prompt]:
    problems = _Problems(path)
    prompts: list[Prompt] = []
    label_seen, first_keys, num_rows = False, None, 0
    no_input: list[tuple[str, list[str]]] = []      # (where, the row's keys)
    for index, row in enumerate(rows):
        num_rows += 1
        if row.data is None:
            problems.add(row.where, row.error or "unreadable row")
            continue
        first_keys = first_keys if first_keys is not None else sorted(row.data)
        label_seen = label_seen or (cfg.label_key is not None and row.data.get(cfg.label_key) is not None)
        try:
            prompts.append(_build_prompt(index, row.data, cfg, encoder))
        except _MissingKey:
            no_input.append((row.where, sorted(row.data)))
        except _BadRow as e:
            problems.add(row.where, str(e))
    if num_rows == 0:
        raise ConfigError(f"--prompt-data {path}: the dataset is empty (no rows); point --prompt-data at a "
                          "file with at least one row")
    if no_input:
        problems.add_line(missing_key_problem(path, "--input-key", cfg.input_key, [w for w, _ in no_input],
                                              num_rows, no_input[0][1]))
    if cfg.label_key is not None and not label_seen and first_keys is not None:
        problems.add_line(missing_key_problem(path, "--label-key", cfg.label_key, ["every row"], num_rows, first_keys))
    problems.raise_if_any()
    return prompts


def missing_key_problem(path: Path | str, flag: str, key: str, wheres: list[str], num_rows: int,
                        keys: list[str] | None) -> str:
    """One line for every row that lacks `key`: how many, the first few, and the keys a row has."""
    shown = ", ".join(w.split(" ", 1)[-1] for w in wheres[:MAX_LISTED_ROWS])
    more = ", ..." if len(wheres) > MAX_LISTED_ROWS else ""
    if wheres == ["every row"] or len(wheres) == num_rows:
        count = f"none of the {num_rows} rows has {key!r}" if num_rows > 1 else f"the only row has no {key!r}"
    else:
        unit = wheres[0].split(" ", 1)[0] + ("s" if len(wheres) > 1 else "")
        count = f"{len(wheres)} of {num_rows} rows ({unit} {shown}{more}) have no {key!r}"
    has = f"; a row has keys {keys}" if keys is not None else ""
    return (f"{path}: {count} for {flag}{has}; set {flag} to "
            + ("one of them" if keys is not None else "the right key") + (" or drop it" if flag == "--label-key" else ""))


def _build_prompt(index: int, row: dict[str, Any], cfg: DataConfig, encoder: _Encoder) -> Prompt:
    if cfg.input_key not in row:
        raise _MissingKey()
    text = encoder.text(row[cfg.input_key])
    if not text.strip():
        raise _BadRow("input is empty; remove the row")
    metadata = row.get(cfg.metadata_key) if cfg.metadata_key is not None else None
    if metadata is not None and not isinstance(metadata, dict):
        raise _BadRow(f"--metadata-key {cfg.metadata_key!r} must hold an object (dict), "
                      f"got {type(metadata).__name__} {_short(metadata)}")
    raw_label = row.get(cfg.label_key) if cfg.label_key is not None else None
    return Prompt(index=index, text=text, prompt_ids=encoder.ids(text), label=_as_label(raw_label),
                  metadata=dict(metadata or {}))


def _as_label(value: Any) -> str | None:
    if value is None:
        return None
    # Structured labels keep a parseable form; str() of a dict would be Python repr.
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def _drop_long_prompts(path: Path, prompts: list[Prompt], max_len: int | None) -> list[Prompt]:
    if max_len is None:
        return prompts
    kept = [p for p in prompts if len(p.prompt_ids) <= max_len]
    if not kept:
        shortest = min(len(p.prompt_ids) for p in prompts)
        raise ConfigError(f"--prompt-data {path}: all {len(prompts)} prompts are longer than "
                          f"--max-prompt-len {max_len} tokens (the shortest has {shortest}); raise --max-prompt-len")
    if len(kept) < len(prompts):
        log.info("prompts_dropped", path=str(path), num_dropped=len(prompts) - len(kept),
                 num_kept=len(kept), max_prompt_len=max_len)
    return kept


class _Problems:
    """Collects row errors; keeps the first MAX_REPORTED_ERRORS messages and counts the rest."""

    def __init__(self, path: Path):
        self._path = path
        self._messages: list[str] = []
        self._count = 0

    def add(self, where: str, message: str) -> None:
        self._count += 1
        if len(self._messages) < MAX_REPORTED_ERRORS:
            self._messages.append(f"{self._path}: {where}: {message}")

    def add_line(self, message: str) -> None:
        """A problem that already names the file and its rows (a summary of many rows)."""
        self._count += 1
        self._messages.append(message)

    def raise_if_any(self) -> None:
        if not self._count:
            return
        messages = list(self._messages)
        if self._count > len(messages):
            messages.append(f"{self._path}: ... and {self._count - len(messages)} more bad rows")
        raise ConfigError(messages)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
