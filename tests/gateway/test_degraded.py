"""Degraded mode: the document corpus, its search, and the answer built from the excerpts."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.errors import ConfigError
from tidegate.gateway import degraded
from tidegate.gateway.degraded import (
    DEGRADED_FINISH_REASON,
    DEGRADED_MODEL,
    NOTICE,
    Corpus,
    Excerpt,
    degraded_answer,
    degraded_chunks,
    match_expression,
    query_terms,
    question_of,
)
from tidegate.gateway.redaction import OutputFilter
from tidegate.providers.wire import assemble_completion

SEP = " \u203a "

DOCS: dict[str, str] = {
    "guide/install.md": """\
---
owner: docs
---
# Installing tidegate

Tidegate runs as one process on a laptop or as many replicas.

## Linux

### Packages

Install the wheel with pip inside a virtual environment, then run the gateway command.

## Containers

Build the image and run it with the sample configuration file mounted read-only.
The container installs nothing at start-up.
""",
    "ops/breaker.md": """\
# Circuit breaker

A breaker stops calls to a provider that keeps failing.

## States

### Half-open probes

After the recovery time one probe request is let through. If the probe succeeds the breaker
closes; if it fails the breaker opens again. A cancelled probe releases its slot.

```sh
# Not a heading: a comment in a code block about probes
tidegate breaker status
```

## Metrics

The gauge reports the breaker state per provider.
""",
    "notes.txt": "Rate limits use token buckets per user and per tenant.\nRefill is continuous.\n",
    "faq.md": "Budgets reset daily at midnight UTC.\n\n## Quotas\n\nA quota counts calls and tokens.\n",
    ".hidden/secret.md": "# Hidden\n\nThe probe of this file must never be indexed.\n",
    "image.png": "not a document about probes",
}


def write_docs(root: Path, docs: dict[str, str]) -> None:
    for relative, text in docs.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


@pytest.fixture
def corpus(tmp_path: Path) -> Iterator[Corpus]:
    write_docs(tmp_path, DOCS)
    with Corpus.build(tmp_path) as built:
        yield built


class RecordingLog:
    """Stands in for the module's structlog logger; keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.records.append(("warning", event, fields))

    def info(self, event: str, **fields: Any) -> None:
        self.records.append(("info", event, fields))


# --------------------------------------------------------------------------- the corpus


def test_sections_of_every_document_are_indexed(corpus: Corpus) -> None:
    """Markdown is split at headings and text files are one section; hidden and other files not."""
    # install: intro, Packages, Containers; breaker: intro, Half-open probes, Metrics;
    # notes.txt: one; faq: preamble, Quotas.
    assert len(corpus) == 9
    assert corpus.documents == 4
    assert corpus.skipped == ()


def test_a_relevant_question_ranks_the_right_document_first(corpus: Corpus) -> None:
    """A question about half-open probes finds the breaker page's section on them first."""
    hits = corpus.search("What happens when the half-open probe is cancelled?")
    assert hits[0].path == "ops/breaker.md"
    assert hits[0].section == f"States{SEP}Half-open probes"
    assert "probe" in hits[0].text


def test_citations_carry_title_section_and_relative_path(corpus: Corpus) -> None:
    """Title is the first H1, section the heading path below it, path relative to the folder."""
    (hit,) = corpus.search("pip virtual environment wheel", limit=1)
    assert (hit.title, hit.section, hit.path) == (
        "Installing tidegate",
        f"Linux{SEP}Packages",
        "guide/install.md",
    )
    assert hit.citation == f"[Installing tidegate{SEP}Linux{SEP}Packages] (guide/install.md)"


def test_text_outside_any_heading_has_an_empty_section(corpus: Corpus) -> None:
    """The text under the title heading (or before any heading) belongs to no section."""
    (hit,) = corpus.search("laptop replicas", limit=1)
    assert (hit.path, hit.section) == ("guide/install.md", "")
    assert hit.citation == "[Installing tidegate] (guide/install.md)"


def test_documents_without_a_title_heading_are_titled_by_file_name(corpus: Corpus) -> None:
    """A text file, or Markdown without a '# ' heading, takes its file name as title."""
    (notes,) = corpus.search("token buckets", limit=1)
    assert (notes.title, notes.path, notes.section) == ("notes.txt", "notes.txt", "")
    (faq,) = corpus.search("quota counts", limit=1)
    assert (faq.title, faq.section) == ("faq.md", "Quotas")


