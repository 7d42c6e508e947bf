"""A Dockerfile as the readiness checks read it: its instructions, its stages, and the values its
``ARG`` and ``ENV`` instructions give a stage's variables.

A reader of what an image is built from, not a builder: continuations are joined, comments,
parser directives (``# escape=``) and heredoc bodies are honoured and dropped, ``FROM`` starts a
stage, and a stage built ``FROM`` an earlier one inherits what it set. The rules that judge an
image (``DKR...``) are in :mod:`tidegate.ops.readiness`.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Instruction", "Stage", "assignments", "parse_dockerfile", "stages_of", "substitute"]


@dataclass(frozen=True, slots=True)
class Instruction:
    """One Dockerfile instruction: keyword (upper case), arguments, first line, stage index."""

    keyword: str
    args: str
    line: int
    stage: int


_DIRECTIVE = re.compile(r"#\s*([A-Za-z]+)\s*=\s*(\S+)\s*")
# ``<<EOF`` or ``<<-"EOF"``, but not a here-string (``<<<``).
_HEREDOC = re.compile(r"(?<!<)<<-?(?!<)\s*[\"']?([A-Za-z_][A-Za-z0-9_]*)[\"']?")


def parse_dockerfile(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile: continuations joined, comments and heredoc bodies
    dropped, each numbered by its stage (``FROM`` starts the next, from 0)."""
    lines = text.splitlines()
    escape = "\\"
    for raw in lines:
        directive = _DIRECTIVE.fullmatch(raw.strip())
        if directive is None:
            break
        if directive.group(1).lower() == "escape":
            escape = directive.group(2)
    instructions: list[Instruction] = []
    stage = -1
    index = 0
    while index < len(lines):
        first = index + 1
        current = lines[index].strip()
        index += 1
        if not current or current.startswith("#"):
            continue
        parts = []
        while current.endswith(escape):
            parts.append(current[: -len(escape)])
            while index < len(lines) and (
                not lines[index].strip() or lines[index].strip().startswith("#")
            ):
                index += 1
            if index >= len(lines):
                current = ""
                break
            current = lines[index].strip()
            index += 1
        parts.append(current)
        whole = " ".join(p.strip() for p in parts if p.strip())
        keyword, _, args = whole.partition(" ")
        keyword = keyword.upper()
        if keyword in ("RUN", "COPY", "ADD"):
            for marker in _HEREDOC.findall(args):
                while index < len(lines) and lines[index].strip() != marker:
                    index += 1
                index += 1
        if keyword == "FROM":
            stage += 1
        instructions.append(Instruction(keyword, " ".join(args.split()), first, stage))
    return instructions


_VARIABLE = re.compile(
    r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))"
)


def substitute(text: str, values: Mapping[str, str]) -> str:
    """``$VAR``, ``${VAR}``, ``${VAR:-default}`` and ``${VAR:+alt}`` from ``values``; an unknown
    variable with no default is left as written."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(4)
        operator, word = match.group(2), match.group(3) or ""
        value = values.get(name)
        if operator in ("-", ":-"):
            return value if value else word
        if operator in ("+", ":+"):
            return word if value else ""
        return match.group(0) if value is None else value

    return _VARIABLE.sub(one, text)


def assignments(keyword: str, args: str) -> list[tuple[str, str | None]]:
    """``(name, value)`` pairs of an ``ENV`` or ``ARG`` (``None``: an ARG with no default)."""
    try:
        words = shlex.split(args)
    except ValueError:
        words = args.split()
    if not words:
        return []
    if keyword == "ENV" and "=" not in words[0]:
        return [(words[0], " ".join(words[1:]))]  # the old ``ENV NAME value`` form
    pairs: list[tuple[str, str | None]] = []
    for word in words:
        name, equals, value = word.partition("=")
        pairs.append((name, value if equals else None))
    return pairs


@dataclass
class Stage:
    """One build stage: its base image (build arguments substituted), its ``AS`` name, the
    line of its ``FROM``, its instructions, and the earlier stage it is built on, if any."""

    image: str
    alias: str | None
    line: int
    instructions: list[Instruction] = field(default_factory=list)
    parent: Stage | None = None

    def last(self, keyword: str) -> Instruction | None:
        """The last ``keyword`` in this stage, or inherited from the stage it was built ``FROM``."""
        node: Stage | None = self
        while node is not None:
            found = [i for i in node.instructions if i.keyword == keyword]
            if found:
                return found[-1]
            node = node.parent
        return None

    def values(self) -> dict[str, str]:
        """The values ``ENV`` and ``ARG`` give this stage's variables, inherited ones first."""
        values: dict[str, str] = {}
        chain: list[Stage] = []
        node: Stage | None = self
        while node is not None:
            chain.append(node)
            node = node.parent
        for link in reversed(chain):
            for ins in link.instructions:
                if ins.keyword in ("ENV", "ARG"):
                    values.update(
                        (k, v) for k, v in assignments(ins.keyword, ins.args) if v is not None
                    )
        return values


def stages_of(instructions: Sequence[Instruction]) -> list[Stage]:
    """The build stages, in order; ``ARG`` defaults before the first ``FROM`` fill in the base
    images that name them."""
    global_args: dict[str, str] = {}
    found: list[Stage] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--")]
            image = substitute(words[0], global_args) if words else ""
            alias = words[2] if len(words) >= 3 and words[1].lower() == "as" else None
            parent = next(
                (s for s in found if s.alias is not None and s.alias.lower() == image.lower()),
                None,
            )
            found.append(Stage(image, alias, ins.line, parent=parent))
        elif not found:
            if ins.keyword == "ARG":
                global_args.update((k, v) for k, v in assignments("ARG", ins.args) if v is not None)
        else:
            found[-1].instructions.append(ins)
    return found
