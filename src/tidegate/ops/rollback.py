"""The rollback plan as data a machine can check: ``rollback.yaml``.

One unit per thing that can be rolled back on its own. Every unit names the exact version running
now and the exact version to go back to, the step that does it, who owns it, how long it may take
and the test that must pass afterwards::

    units:
      - name: prompt template
        kind: prompt                 # application | dependency | model | prompt | config
        current: "v14"               # exact versions: never latest, ^1.2, ~1.2, 1.x or *
        previous: "v13"
        step:
          action: flag               # flag: a flag change; deploy: a new deployment
          flag: prompt.version
          value: "v13"
        owner: assistant-team
        time_budget_minutes: 5
        verify: tests/test_prompt.py::test_answers_cite_sources

``verify`` is a test file, optionally ``::name`` (``::Class::name``; a ``[param]`` id is
ignored), found relative to the plan's folder first, then to the repository root (the nearest
folder above the plan holding ``pyproject.toml`` or ``.git``).

A prompt or config rollback must be a flag change: it must not wait for a build. A model, a
dependency or the application may need a deploy.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Final

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tidegate.ops.findings import Finding, Rule, Severity, rule_table

__all__ = [
    "RULES",
    "Plan",
    "Step",
    "StepAction",
    "Unit",
    "UnitKind",
    "check_plan",
    "check_rollback",
    "find_verify_test",
    "load_plan",
    "version_problem",
]

E = Severity.ERROR

RULES: Final[Mapping[str, Rule]] = rule_table(
    Rule("RBK001", E, "the plan reads and every unit has every field"),
    Rule("RBK002", E, "every version is exact: not latest, empty or a range"),
    Rule("RBK003", E, "the previous version differs from the current one"),
    Rule("RBK004", E, "a prompt or config rollback is a flag change, not a deploy"),
    Rule("RBK005", E, "every kind of unit has a rollback step"),
    Rule("RBK006", E, "the verify test file exists"),
    Rule("RBK007", E, "the verify test named after :: exists in that file"),
)


class UnitKind(StrEnum):
    """What a unit is; a plan needs at least one of each."""

    APPLICATION = "application"
    DEPENDENCY = "dependency"
    MODEL = "model"
    PROMPT = "prompt"
    CONFIG = "config"


class StepAction(StrEnum):
    """How a rollback is done: a flag change (seconds) or a deployment (a build and a rollout)."""

    FLAG = "flag"
    DEPLOY = "deploy"


#: Kinds whose rollback must never wait for a build.
FLAG_ONLY: Final = frozenset({UnitKind.PROMPT, UnitKind.CONFIG})

Text = Annotated[str, Field(strict=True, min_length=1)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Step(_Strict):
    """The rollback step: ``flag`` names the flag and the value, ``deploy`` the command to run."""

    action: StepAction
    flag: Text | None = None
    value: str | int | float | bool | None = None
    run: Text | None = None

    @model_validator(mode="after")
    def _complete(self) -> Step:
        if self.action is StepAction.FLAG and self.flag is None:
            raise ValueError("a flag step needs flag (the flag's name) and value")
        if self.action is StepAction.DEPLOY and self.run is None:
            raise ValueError("a deploy step needs run (the command that deploys the previous one)")
        return self


class Unit(_Strict):
    """One thing that can be rolled back on its own."""

    name: Text
    kind: UnitKind
    #: Exact version strings; quote numbers (YAML reads 1.10 as 1.1).
    current: Annotated[str, Field(strict=True)]
    previous: Annotated[str, Field(strict=True)]
    step: Step
    owner: Text
    time_budget_minutes: Annotated[float, Field(gt=0)]
    verify: Text


class Plan(_Strict):
    """A whole plan: its units, in the order they would be rolled back."""

    units: Annotated[tuple[Unit, ...], Field(min_length=1)]


def load_plan(path: Path) -> tuple[Plan | None, list[Finding]]:
    """The plan in ``path``, or the RBK001 findings that say why it cannot be read."""
    shown = str(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        return None, [RULES["RBK001"].finding(f"cannot read the plan ({exc.strerror})", shown)]
    except yaml.YAMLError as exc:
        return None, [RULES["RBK001"].finding(f"not valid YAML: {exc}", shown)]
    try:
        return Plan.model_validate(data), []
    except ValidationError as exc:
        return None, [_validation_finding(error, data, shown) for error in exc.errors()]


def _validation_finding(error: Any, data: Any, shown: str) -> Finding:
    loc = [str(part) for part in error["loc"]]
    key = ".".join(loc)
    if error["type"] == "extra_forbidden":
        text = "unknown key"
    elif error["type"] == "missing":
        text = "missing"
    else:
        text = str(error["msg"])
    if loc and loc[-1] in ("current", "previous") and error["type"] == "string_type":
        text += " (quote versions: YAML reads 1.10 as the number 1.1)"
    label = _unit_label(data, loc)
    return RULES["RBK001"].finding(f"{key}: {text}", f"{shown} [{label or key}]")


def _unit_label(data: Any, loc: Sequence[str]) -> str:
    if len(loc) < 2 or loc[0] != "units" or not loc[1].isdigit():
        return ""
    units = data.get("units") if isinstance(data, Mapping) else None
    index = int(loc[1])
    if isinstance(units, list) and index < len(units) and isinstance(units[index], Mapping):
        return f"units.{index} {units[index].get('name', '')}".rstrip()
    return ""


_FLOATING_WORDS: Final = frozenset({"latest", "stable", "current", "head", "main", "master", "*"})


def version_problem(version: str, kind: UnitKind) -> str | None:
    """Why ``version`` is not one exact version, or ``None`` when it is.

    Refused: empty, ``latest`` (also as an image tag, ``:latest``), a moving name (``stable``,
    ``main``), a range or constraint (``^1.2``, ``~1.2``, ``>=1``, ``1.x``, ``*``) and, for an
    application, an image reference with neither tag nor digest (which means ``latest``).
    """
    text = version.strip()
    if not text:
        return "is empty"
    tail = re.search(r"(?:^|[-_.:@/=\s])([a-z*]+)$", text.lower())
    if tail is not None and tail.group(1) in _FLOATING_WORDS:
        return f"{version!r} moves: name one exact version"
    if re.search(r"[\^~*<>|,]|!=", text) or re.search(r"(^|[.=-])[xX](\.|$)", text):
        return f"{version!r} is a range, not one exact version"
    image = kind is UnitKind.APPLICATION and "/" in text and "@" not in text
    if image and ":" not in text.rsplit("/", 1)[-1]:
        return f"{version!r} is an image with no tag or digest, which means latest"
    return None


def _repo_root(start: Path) -> Path | None:
    for folder in (start, *start.parents):
        if (folder / "pyproject.toml").is_file() or (folder / ".git").exists():
            return folder
    return None


def find_verify_test(spec: str, plan_folder: Path) -> tuple[Path | None, list[str]]:
    """The test file of ``spec`` (``path[::name...]``) and its names, or ``None`` if not found."""
    file, *names = spec.split("::")
    path = Path(file)
    candidates = [path] if path.is_absolute() else [plan_folder / path]
    root = _repo_root(plan_folder.resolve())
    if root is not None and not path.is_absolute():
        candidates.append(root / path)
    found = next((c for c in candidates if c.is_file()), None)
    return found, [re.sub(r"\[.*\]$", "", name) for name in names]


def _has_names(tree: ast.Module, names: Sequence[str]) -> bool:
    body: Sequence[ast.stmt] = tree.body
    for index, name in enumerate(names):
        last = index == len(names) - 1
        kinds: tuple[type[ast.AST], ...] = (
            (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef) if last else (ast.ClassDef,)
        )
        node = next(
            (n for n in body if isinstance(n, kinds) and getattr(n, "name", None) == name), None
        )
        if node is None:
            return False
        body = node.body if isinstance(node, ast.ClassDef) else []
    return True


def _check_verify(unit: Unit, plan_folder: Path, where: str) -> list[Finding]:
    path, names = find_verify_test(unit.verify, plan_folder)
    if path is None:
        return [
            RULES["RBK006"].finding(
                f"{unit.name}: verify test {unit.verify.split('::')[0]!r} does not exist "
                "(looked beside the plan and at the repository root)",
                where,
            )
        ]
    if not names:
        return []
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (OSError, SyntaxError, ValueError) as exc:
        return [RULES["RBK007"].finding(f"{unit.name}: cannot parse {path}: {exc}", where)]
    if not _has_names(tree, names):
        return [
            RULES["RBK007"].finding(
                f"{unit.name}: {path.name} has no test {'::'.join(names)!r}", where
            )
        ]
    return []


def check_plan(plan: Plan, plan_folder: Path, shown: str = "rollback.yaml") -> list[Finding]:
    """Every rule over a loaded plan; ``plan_folder`` anchors the verify paths."""
    findings: list[Finding] = []
    for index, unit in enumerate(plan.units):
        where = f"{shown} [units.{index} {unit.name}]"
        for field in ("current", "previous"):
            problem = version_problem(getattr(unit, field), unit.kind)
            if problem is not None:
                findings.append(
                    RULES["RBK002"].finding(f"{unit.name}: {field} version {problem}", where)
                )
        if unit.current.strip() and unit.current.strip() == unit.previous.strip():
            findings.append(
                RULES["RBK003"].finding(
                    f"{unit.name}: previous version is the current one ({unit.current!r}): "
                    "there is nothing to roll back to",
                    where,
                )
            )
        if unit.kind in FLAG_ONLY and unit.step.action is StepAction.DEPLOY:
            findings.append(
                RULES["RBK004"].finding(
                    f"{unit.name}: a {unit.kind.value} rollback must be a flag change, not a "
                    "deploy: a rollback must not wait for a build",
                    where,
                )
            )
        findings += _check_verify(unit, plan_folder, where)
    present = {unit.kind for unit in plan.units}
    for kind in UnitKind:
        if kind not in present:
            findings.append(
                RULES["RBK005"].finding(f"no rollback step for {kind.value}", f"{shown} [units]")
            )
    return findings


def check_rollback(path: Path) -> list[Finding]:
    """Load the plan in ``path`` and apply every rule; ``[]`` means the plan passes."""
    plan, findings = load_plan(path)
    if plan is None:
        return findings
    return check_plan(plan, path.parent, str(path))
