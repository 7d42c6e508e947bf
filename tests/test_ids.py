"""Ids: a random prefix per process, then a counter; a forked child draws its own prefix."""

from __future__ import annotations

import os
import re
import sys

import pytest

from tidegate.ids import IdSource, new_id

ID = re.compile(r"[0-9a-f]{24}")


def test_ids_are_unique_24_hex_characters_with_one_prefix() -> None:
    ids = [new_id() for _ in range(100_000)]
    assert len(set(ids)) == len(ids)
    assert all(ID.fullmatch(i) for i in ids)
    assert {i[:16] for i in ids} == {new_id.prefix}
    assert re.fullmatch(r"[0-9a-f]{16}", new_id.prefix)
    counters = [int(i[16:], 16) for i in ids]
    assert counters == list(range(counters[0], counters[0] + len(ids)))


def test_restart_draws_a_new_prefix_and_counts_from_one() -> None:
    source = IdSource()
    first = [source() for _ in range(3)]
    assert [i[16:] for i in first] == ["00000001", "00000002", "00000003"]
    old = source.prefix
    source.restart()
    assert source.prefix != old
    assert source() == f"{source.prefix}00000001"
    source.restart("0123456789abcdef")
    assert [source(), source()] == ["0123456789abcdef00000001", "0123456789abcdef00000002"]


def test_two_sources_have_different_prefixes() -> None:
    assert IdSource().prefix != IdSource().prefix


def test_the_counter_widens_past_its_width() -> None:
    source = IdSource("p", width=2)
    ids = [source() for _ in range(256)]
    assert ids[0] == "p01"
    assert ids[254:] == ["pff", "p100"]
    assert len(set(ids)) == 256


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="needs os.fork")
def test_a_forked_child_draws_its_own_prefix() -> None:
    parent = new_id()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its first id and leave without running any cleanup
        status = 1
        try:
            os.close(read_end)
            os.write(write_end, new_id().encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        child = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert ID.fullmatch(child)
    assert child[:16] != parent[:16]
    assert child[16:] == "00000001"  # the child's counter starts over too
    assert new_id()[:16] == parent[:16]  # the parent keeps its prefix
