"""``read_first_line``: a step manifest's header read without its parts, from a regular file only."""

import os

import pytest

from mtc.shared.safe_files import MiB, UntrustedFileError, read_first_line


def test_the_first_line_alone_is_read(tmp_path):
    f = tmp_path / "step.json"
    f.write_bytes(b'{"header": 1}\n' + b"x" * (3 * MiB))
    assert read_first_line(f, 64, "step manifest") == b'{"header": 1}'
    f.write_bytes(b'{"one line": true}')  # a commit record: the whole file
    assert read_first_line(f, 64, "step manifest") == b'{"one line": true}'
    f.write_bytes(b"")
    assert read_first_line(f, 64, "step manifest") == b""


def test_a_line_longer_than_a_chunk_is_read_whole(tmp_path):
    f = tmp_path / "step.json"
    line = b"h" * (2 * MiB + 17)
    f.write_bytes(line + b"\nrest")
    assert read_first_line(f, 4 * MiB, "step manifest") == line


def test_a_line_past_the_limit_and_a_link_are_refused(tmp_path):
    f = tmp_path / "step.json"
    f.write_bytes(b"y" * 100 + b"\n")
    with pytest.raises(UntrustedFileError, match="step manifest .* is larger than 99 bytes"):
        read_first_line(f, 99, "step manifest")
    assert read_first_line(f, 100, "step manifest") == b"y" * 100
    link = tmp_path / "link.json"
    os.symlink(f, link)
    with pytest.raises(UntrustedFileError, match="is a symbolic link"):
        read_first_line(link, 1000, "step manifest")
