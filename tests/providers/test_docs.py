"""docs/providers.md: its example runs and prints what the page says, its script is the shipped one."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import yaml

from tidegate.gateway.config import Config
from tidegate.providers.fake_upstream import EXAMPLE_SCRIPT

PAGE = Path(__file__).resolve().parents[2] / "docs" / "providers.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.DOTALL)


@pytest.mark.slow
def test_the_usage_example_prints_its_documented_output() -> None:
    """The usage example runs against the fake upstream and prints exactly the shown output."""
    example = next(block for block in _blocks("python") if "asyncio.run(main())" in block)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(example, str(PAGE), "exec"), {"__name__": "docs_example"})
    assert output.getvalue() == _blocks("text")[0]


def test_the_example_script_on_the_page_is_the_shipped_file() -> None:
    """The fake upstream's YAML example on the page is the example file shipped in the package."""
    (page_yaml,) = [block for block in _blocks("yaml") if not block.startswith("providers:")]
    assert page_yaml in EXAMPLE_SCRIPT.read_text(encoding="utf-8")


PROVIDER_TYPES = ("openai", "anthropic", "azure_openai", "bedrock", "gemini")


def test_every_provider_type_has_a_section_with_a_config_example_that_loads() -> None:
    """One section per provider type, each with a ``providers:`` example the config accepts."""
    text = PAGE.read_text(encoding="utf-8")
    examples = [block for block in _blocks("yaml") if block.startswith("providers:")]
    for kind in PROVIDER_TYPES:
        assert f"(type: {kind})" in text, kind
        assert any(f"type: {kind}\n" in block for block in examples), kind
    for block in examples:
        providers = yaml.safe_load(block)["providers"]
        models = {name: {"providers": [name]} for name in providers}
        Config.model_validate({"providers": providers, "models": models})