def test_at_most_one_hit_per_document_by_default(corpus: Corpus) -> None:
    """Several matching sections of one document yield one hit unless more are asked for."""
    question = "install container image pip"
    default = corpus.search(question, limit=5)
    assert [hit.path for hit in default] == ["guide/install.md"]
    wider = corpus.search(question, limit=5, limit_per_doc=2)
    assert [hit.path for hit in wider] == ["guide/install.md", "guide/install.md"]
    assert wider[0].section != wider[1].section


def test_hits_are_ordered_and_limited(corpus: Corpus) -> None:
    """Hits come best first, never more than ``limit``."""
    hits = corpus.search("probe breaker quota token install", limit=2)
    assert len(hits) == 2
    assert hits[0].score >= hits[1].score
    assert len({hit.path for hit in hits}) == 2


def test_headings_inside_fenced_code_are_not_sections(corpus: Corpus) -> None:
    """A '# comment' in a code block stays body text of the section around it."""
    (hit,) = corpus.search("breaker status comment", limit=1)
    assert hit.section == f"States{SEP}Half-open probes"


def test_hidden_folders_are_not_indexed(corpus: Corpus) -> None:
    """Files under a folder whose name starts with a dot are left out."""
    assert all(hit.path != ".hidden/secret.md" for hit in corpus.search("hidden probe", limit=9))


@pytest.mark.parametrize("before", [0, 3, 60, 400])
def test_excerpts_are_one_bounded_line_around_the_match(tmp_path: Path, before: int) -> None:
    """An excerpt is one line of at most ``excerpt_chars`` characters that shows the match."""
    body = " ".join(f"word{n}" for n in range(before)) + " needle " + "tail " * 200
    write_docs(tmp_path, {"long.md": f"# Long\n\n{body}\n\nmore\nlines\n"})
    with Corpus.build(tmp_path, excerpt_chars=120) as corpus:
        (hit,) = corpus.search("needle")
    assert "needle" in hit.text
    assert len(hit.text) <= 120
    assert "\n" not in hit.text
    assert hit.text.endswith("…")


@pytest.mark.parametrize(
    "question",
    [
        'probe"',
        '"unbalanced probe',
        "(probe",
        "probe)",
        "probe AND",
        "OR probe",
        "NOT probe",
        "NEAR(probe breaker, 2)",
        "probe*",
        "* probe *",
        "title:probe",
        "{title section}: probe",
        "^probe",
        "probe - breaker + ",
        "probe's breaker; DROP TABLE sections; --",
        "\x00probe\ud800",
    ],
)
def test_fts5_syntax_in_a_question_is_plain_text(corpus: Corpus, question: str) -> None:
    """Quotes, brackets, operators, column filters and stray bytes never reach FTS5 as syntax."""
    hits = corpus.search(question)
    assert hits
    assert hits[0].path == "ops/breaker.md"


@pytest.mark.parametrize("question", ["", "   ", "?!*()\"'", "\n\t"])
def test_a_question_without_words_finds_nothing(corpus: Corpus, question: str) -> None:
    """A query with no searchable word returns no hits instead of an error or everything."""
    assert match_expression(question) == ""
    assert corpus.search(question) == []


def test_stopwords_are_dropped_unless_nothing_else_is_left() -> None:
    """Common words do not drown the content words, but a stopword-only question still searches."""
    assert query_terms("How do I reset the Budget? the budget!") == ["reset", "budget"]
    assert query_terms("what is it") == ["what", "is", "it"]


def test_limits_must_be_positive(corpus: Corpus) -> None:
    """A limit below one is a programming error, reported as ValueError."""
    with pytest.raises(ValueError, match="limit_per_doc"):
        corpus.search("probe", limit_per_doc=0)
    with pytest.raises(ValueError, match="limit"):
        corpus.search("probe", limit=0)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=120))
