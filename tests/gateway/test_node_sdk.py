"""End to end: a real gateway on loopback, driven by the official openai Node SDK.

The SDK is pinned in ``tests/node/package.json`` (with its lock file) and installed by
``.ci/run`` (``npm ci --prefix tests/node``). Without Node or the installed SDK the test is
skipped with the command that installs it, except under CI, where it fails.
"""

from __future__ import annotations

import array
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.gateway.harness import KEY, fake, running_gateway

NODE_DIR = Path(__file__).resolve().parents[1] / "node"
SCRIPT = NODE_DIR / "sdk_check.mjs"
CONFIG = {
    "providers": {
        "p": fake("from the gateway", model="model-a"),
        "e": fake(model="embed-1", embedding_dimensions=16),
    },
    "models": {"chat": {"providers": ["p"]}, "embed": {"providers": ["e"]}},
}


def _node() -> str:
    node = shutil.which("node")
    installed = (NODE_DIR / "node_modules" / "openai" / "package.json").is_file()
    if node is None or not installed:
        missing = (
            "node is not installed" if node is None else "the openai Node SDK is not installed"
        )
        if os.environ.get("CI"):
            pytest.fail(f"{missing}: .ci/run installs both (npm ci --prefix tests/node)")
        pytest.skip(f"{missing}: run `npm ci --prefix tests/node` (needs node and npm)")
    return node


def test_chat_stream_and_base64_embeddings(tmp_path: Path) -> None:
    """A chat, a stream and the SDK's default (base64) embeddings, whose vectors are the float
    ones as float32: the SDK decodes what the gateway encodes."""
    node = _node()
    with running_gateway(tmp_path, CONFIG) as (base, _):
        done = subprocess.run(
            [node, str(SCRIPT), f"{base}/v1", KEY],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["chat"] == {"content": "from the gateway", "model": "model-a"}
    assert seen["stream"]["text"].split() == ["from", "the", "gateway"]
    assert seen["stream"]["finish"] == "stop"
    floats = seen["embeddings"]["float"]
    assert [len(v) for v in floats] == [16, 16]
    assert seen["embeddings"]["base64"] == [array.array("f", v).tolist() for v in floats]
