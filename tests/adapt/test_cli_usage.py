"""The shared argument types and the output writer of `adapt.cli.usage`, which the `adapt` commands and
the experiment scripts both use: a bad list or output path fails as argparse reads the flag, and a
result file is written whole or not at all."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from adapt.cli.usage import (
    OUTPUT,
    RATE_LIST,
    SEED_LIST,
    UsageError,
    choice_list,
    prepare_output,
    write_json,
)


@pytest.mark.parametrize(
    ("kind", "raw", "message"),
    [
        (SEED_LIST, "1,,2", "none empty"),
        (SEED_LIST, "1,", "none empty"),
        (SEED_LIST, "", "none empty"),
        (SEED_LIST, "1,-1", "each item must be >= 0"),
        (SEED_LIST, "1,1", "1 given twice"),
        (RATE_LIST, "nan,x", "each item must be > 0"),
        (RATE_LIST, "2,0", "each item must be > 0"),
        (choice_list(("a", "b")), "a,nope", "each item must be one of a, b, got 'nope'"),
    ],
)
def test_a_bad_comma_list_is_refused_with_what_is_wrong(kind, raw, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        kind(raw)


def test_a_comma_list_reads_each_item():
    assert SEED_LIST(" 1, 2 ,3") == [1, 2, 3]
    assert RATE_LIST("2.5,3") == [2.5, 3.0]
    assert choice_list(("a", "b"))("b,a") == ["b", "a"]


def test_an_output_path_makes_its_folder_and_refuses_what_it_cannot_write(tmp_path):
    assert OUTPUT(str(tmp_path / "new" / "sub" / "r.json")) == tmp_path / "new" / "sub" / "r.json"
    assert (tmp_path / "new" / "sub").is_dir()
    (tmp_path / "afile").write_text("x")
    for raw, message in (
        ("", "empty output path"),
        (str(tmp_path), "is a directory"),
        (str(tmp_path / "afile" / "r.json"), "a part of that path is a file"),
    ):
        with pytest.raises(UsageError, match=message):
            prepare_output(raw)
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            OUTPUT(raw)


def test_a_failed_write_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    """Killed or out of space mid-write, a result file is the old one, not half of a new one."""
    out = tmp_path / "r.json"
    write_json(out, {"run": 1})

    def disk_full(descriptor: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_json(out, {"run": 2, "rows": list(range(1000))})
    assert json.loads(out.read_text()) == {"run": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left behind


def test_a_written_file_has_the_umasks_mode_and_a_link_keeps_pointing_at_it(tmp_path):
    target = tmp_path / "real.json"
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_json(link, {"a": 1})
    assert link.is_symlink() and json.loads(target.read_text()) == {"a": 1}
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
