"""Degraded mode: when no model can answer, answer with cited excerpts from a document corpus.

At start-up :meth:`Corpus.build` indexes a folder of Markdown (``.md``) and text (``.txt``)
documents, recursively, into an SQLite FTS5 table. Markdown is split at its headings, so each row
is one section: its document's title (the first ``# `` heading, or the file name), its heading
path, its relative path and its text. :meth:`Corpus.search` ranks sections with BM25 and keeps the
best few per document. :func:`degraded_answer` and :func:`degraded_chunks` turn the hits into an
OpenAI-shaped answer that says plainly that it is not a model's answer.

The answer's ``finish_reason`` is ``"degraded"``, a tidegate value outside OpenAI's set, so a
client can tell it apart from a generated answer; ``model`` is ``"tidegate-degraded"`` and the
usage is zero, because no tokens were spent. A ``tidegate`` field carries the citations as data.

Everything here is synchronous: SQLite runs in-process and a search over a documentation-sized
corpus takes well under a millisecond.
"""

from __future__ import annotations

import os
import re
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final, TypedDict, Unpack

import structlog

from tidegate.errors import ConfigError
from tidegate.gateway.redaction import OutputFilter, strip_invisible
from tidegate.providers.wire import chat_chunk, chat_completion, usage

__all__ = [
    "DEGRADED_FINISH_REASON",
    "DEGRADED_MODEL",
    "DOCUMENT_SUFFIXES",
    "NOTICE",
    "Corpus",
    "Excerpt",
    "Stamp",
    "degraded_answer",
    "degraded_chunks",
    "match_expression",
    "query_terms",
    "question_of",
]

log = structlog.get_logger("tidegate")

DEGRADED_FINISH_REASON: Final = "degraded"
DEGRADED_MODEL: Final = "tidegate-degraded"
NOTICE: Final = (
    "The language model is unavailable right now. These excerpts from the documentation may help:"
)
#: File name endings that are indexed (compared case-insensitively).
DOCUMENT_SUFFIXES: Final = frozenset({".md", ".txt"})
#: Joins a heading path and a title to a section in citations: U+203A, which reads as a
#: breadcrumb and, unlike ">", is not Markdown syntax.
SECTION_SEPARATOR: Final = " \u203a "

#: Files above this size are skipped: a corpus is documentation, not data dumps.
DEFAULT_MAX_FILE_BYTES: Final = 4 * 1024 * 1024
DEFAULT_EXCERPT_CHARS: Final = 300
#: At most this many distinct terms of a question are searched; the rest add cost, not recall.
MAX_QUERY_TERMS: Final = 32
#: BM25 column weights (title, section, body, path, doc): a match in a title or a heading says
#: more about a section than one in its body.
_BM25_WEIGHTS: Final = "3.0, 2.0, 1.0, 0.0, 0.0"

# The tokenizer's idea of a word: letters and digits, with ``_`` as a separator, as unicode61 does.
_TERM = re.compile(r"[^\W_]+")
#: Words too common to say what a question is about; searched only if nothing else is left.
_STOPWORD_TEXT: Final = (
    "a an and are as at be by can do does for from how i if in is it me my of on or so that "
    "the this to was what when where which who why will with you your"
)
_STOPWORDS: Final = frozenset(_STOPWORD_TEXT.split())
_ATX_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?[ \t]*$")
_CLOSING_HASHES = re.compile(r"(?:^|[ \t]+)#+[ \t]*$")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")

