"""`write_text_atomic`: the file is the new text after the call and the old one if it fails, with
no temporary file left beside it either way."""

from __future__ import annotations

import pytest

from adapt.files import write_text_atomic


def test_writes_a_new_file_and_replaces_an_old_one(tmp_path):
    path = tmp_path / "status.json"
    write_text_atomic(path, '{"swaps": 1}')
    assert path.read_text() == '{"swaps": 1}'
    write_text_atomic(path, '{"swaps": 2}')
    assert path.read_text() == '{"swaps": 2}'
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "engine.json"
    path.write_text("old")
    with pytest.raises(TypeError):
        write_text_atomic(path, b"not text")  # type: ignore[arg-type]  # fails once the temp file is open
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["engine.json"]
