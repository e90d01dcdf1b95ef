"""The one bounded reader (runtime/io/reading.py): regular files only, a size cap, UTF-8, guarded JSON."""

from __future__ import annotations

import os

import pytest

from dspark_cli.runtime.io.reading import ReadError, parse_json_text, read_bounded_text, read_json_file


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_json_at_the_nesting_limit_and_huge_integers():
    document = parse_json_text(_deep(100), "x")  # exactly at the limit: read
    for _ in range(99):
        (document,) = document
    assert document == []
    with pytest.raises(ReadError, match="x nests JSON objects or arrays more than 100 levels deep"):
        parse_json_text(_deep(101), "x")
    with pytest.raises(ReadError, match="x is not valid JSON .*digits"):
        parse_json_text("1" * 5000, "x")
    with pytest.raises(ReadError, match="x is not valid JSON"):
        parse_json_text(b"\xff{}", "x")


def test_a_file_over_its_cap_is_refused_unread(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text('{"tokens": [1]}')
    assert read_json_file(path, "verify-cost table", 15, "fix it") == {"tokens": [1]}  # exactly at the cap
    with pytest.raises(ReadError, match=r"costs.json: it has 15 bytes, more than the 14-byte limit for a verify-cost"):
        read_json_file(path, "verify-cost table", 14, "fix it")


def test_folders_fifos_missing_and_undecodable_files_are_one_sentence(tmp_path):
    fifo = tmp_path / "set.txt"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path):  # a FIFO would block forever if it were opened for reading
        with pytest.raises(ReadError, match="cannot read the prompt set .*: it is not a regular file"):
            read_bounded_text(path, "prompt set", 100)
    with pytest.raises(ReadError, match="cannot read the prompt set .*none.txt: No such file or directory."):
        read_bounded_text(tmp_path / "none.txt", "prompt set", 100)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"caf\xe9")
    with pytest.raises(ReadError, match=r"latin1.txt: it is not UTF-8 text \(unexpected end of data at byte 3\)"):
        read_bounded_text(latin1, "prompt set", 100)


@pytest.mark.parametrize("body, message", [
    ('{"error": {"message": "model not found", "type": "invalid_request_error"}}', "model not found"),  # OpenAI
    ('{"error": "slot unavailable"}', "slot unavailable"),
    ('{"message": "bad request"}', "bad request"),
    ("Internal Server Error", "Internal Server Error"),  # not JSON: the body itself
    ("[1, 2]", "[1, 2]"),
])
def test_server_error_message_finds_the_message_in_each_servers_shape(body, message):
    from dspark_cli.runtime.io.reading import server_error_message

    assert server_error_message(body) == message
