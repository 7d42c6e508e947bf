"""Tests for the Dockerfile reader: instructions, stages, and the values a stage's variables take."""

from __future__ import annotations

from tidegate.ops.dockerfile import assignments, parse_dockerfile, stages_of, substitute


def test_parsing_joins_continuations_and_skips_heredocs_and_comments() -> None:
    """A heredoc body and comments are not instructions; continued lines make one."""
    text = (
        "FROM python:3.11.13-slim\n"
        "RUN <<EOF\n"
        "USER root\n"
        "EOF\n"
        "RUN a \\\n"
        "  # a comment inside\n"
        "  && b\n"
        "USER 1000\n"
        "HEALTHCHECK CMD true\n"
    )
    instructions = parse_dockerfile(text)
    assert [(i.keyword, i.args, i.line) for i in instructions] == [
        ("FROM", "python:3.11.13-slim", 1),
        ("RUN", "<<EOF", 2),
        ("RUN", "a && b", 5),
        ("USER", "1000", 8),
        ("HEALTHCHECK", "CMD true", 9),
    ]


def test_a_here_string_is_not_a_heredoc() -> None:
    """RUN cat <<< word consumes no following lines."""
    text = "FROM python:3.11.13-slim\nRUN cat <<< word\nword2\nUSER 1\nHEALTHCHECK CMD x\n"
    assert [i.keyword for i in parse_dockerfile(text)] == [
        "FROM", "RUN", "WORD2", "USER", "HEALTHCHECK",
    ]  # fmt: skip


def test_the_escape_directive_changes_the_continuation_character() -> None:
    """With # escape=` a backtick continues a line (Windows Dockerfiles)."""
    text = "# escape=`\nFROM python:3.11.13-slim\nRUN a `\n  b\nUSER 1\nHEALTHCHECK CMD x\n"
    assert [i.args for i in parse_dockerfile(text) if i.keyword == "RUN"] == ["a b"]


def test_a_stage_built_on_another_inherits_what_it_set() -> None:
    """FROM an earlier stage: its USER is the last one, and its ENV and ARG values carry over."""
    text = (
        "ARG BASE=python:3.11.13-slim\n"
        "FROM ${BASE} AS base\n"
        "ENV APP_UID=10001\n"
        "USER root\n"
        "FROM base\n"
        "ARG MODE\n"
        "USER ${APP_UID}\n"
    )
    base, final = stages_of(parse_dockerfile(text))
    assert (base.image, base.alias, base.line, base.parent) == (
        "python:3.11.13-slim",
        "base",
        2,
        None,
    )
    assert final.parent is base
    last_user = final.last("USER")
    assert last_user is not None
    assert last_user.line == 7
    assert substitute(last_user.args, final.values()) == "10001"
    assert final.last("HEALTHCHECK") is None


def test_env_and_arg_assignments_in_both_forms() -> None:
    """ENV NAME value is one pair; NAME=value pairs are split; an ARG without a default has None."""
    assert assignments("ENV", "PATH /opt/bin:$PATH") == [("PATH", "/opt/bin:$PATH")]
    assert assignments("ENV", 'A=1 B="two words"') == [("A", "1"), ("B", "two words")]
    assert assignments("ARG", "GIT_SHA") == [("GIT_SHA", None)]


def test_substitution_takes_defaults_and_alternatives() -> None:
    """${VAR:-default} and ${VAR:+alt} as a shell reads them; an unknown $VAR stays as written."""
    values = {"SET": "x", "EMPTY": ""}
    assert substitute("${SET:-d} ${EMPTY:-d} ${NONE:-d}", values) == "x d d"
    assert substitute("${SET:+alt}|${NONE:+alt}", values) == "alt|"
    assert substitute("$SET ${NONE} $NONE", values) == "x ${NONE} $NONE"