_SCHEMA = """
CREATE VIRTUAL TABLE sections USING fts5(
    title, section, body, path UNINDEXED, doc UNINDEXED,
    tokenize = 'porter unicode61 remove_diacritics 2'
)
"""
# Rank every matching section, number the sections of each document by rank, keep the first
# ``limit_per_doc`` of each, and return the best ``limit`` overall (BM25: lower is better).
_SEARCH = f"""
SELECT title, section, path, snip, score FROM (
    SELECT *, row_number() OVER (PARTITION BY doc ORDER BY score, id) AS rank_in_doc FROM (
        SELECT rowid AS id, title, section, path, doc,
               snippet(sections, 2, :mark, :unmark, '…', :tokens) AS snip,
               bm25(sections, {_BM25_WEIGHTS}) AS score
        FROM sections WHERE sections MATCH :match
    )
)
WHERE rank_in_doc <= :per_doc ORDER BY score, id LIMIT :limit
"""
# Marks around matched terms in a snippet, so the excerpt can be cut around the match. Control
# characters cannot occur in indexed text: documents are stripped of them before indexing.
_MARK, _UNMARK = "\x02", "\x03"


@dataclass(frozen=True, slots=True)
class Excerpt:
    """One search hit: where it comes from and a bounded piece of its text.

    ``score`` is the negated BM25 rank: higher is more relevant; only comparisons within one
    search mean anything.
    """

    title: str
    section: str
    path: str
    text: str
    score: float

    @property
    def citation(self) -> str:
        """``[title SEP section] (path)`` with :data:`SECTION_SEPARATOR`; ``[title] (path)`` if no section."""
        where = f"{self.title}{SECTION_SEPARATOR}{self.section}" if self.section else self.title
        return f"[{where}] ({self.path})"


@dataclass(frozen=True, slots=True)
class _Section:
    title: str
    section: str
    body: str


