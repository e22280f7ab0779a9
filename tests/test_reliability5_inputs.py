"""Issue 54, the fifth fault audit: what a run reads (items 4, 5 and 11). Each bad outcome it found, as a test that
failed before its fix, numbered as in the issue:

4. a resume checks every file it trained on (prompt files, reward files, edit sources) against the content hash
   recorded at the run's start, and refuses a changed one unless told to take it (then resumes.jsonl says so);
5. every GenEval record is checked against its tag's schema before any model loads;
11. a prompt or data file that is not UTF-8 is one line naming the file, the line and the byte.
"""

import json
import os

import pytest

from ddpo_group.data.prompts import load_prompts
from ddpo_group.rewards.geneval.metadata import GenEvalFormatError, read_metadata

POSITION = {"tag": "position", "prompt": "a photo of a dog right of a cat",
            "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}]}


# 11. a file that is not UTF-8: one line naming the file, the line and the byte (never a bare UnicodeDecodeError)
def _latin1(path, lines):
    """`lines` written in Latin-1 (an é is the single byte 0xe9, which UTF-8 never starts a character with)."""
    path.write_bytes("\n".join(lines).encode("latin-1") + b"\n")
    return path


def _one_line_naming(message, path, line, byte="0xe9"):
    assert "\n" not in message
    assert f"{path}, line {line}" in message and f"byte {byte}" in message and "UTF-8" in message, message


@pytest.mark.parametrize("name, lines", [
    ("prompts.txt", ["a cat", "# a comment", "a caf\xe9 table"]),
    ("prompts.jsonl", ['{"prompt": "a cat"}', "", '{"prompt": "a caf\xe9 table"}']),
    ("prompts.json", ['["a cat",', ' "a dog",', ' "a caf\xe9 table"]']),
])
def test_a_prompt_file_that_is_not_utf8_names_the_file_the_line_and_the_byte(tmp_path, name, lines):
    path = _latin1(tmp_path / name, lines)
    with pytest.raises(ValueError) as info:
        load_prompts(str(path))
    _one_line_naming(str(info.value), path, 3)
    assert not isinstance(info.value, UnicodeDecodeError)


def test_a_geneval_metadata_file_that_is_not_utf8_names_the_file_the_line_and_the_byte(tmp_path):
    record = dict(POSITION, prompt="a photo of a dog right of a caf\xe9")
    path = _latin1(tmp_path / "evaluation_metadata.jsonl", [json.dumps(POSITION), json.dumps(record, ensure_ascii=False)])
    with pytest.raises(GenEvalFormatError) as info:
        read_metadata(str(path))
    _one_line_naming(str(info.value), path, 2)


def test_the_byte_offset_counts_a_byte_order_mark(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbfab\ncd\xff\n")  # the BOM is 3 bytes, "ab\n" 3 more, "cd" 2: 0xff at offset 8
    with pytest.raises(ValueError) as info:
        load_prompts(str(path))
    _one_line_naming(str(info.value), path, 2, byte="0xff")
    assert "offset 8" in str(info.value)


def test_an_editing_prompt_file_that_is_not_utf8_is_named(tmp_path):
    path = _latin1(tmp_path / "edits.jsonl", ['{"prompt": "make it caf\xe9", "source_image": "a.png"}'])
    with pytest.raises(ValueError) as info:
        load_prompts(str(path))
    _one_line_naming(str(info.value), path, 1)


def test_a_geneval_image_folders_metadata_that_is_not_utf8_is_named(tmp_path):
    from ddpo_group.evaluation.protocols import read_geneval_folder

    folder = tmp_path / "images" / "00000"
    (folder / "samples").mkdir(parents=True)
    _latin1(folder / "metadata.jsonl", [json.dumps(dict(POSITION, prompt="caf\xe9"), ensure_ascii=False)])
    with pytest.raises(GenEvalFormatError) as info:
        read_geneval_folder(str(tmp_path / "images"))
    _one_line_naming(str(info.value), folder / "metadata.jsonl", 1)
