"""The operator documents stay true: their links, metrics, log fields and snippets are real."""

from __future__ import annotations

import ast
import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import ROOT
from tidegate.clock import SystemClock
from tidegate.gateway.metrics import Metrics
from tidegate.state.url import store_from_url

DOCS = [ROOT / "docs" / name for name in ("deploy.md", "RUNBOOK.md", "ARCHITECTURE.md")]
RUNBOOK = ROOT / "docs" / "RUNBOOK.md"


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(doc: Path) -> None:
    """Each Markdown link to a file of the repository points at one that exists."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", _text(doc))
    local = [link for link in links if "://" not in link]
    assert local, "the document links to nothing"
    for link in local:
        assert (doc.parent / link).exists(), f"{doc.name} links to missing {link}"


def _declared_metrics() -> set[str]:
    """Every family the gateway declares, under its name with and without ``_total``."""
    families = set()
    for line in Metrics().exposition().decode().splitlines():
        if line.startswith("# TYPE "):
            name = line.split()[2]
            families |= {name, name.removesuffix("_total") + "_total"}
    return families


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_metric_named_is_one_the_gateway_serves(doc: Path) -> None:
    """Every ``tidegate_*`` metric a document tells an operator to read exists."""
    named = set(re.findall(r"\btidegate_[a-z_]+", _text(doc)))
    assert named - _declared_metrics() == set()


def _request_log_fields() -> set[str]:
    """The keys of the fields the gateway passes to ``self._log_request({...})`` (the dict may
    be named on the way: ``fields := {...}``)."""
    tree = ast.parse(_text(ROOT / "src" / "tidegate" / "gateway" / "app.py"))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "_log_request"
            and node.args
        ):
            fields = node.args[0]
            if isinstance(fields, ast.NamedExpr):
                fields = fields.value
            if isinstance(fields, ast.Dict):
                return {str(k.value) for k in fields.keys if isinstance(k, ast.Constant)}
    raise AssertionError("no request log call in gateway/app.py")


def test_the_log_fields_the_runbook_explains_are_the_ones_logged() -> None:
    """Each field the runbook's log-line table explains is a field of the request log line."""
    section = _text(RUNBOOK).split("3. **Read the line**", 1)[1].split("4. **", 1)[0]
    explained = {
        name
        for line in section.splitlines()
        if line.strip().startswith("| `")
        for name in re.findall(r"`([a-z_]+)`", line.split("|")[1])
    }
    assert len(explained) >= 10, explained
    assert explained - _request_log_fields() == set()


def _snippet(text: str, opener: str, closer: str) -> str:
    start = text.index(opener) + len(opener)
    return text[start : text.index(closer, start)]


def test_the_runbook_flag_snippet_sets_the_flag_with_its_audit_record(tmp_path: Path) -> None:
    """The kill-switch snippet, run as written, changes answer.mode and records who and why."""
    code = _snippet(_text(RUNBOOK), "<<'EOF'\n", "\nEOF\n")
    config = tmp_path / "tidegate.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "state": {"url": f"sqlite:///{tmp_path}/state.db"},
                "providers": {"p": {"type": "fake", "model": "m-1"}},
                "models": {"chat": {"providers": ["p"]}},
            }
        ),
        encoding="utf-8",
    )
    args = [str(config), "answer.mode", "unavailable", "oncall:test", "rehearsal"]
    result = subprocess.run(
        [sys.executable, "-", *args],
        input=code,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "who='oncall:test'" in result.stdout

    async def read() -> tuple[object, list[object]]:
        stores = await store_from_url(f"sqlite:///{tmp_path}/state.db", clock=SystemClock())
        async with stores:
            return (await stores.flags.values())["answer.mode"], list(
                await stores.flags.history("answer.mode")
            )

    value, history = asyncio.run(read())
    assert value == "unavailable"
    assert len(history) == 1


def test_the_runbook_cost_snippet_ranks_callers_by_cost() -> None:
    """The cost-by-caller one-liner sums cost_usd per tenant and user from request log lines."""
    code = _snippet(_text(RUNBOOK), "python3 -c '\n", "\n'\n")
    lines = [
        '{"event": "request", "tenant": "shop", "user": "a", "cost_usd": 0.25}',
        "not json",
        '{"event": "request", "tenant": "shop", "user": "b", "cost_usd": 1.0}',
        '{"event": "request", "tenant": "shop", "user": "a", "cost_usd": 0.5}',
        '{"event": "startup_failed", "tenant": "x", "user": "y", "cost_usd": 9}',
    ]
    result = subprocess.run(
        [sys.executable, "-c", code],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.split("\n")[:2] == ["    1.000000  shop/b", "    0.750000  shop/a"]