class Corpus:
    """A searchable index of a folder of documents; build it once with :meth:`build`.

    Safe to share between threads (one lock around the connection), so a caller may run
    :meth:`search` in a worker thread. ``len(corpus)`` is the number of sections indexed;
    :attr:`skipped` lists the files that could not be read (not UTF-8, too large, unreadable).
    """

    __slots__ = ("_conn", "_documents", "_excerpt_chars", "_lock", "_sections", "_skipped")

    def __init__(
        self,
        conn: sqlite3.Connection,
        *,
        documents: int,
        sections: int,
        skipped: tuple[str, ...],
        excerpt_chars: int,
    ) -> None:
        self._conn = conn
        self._documents = documents
        self._sections = sections
        self._skipped = skipped
        self._excerpt_chars = excerpt_chars
        self._lock = threading.Lock()

    @classmethod
    def build(
        cls,
        folder: str | os.PathLike[str],
        *,
        db_path: str | os.PathLike[str] = ":memory:",
        excerpt_chars: int = DEFAULT_EXCERPT_CHARS,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    ) -> Corpus:
        """Index every ``.md`` and ``.txt`` file under ``folder`` (hidden entries excluded).

        ``db_path`` is ``":memory:"`` (the default: one index per process) or a file; an
        existing index in that file is replaced, so two processes must not share one file.
        A folder that does not exist raises :class:`~tidegate.errors.ConfigError`; a file that
        cannot be read as UTF-8 is skipped with a warning.
        """
        if excerpt_chars < 20:
            raise ValueError(f"excerpt_chars must be at least 20, got {excerpt_chars!r}")
        if max_file_bytes <= 0:
            raise ValueError(f"max_file_bytes must be positive, got {max_file_bytes!r}")
        root = Path(folder)
        if not root.is_dir():
            raise ConfigError(f"the corpus folder {str(root)!r} does not exist or is not a folder")
        conn = sqlite3.connect(os.fspath(db_path), check_same_thread=False)
        try:
            conn.execute("DROP TABLE IF EXISTS sections")
            conn.execute(_SCHEMA)
            documents, sections, skipped = 0, 0, []
            for doc, path in enumerate(_document_files(root)):
                relative = path.relative_to(root).as_posix()
                text = _read(path, relative, max_file_bytes)
                if text is None:
                    skipped.append(relative)
                    continue
                rows = [
                    (part.title, part.section, part.body, relative, doc)
                    for part in _split_document(
                        # Hidden characters would split words for the tokenizer and mislead
                        # the snippet marks; they are never shown anyway.
                        strip_invisible(text),
                        name=path.name,
                        markdown=_is_markdown(path),
                    )
                ]
                conn.executemany("INSERT INTO sections VALUES (?, ?, ?, ?, ?)", rows)
                documents += 1
                sections += len(rows)
            conn.commit()
        except BaseException:
            conn.close()
            raise
        log.info(
            "corpus_indexed",
            folder=str(root),
            documents=documents,
            sections=sections,
            skipped=len(skipped),
        )
        return cls(
            conn,
            documents=documents,
            sections=sections,
            skipped=tuple(skipped),
            excerpt_chars=excerpt_chars,
        )

    def __len__(self) -> int:
        return self._sections

    @property
    def documents(self) -> int:
        """How many files were indexed (a file may hold many sections)."""
        return self._documents

    @property
    def skipped(self) -> tuple[str, ...]:
        """Relative paths of the files left out, in the order they were met."""
        return self._skipped

    def search(self, query: str, *, limit_per_doc: int = 1, limit: int = 3) -> list[Excerpt]:
        """The best sections for ``query``, most relevant first, at most ``limit_per_doc`` each.

        ``query`` is a user's text, never FTS5 syntax: its words are searched as plain terms, any
        of which may match. A query without words returns no hits.
        """
        if limit_per_doc < 1:
            raise ValueError(f"limit_per_doc must be at least 1, got {limit_per_doc!r}")
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit!r}")
        expression = match_expression(query)
        if not expression:
            return []
        with self._lock:
            rows = self._conn.execute(
                _SEARCH,
                {
                    "mark": _MARK,
                    "unmark": _UNMARK,
                    # About five characters a token; FTS5's own ceiling is 64 tokens.
                    "tokens": max(8, min(64, self._excerpt_chars // 5)),
                    "match": expression,
                    "per_doc": limit_per_doc,
                    "limit": limit,
                },
            ).fetchall()
        return [
            Excerpt(
                title=title,
                section=section,
                path=path,
                text=_bounded(snippet, self._excerpt_chars),
                score=-score,
            )
            for title, section, path, snippet, score in rows
        ]

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> Corpus:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Corpus(documents={self._documents}, sections={self._sections})"


# --------------------------------------------------------------------------- indexing


def _document_files(root: Path) -> Iterator[Path]:
    """Indexable files under ``root`` in a stable order, skipping hidden files and folders."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = Path(folder, name)
            if not name.startswith(".") and path.suffix.lower() in DOCUMENT_SUFFIXES:
                yield path


def _is_markdown(path: Path) -> bool:
    return path.suffix.lower() == ".md"


def _read(path: Path, relative: str, max_file_bytes: int) -> str | None:
    try:
        size = path.stat().st_size
        if size > max_file_bytes:
            log.warning("corpus_file_skipped", path=relative, reason="too_large", bytes=size)
            return None
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as error:
        log.warning("corpus_file_skipped", path=relative, reason="not_utf8", detail=str(error))
    except OSError as error:
        log.warning("corpus_file_skipped", path=relative, reason="unreadable", detail=str(error))
    return None


def _split_document(text: str, *, name: str, markdown: bool) -> list[_Section]:
    """The non-empty sections of one document, in order.

    A text file is one section. A Markdown file is cut at every ATX heading outside fenced code;
    a section's name is its heading path without the title heading. YAML front matter is dropped.
    """
    if not markdown:
        body = text.strip()
        return [_Section(name, "", body)] if body else []
    lines = _without_front_matter(text.splitlines())
    return _sections(lines, _headings(lines), name)


def _headings(lines: list[str]) -> list[tuple[int, int, str]]:
    """Every ATX heading outside fenced code: (line index, level, text)."""
    headings: list[tuple[int, int, str]] = []
    fence: str | None = None
    for index, line in enumerate(lines):
        opened = _FENCE.match(line)
        if fence is not None:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                fence = None
            continue
        if opened:
            fence = opened.group(1)
            continue
        heading = _ATX_HEADING.match(line)
        if heading:
            title_text = _CLOSING_HASHES.sub("", heading.group(2) or "").strip()
            headings.append((index, len(heading.group(1)), title_text))
    return headings


def _title(headings: list[tuple[int, int, str]], name: str) -> tuple[int | None, str]:
    """The title heading's line (if any) and the document's title: the first ``# `` heading's
    text, or else the file name."""
    first = next((heading for heading in headings if heading[1] == 1), None)
    if first is None:
        return None, name
    return first[0], first[2] or name


def _sections(lines: list[str], headings: list[tuple[int, int, str]], name: str) -> list[_Section]:
    """The text between one heading and the next, each under its heading path."""
    title_line, title = _title(headings, name)
    sections: list[_Section] = []
    stack: list[tuple[int, str]] = []  # (level, text) of the headings above the current line
    start = 0
    for index, level, heading_text in [*headings, (len(lines), 0, "")]:
        body = "\n".join(lines[start:index]).strip()
        if body:
            path = SECTION_SEPARATOR.join(name for _, name in stack if name)
            sections.append(_Section(title, path, body))
        while stack and stack[-1][0] >= level:
            stack.pop()
        # The title heading names the document, not a section: it stays out of the path.
        stack.append((level, "" if index == title_line else heading_text))
        start = index + 1
    return sections


def _without_front_matter(lines: list[str]) -> list[str]:
    if not lines or lines[0].strip() != "---":
        return lines
    for index in range(1, len(lines)):
        if lines[index].strip() in ("---", "..."):
            return lines[index + 1 :]
    return lines


def _bounded(snippet: str, limit: int) -> str:
    """``snippet`` on one line, at most ``limit`` characters, cut at words around the first match."""
    flat = " ".join(snippet.split())
    at = flat.find(_MARK)
    flat = flat.replace(_MARK, "").replace(_UNMARK, "")
    if len(flat) <= limit:
        return flat
    # Start a third of the window before the match, so the match and what follows it show.
    start = max(0, min(at - limit // 3, len(flat) - limit + 1)) if at > 0 else 0
    lead = start > 0
    room = limit - 1 if lead else limit
    trail = start + room < len(flat)
    if trail:
        room -= 1
    piece = flat[start : start + room]
    first_space = piece.find(" ")
    if lead and 0 <= first_space < at - start:
        piece = piece[first_space + 1 :]
    last_space = piece.rfind(" ")
    if trail and last_space > len(piece) // 2:
        piece = piece[:last_space]
    return ("…" if lead else "") + piece + ("…" if trail else "")


# --------------------------------------------------------------------------- queries


def query_terms(question: str) -> list[str]:
    """The distinct words of ``question``, lower-cased, in order, without common stopwords.

    If every word is a stopword they are kept, so that a short question still finds something.
    """
    seen: dict[str, None] = {}
    for match in _TERM.finditer(question.lower()):
        seen.setdefault(match.group(), None)
    terms = list(seen)
    content = [term for term in terms if term not in _STOPWORDS]
    return (content or terms)[:MAX_QUERY_TERMS]


def match_expression(question: str) -> str:
    """An FTS5 ``MATCH`` expression for a user's question: its terms quoted and joined by OR.

    Each term is a quoted string holding letters and digits only, so no character of the
    question (quotes, parentheses, ``*``, ``:``, ``^``, ``AND``/``OR``/``NOT``/``NEAR``) can
    reach FTS5 as syntax. Returns ``""`` when the question has no words.
    """
    return " OR ".join(f'"{term}"' for term in query_terms(question))


def question_of(body: Mapping[str, Any]) -> str:
    """The text of the last user message of a chat completion request, or ``""``.

    String content is returned as is; content parts contribute their ``text`` parts, joined by
    newlines; images and other parts are ignored.
    """
    messages = body.get("messages")
    if not isinstance(messages, Sequence) or isinstance(messages, str | bytes):
        return ""
    for message in reversed(messages):
        if not isinstance(message, Mapping) or message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content
        if isinstance(content, Sequence) and not isinstance(content, str | bytes):
            return "\n".join(
                part["text"]
                for part in content
                if isinstance(part, Mapping)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            )
        return ""
    return ""


# --------------------------------------------------------------------------- answers


def _entries(
    excerpts: Sequence[Excerpt], output_filter: OutputFilter | None
) -> tuple[list[str], list[dict[str, str]]]:
    if not excerpts:
        raise ValueError("a degraded answer needs at least one excerpt; answer with the error")
    clean = output_filter.clean if output_filter is not None else _identity
    entries: list[str] = []
    citations: list[dict[str, str]] = []
    for number, excerpt in enumerate(excerpts, start=1):
        shown = Excerpt(
            title=_one_line(clean(excerpt.title)),
            section=_one_line(clean(excerpt.section)),
            path=_one_line(clean(excerpt.path)),
            text=_one_line(clean(excerpt.text)),
            score=excerpt.score,
        )
        entries.append(f"{number}. {shown.citation}\n   {shown.text}")
        citations.append({"title": shown.title, "section": shown.section, "path": shown.path})
    return entries, citations


def _identity(text: str) -> str:
    return text


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _metadata(question: str, model_alias: str, citations: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "degraded": True,
        "source": "corpus",
        "requested_model": model_alias,
        "query_terms": query_terms(question),
        "citations": citations,
    }


class Stamp(TypedDict, total=False):
    """What names an answer on the wire, the same in its streamed and its whole form: ``id``
    (``chatcmpl-tidegate-degraded`` if not given) and ``created`` (Unix seconds, 0 if not)."""

    id: str
    created: int


def _stamp(stamp: Stamp) -> tuple[str, int]:
    return stamp.get("id", "chatcmpl-tidegate-degraded"), stamp.get("created", 0)


def degraded_answer(
    question: str,
    excerpts: Sequence[Excerpt],
    *,
    model_alias: str,
    output_filter: OutputFilter | None = None,
    **stamp: Unpack[Stamp],
) -> dict[str, Any]:
    """A ``chat.completion`` whose content is :data:`NOTICE` and the numbered, cited excerpts.

    Titles, sections, paths and texts pass through ``output_filter`` (the same checks as model
    text) before they are shown. ``excerpts`` must not be empty: with nothing to show, answer
    with the honest error instead. ``model_alias`` is the model the caller asked for; it is
    reported in the ``tidegate`` field, while ``model`` says who really answered.
    """
    entries, citations = _entries(excerpts, output_filter)
    id, created = _stamp(stamp)
    body = chat_completion(
        id=id,
        model=DEGRADED_MODEL,
        created=created,
        content="\n\n".join([NOTICE, *entries]),
        finish_reason=DEGRADED_FINISH_REASON,
        usage=usage(0, 0),
    )
    body["tidegate"] = _metadata(question, model_alias, citations)
    return body


def degraded_chunks(
    question: str,
    excerpts: Sequence[Excerpt],
    *,
    model_alias: str,
    output_filter: OutputFilter | None = None,
    include_usage: bool = False,
    **stamp: Unpack[Stamp],
) -> list[dict[str, Any]]:
    """The streamed form of :func:`degraded_answer`: ``chat.completion.chunk`` dicts.

    A role chunk, the notice, one chunk per excerpt, a final chunk with ``finish_reason``
    ``"degraded"`` and the ``tidegate`` field, then a zero usage chunk if ``include_usage``.
    The contents concatenate to exactly the non-streamed answer's content.
    """
    entries, citations = _entries(excerpts, output_filter)
    id, created = _stamp(stamp)
    common: dict[str, Any] = {"id": id, "model": DEGRADED_MODEL, "created": created}
    chunks = [
        chat_chunk(**common, delta={"role": "assistant", "content": ""}),
        chat_chunk(**common, delta={"content": NOTICE}),
        *(chat_chunk(**common, delta={"content": "\n\n" + entry}) for entry in entries),
    ]
    final = chat_chunk(**common, delta={}, finish_reason=DEGRADED_FINISH_REASON)
    final["tidegate"] = _metadata(question, model_alias, citations)
    chunks.append(final)
    if include_usage:
        chunks.append(chat_chunk(**common, usage=usage(0, 0)))
    return chunks