def test_arbitrary_text_never_raises(text: str) -> None:
    """Any text at all is a valid question: the MATCH expression built from it always parses."""
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE VIRTUAL TABLE t USING fts5(body, tokenize = 'porter unicode61')")
    conn.execute("INSERT INTO t VALUES ('the tide gate opens at dawn')")
    expression = match_expression(text)
    if expression:
        conn.execute("SELECT rowid FROM t WHERE t MATCH ?", (expression,)).fetchall()
    conn.close()


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corpus]:
    root = tmp_path_factory.mktemp("small")
    write_docs(root, {"a.md": "# A\n\nalpha beta and or near not\n", "b.txt": "beta gamma"})
    with Corpus.build(root) as built:
        yield built


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('ab "()*:^-+{}ANDORNEAT\x00\n')), max_size=40))
def test_search_accepts_any_mix_of_syntax_characters(small_corpus: Corpus, text: str) -> None:
    """Corpus.search itself returns a list for any mix of FTS5 operators and letters."""
    assert isinstance(small_corpus.search(text), list)


def test_an_empty_folder_makes_an_empty_corpus(tmp_path: Path) -> None:
    """A folder without documents yields a corpus of length 0 that finds nothing."""
    (tmp_path / "picture.png").write_bytes(b"\x89PNG")
    with Corpus.build(tmp_path) as corpus:
        assert len(corpus) == 0
        assert corpus.documents == 0
        assert corpus.search("anything") == []


