"""Prompt sources: built-in sets, text / JSON / JSONL files with metadata, plugins, errors."""

import json
import textwrap

import pytest

from ddpo_group.data.prompts import PromptRecord, load_prompts


def test_simple_animals_are_ddpo_pytorch_bare_animal_names():
    records = load_prompts("simple_animals")
    prompts = [r.prompt for r in records]
    assert len(prompts) == 45 and len(set(prompts)) == 45
    assert prompts[:3] == ["cat", "dog", "horse"]
    assert all(r.metadata == {} for r in records)
    assert all(len(p.split()) == 1 and p.islower() for p in prompts)


def test_imagenet_animals_follow_imagenet_class_order():
    prompts = [r.prompt for r in load_prompts("imagenet_animals")]
    assert len(prompts) == 398
    assert (prompts[0], prompts[1], prompts[151], prompts[268], prompts[397]) == (
        "tench", "goldfish", "Chihuahua", "Mexican hairless dog", "pufferfish")


def test_imagenet_dogs_are_classes_151_to_268():
    prompts = [r.prompt for r in load_prompts("imagenet_dogs")]
    assert len(prompts) == 268 - 151 + 1
    assert prompts[0] == "Chihuahua" and prompts[-1] == "Mexican hairless dog"


def test_shapes_records_carry_the_shape_fields_and_data_source():
    from ddpo_group.data.shapes import shapes_prompts

    items = shapes_prompts()
    records = load_prompts("shapes")
    assert len(records) == len(items)
    for item, record in zip(items, records):
        assert record.prompt == item["prompt"]
        expected = {k: v for k, v in item.items() if k != "prompt"}
        expected["data_source"] = "shapes"
        assert record.metadata == expected


def test_text_file_skips_blank_and_comment_lines(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("# my prompts\na red car\n\n   \n  a blue boat  \n#skip\n")
    assert load_prompts(str(path)) == [PromptRecord("a red car", {}), PromptRecord("a blue boat", {})]


def test_jsonl_fields_other_than_prompt_become_metadata(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(
        '{"prompt": "two cats", "data_source": "counting", "ground_truth": 2}\n'
        "\n"
        '{"prompt": "a dog", "data_source": "geneval", "tags": ["animal"]}\n'
    )
    assert load_prompts(str(path)) == [
        PromptRecord("two cats", {"data_source": "counting", "ground_truth": 2}),
        PromptRecord("a dog", {"data_source": "geneval", "tags": ["animal"]}),
    ]


def test_json_list_and_prompts_object(tmp_path):
    records = [{"prompt": "a cat", "ground_truth": "cat"}, "a dog"]
    (tmp_path / "list.json").write_text(json.dumps(records))
    (tmp_path / "object.json").write_text(json.dumps({"prompts": records}))
    expected = [PromptRecord("a cat", {"ground_truth": "cat"}), PromptRecord("a dog", {})]
    assert load_prompts(str(tmp_path / "list.json")) == expected
    assert load_prompts(str(tmp_path / "object.json")) == expected


def test_malformed_jsonl_names_file_line_and_missing_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a cat"}\n\n{"text": "a dog", "data_source": "x"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl, line 3: missing field 'prompt'"):
        load_prompts(str(path))


def test_invalid_json_line_names_the_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"prompt": "a cat"}\n{"prompt": "a dog"\n')
    with pytest.raises(ValueError, match=r"broken\.jsonl, line 2: invalid JSON"):
        load_prompts(str(path))


def test_json_record_without_prompt_names_the_record(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"prompt": "a cat"}, {"caption": "a dog"}]))
    with pytest.raises(ValueError, match=r"bad\.json, record 1: missing field 'prompt'"):
        load_prompts(str(path))


def test_empty_prompt_value_is_an_error(tmp_path):
    path = tmp_path / "empty_prompt.jsonl"
    path.write_text('{"prompt": "  "}\n')
    with pytest.raises(ValueError, match=r"line 1: field 'prompt' must be a non-empty string"):
        load_prompts(str(path))


@pytest.mark.parametrize("name, text", [("empty.txt", ""), ("comments.txt", "# only\n\n"),
                                        ("empty.jsonl", "\n"), ("empty.json", "[]")])
def test_file_without_prompts_is_an_error(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match="has no prompts"):
        load_prompts(str(tmp_path / name))


def test_missing_file_and_unknown_extension_are_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(str(tmp_path / "nope.txt"))
    (tmp_path / "prompts.csv").write_text("a cat\n")
    with pytest.raises(ValueError, match="unknown extension '.csv'"):
        load_prompts(str(tmp_path / "prompts.csv"))


def test_unknown_source_lists_the_built_in_sets():
    with pytest.raises(ValueError, match="simple_animals, imagenet_animals"):
        load_prompts("no_such_prompt_set")


def test_from_file_with_low_high_as_ddpo_pytorch(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("a\nb\nc\nd\n")
    assert [r.prompt for r in load_prompts("from_file", path=str(path), low=1, high=3)] == ["b", "c"]
    assert [r.prompt for r in load_prompts("simple_animals", high=2)] == ["cat", "dog"]


def test_asset_file_name_resolves_to_the_shipped_list():
    assert load_prompts("simple_animals.txt") == load_prompts("simple_animals")


def test_prompt_plugin_function_from_a_file(tmp_path):
    path = tmp_path / "my_prompts.py"
    path.write_text(textwrap.dedent("""
        def colors(n=2):
            return [{"prompt": f"color {i}", "ground_truth": i} for i in range(n)]
    """))
    assert load_prompts(f"{path}:colors", n=3) == [PromptRecord(f"color {i}", {"ground_truth": i}) for i in range(3)]


def test_a_list_of_prompts_is_accepted():
    assert load_prompts(["a", {"prompt": "b", "k": 1}]) == [PromptRecord("a", {}), PromptRecord("b", {"k": 1})]


def test_a_bom_and_invisible_only_lines_are_not_prompts(tmp_path):
    text = tmp_path / "p.txt"
    text.write_bytes("\ufeffa red circle\n\u200b\u200b\n \u2060 \nzero\u200b width inside stays\n\u200ba blue square\u200d\n".encode("utf-8"))
    assert [r.prompt for r in load_prompts(str(text))] == [
        "a red circle", "zero\u200b width inside stays", "a blue square"
    ]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_bytes('\ufeff{"prompt": "a red circle"}\n'.encode("utf-8"))
    assert [r.prompt for r in load_prompts(str(jsonl))] == ["a red circle"]
    as_json = tmp_path / "p.json"
    as_json.write_bytes('\ufeff["a cat", "\u200b"]'.encode("utf-8"))
    with pytest.raises(ValueError, match=r"record 1.*non-empty"):
        load_prompts(str(as_json))
