"""Where eval-gate verdicts are kept, and how the gateway reads the latest one per provider.

``tidegate eval`` writes a verdict (go, review, block) per target; the gateway reads them so that
automatic failover never uses a provider whose latest verdict is ``block``. They live in the
gateway's SQLite state (table ``eval_verdicts``) or, for other state stores, in a JSON file
(``{"verdicts": [{"target", "verdict", "details", "at"}, ...]}``) beside the config.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any, Final

from tidegate.errors import ConfigError
from tidegate.state.sqlite import SQLiteDatabase

__all__ = [
    "TABLE",
    "VERDICTS_FILE",
    "read_json",
    "read_latest_verdicts",
    "sqlite_path",
    "verdict_store_for",
]

#: The JSON file's name, beside the config, when the state is not SQLite.
VERDICTS_FILE: Final = "eval-verdicts.json"

TABLE: Final = """
CREATE TABLE IF NOT EXISTS eval_verdicts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    target TEXT NOT NULL,
    verdict TEXT NOT NULL,
    details TEXT NOT NULL,
    at REAL NOT NULL
)
"""


def verdict_store_for(state_url: str, config_dir: Path) -> str:
    """The gateway's SQLite state when it has one, else the JSON file beside the config."""
    if state_url.startswith("sqlite:///"):
        return state_url
    return str(config_dir / VERDICTS_FILE)


def sqlite_path(url: str) -> str:
    rest = url[len("sqlite://") :]
    return rest[1:] if rest.startswith("/") else rest


def read_json(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read the verdicts: {exc}") from exc
    entries = data.get("verdicts") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ConfigError(f"{path}: expected {{'verdicts': [...]}}")
    return [e for e in entries if isinstance(e, dict)]


def read_latest_verdicts(store: str | Path) -> dict[str, str]:
    """Each target's most recent verdict: ``store`` is a ``sqlite:///`` URL or a JSON path."""
    if str(store).startswith("sqlite:///"):
        if not Path(sqlite_path(str(store))).exists():
            return {}
        db = SQLiteDatabase.from_url(str(store))
        try:

            def work(conn: sqlite3.Connection) -> list[tuple[str, str]]:
                conn.execute(TABLE)
                rows = conn.execute(
                    "SELECT target, verdict FROM eval_verdicts WHERE id IN "
                    "(SELECT MAX(id) FROM eval_verdicts GROUP BY target)"
                ).fetchall()
                return [(str(t), str(v)) for t, v in rows]

            return dict(db.run(work))
        finally:
            db.close()
    return {str(e.get("target")): str(e.get("verdict")) for e in read_json(Path(store))}