def test_non_utf8_files_are_skipped_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that is not UTF-8 is left out and logged; the rest of the folder is indexed."""
    recorder = RecordingLog()
    monkeypatch.setattr(degraded, "log", recorder)
    write_docs(tmp_path, {"good.md": "# Good\n\nProbes are fine.\n"})
    (tmp_path / "bad.txt").write_bytes("caf\u00e9 probes".encode("latin-1"))
    with Corpus.build(tmp_path) as corpus:
        assert corpus.skipped == ("bad.txt",)
        assert len(corpus) == 1
        assert [hit.path for hit in corpus.search("probes")] == ["good.md"]
    warnings = [fields for level, _, fields in recorder.records if level == "warning"]
    assert warnings == [{"path": "bad.txt", "reason": "not_utf8", "detail": warnings[0]["detail"]}]


def test_oversized_files_are_skipped(tmp_path: Path) -> None:
    """A file above ``max_file_bytes`` is skipped instead of read."""
    write_docs(tmp_path, {"big.md": "probe " * 100, "small.md": "probe"})
    with Corpus.build(tmp_path, max_file_bytes=100) as corpus:
        assert corpus.skipped == ("big.md",)
        assert corpus.documents == 1


def test_a_utf8_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    """A UTF-8 file that starts with a BOM is indexed, and its first heading is still the title."""
    (tmp_path / "bom.md").write_bytes(b"\xef\xbb\xbf# Bommed\n\nprobe text\n")
    with Corpus.build(tmp_path) as corpus:
        (hit,) = corpus.search("probe")
    assert hit.title == "Bommed"


def test_a_missing_folder_is_a_config_error(tmp_path: Path) -> None:
    """Pointing the corpus at a folder that does not exist stops start-up with ConfigError."""
    with pytest.raises(ConfigError, match="nowhere"):
        Corpus.build(tmp_path / "nowhere")


def test_an_index_file_is_rebuilt_on_each_start(tmp_path: Path) -> None:
    """Building into an existing database file replaces the old index instead of adding to it."""
    docs = tmp_path / "docs"
    docs.mkdir()
    write_docs(docs, {"a.md": "# A\n\nprobe\n"})
    db = tmp_path / "corpus.db"
    with Corpus.build(docs, db_path=db) as first:
        assert len(first) == 1
    write_docs(docs, {"b.md": "# B\n\nprobe\n"})
    with Corpus.build(docs, db_path=db) as second:
        assert len(second) == 2
        assert sorted(hit.path for hit in second.search("probe")) == ["a.md", "b.md"]


# --------------------------------------------------------------------------- the answer

EXCERPTS = [
    Excerpt(
        title="Circuit breaker",
        section=f"States{SEP}Half-open probes",
        path="ops/breaker.md",
        text="After the recovery time one probe request is let through.",
        score=2.5,
    ),
    Excerpt(
        title="notes.txt", section="", path="notes.txt", text="Rate limits use buckets.", score=1.0
    ),
]


def test_the_answer_is_a_labelled_cited_chat_completion() -> None:
    """The content starts with the notice, then numbered excerpts, each with its citation."""
    answer = degraded_answer("how do probes work?", EXCERPTS, model_alias="chat")
    content = answer["choices"][0]["message"]["content"]
    assert content == (
        f"{NOTICE}\n\n"
        f"1. [Circuit breaker{SEP}States{SEP}Half-open probes] (ops/breaker.md)\n"
        "   After the recovery time one probe request is let through.\n\n"
        "2. [notes.txt] (notes.txt)\n"
        "   Rate limits use buckets."
    )
    assert answer["object"] == "chat.completion"
    assert answer["model"] == DEGRADED_MODEL == "tidegate-degraded"
    assert answer["choices"][0]["finish_reason"] == DEGRADED_FINISH_REASON == "degraded"
    assert answer["usage"] == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


def test_the_answer_carries_its_citations_as_data() -> None:
    """The ``tidegate`` field says the answer is degraded and lists the requested model and sources."""
    meta = degraded_answer("how do probes work?", EXCERPTS, model_alias="chat")["tidegate"]
    assert meta["degraded"] is True
    assert meta["requested_model"] == "chat"
    assert meta["query_terms"] == ["probes", "work"]
    assert meta["citations"][0] == {
        "title": "Circuit breaker",
        "section": f"States{SEP}Half-open probes",
        "path": "ops/breaker.md",
    }


def test_excerpts_pass_through_the_output_filter() -> None:
    """Excerpt text and citations are redacted and stripped like model text."""
    dirty = Excerpt(
        title="Ops\u202e", section="Keys", path="k.md", text="token=abc123\x1b[31m here", score=1.0
    )
    flt = OutputFilter([r"token=\w+"])
    answer = degraded_answer("keys", [dirty], model_alias="chat", output_filter=flt)
    content = answer["choices"][0]["message"]["content"]
    assert "1. [Ops\u203aKeys] (k.md)".replace("\u203a", SEP) in content
    assert "[redacted][31m here" in content
    assert "abc123" not in content
    assert "\x1b" not in content


def test_an_answer_needs_excerpts() -> None:
    """With no excerpt there is no degraded answer; the caller answers with the error instead."""
    with pytest.raises(ValueError, match="excerpt"):
        degraded_answer("q", [], model_alias="chat")


def test_the_stream_adds_up_to_the_answer() -> None:
    """Role chunk first, then content chunks that concatenate to the answer, then the finish."""
    answer = degraded_answer("probes", EXCERPTS, model_alias="chat", id="x", created=7)
    chunks = degraded_chunks("probes", EXCERPTS, model_alias="chat", id="x", created=7)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert len(chunks) == 2 + len(EXCERPTS) + 1
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "degraded"
    assert final["tidegate"] == answer["tidegate"]
    rebuilt = assemble_completion(chunks)
    assert (
        rebuilt["choices"][0]["message"]["content"] == (answer["choices"][0]["message"]["content"])
    )
    assert (rebuilt["id"], rebuilt["model"], rebuilt["created"]) == ("x", DEGRADED_MODEL, 7)


def test_the_stream_ends_with_zero_usage_when_asked() -> None:
    """With include_usage the last chunk is a usage-only chunk of zeros."""
    chunks = degraded_chunks("probes", EXCERPTS, model_alias="chat", include_usage=True)
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["total_tokens"] == 0
    assert chunks[-2]["choices"][0]["finish_reason"] == "degraded"


# --------------------------------------------------------------------------- the question


@pytest.mark.parametrize(
    ("body", "question"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "hi"),
        (
            {
                "messages": [
                    {"role": "user", "content": "first"},
                    {"role": "assistant", "content": "reply"},
                    {"role": "user", "content": "second"},
                    {"role": "assistant", "content": "pending"},
                ]
            },
            "second",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is"},
                            {"type": "image_url", "image_url": {"url": "data:,"}},
                            {"type": "text", "text": "a breaker"},
                        ],
                    }
                ]
            },
            "what is\na breaker",
        ),
        ({"messages": [{"role": "system", "content": "be brief"}]}, ""),
        ({"messages": [{"role": "user", "content": None}]}, ""),
        ({"messages": "not a list"}, ""),
        ({}, ""),
    ],
)
def test_the_question_is_the_last_user_message(body: dict[str, Any], question: str) -> None:
    """The last user message's text, from a string or text parts; anything else is empty."""
    assert question_of(body) == question
