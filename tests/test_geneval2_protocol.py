"""GenEval 2 with Soft-TIFA (ddpo_group/evaluation/geneval2.py): the answer's probability from a first token's
log-probs, the records file's checks, and the whole protocol against a local chat-completions server (uvicorn on
loopback, test_judge_reward's ChatServer) whose answers give a table computed here by hand."""

import json
import math

import numpy as np
import pytest
import torch
from helpers import load_script
from PIL import Image

from ddpo_group.evaluation.geneval2 import GenEval2Error, answer_probability, geometric_mean, read_records
from ddpo_group.evaluation.protocol_report import protocol_tables_html
from ddpo_group.evaluation.protocols import get_protocol

pytest.importorskip("uvicorn")
pytest.importorskip("openai")
from test_judge_reward import ChatServer, tiny_vlm  # noqa: E402, F401  (tiny_vlm: a fixture)

SUFFIX = " Answer in one word."
RECORDS = [
    {"prompt": "two red cubes", "atom_count": 3,
     "vqa_list": [["How many cubes are in the image?", "two"], ["Are the cubes red?", "Yes"],
                  ["Are there any cubes in the image?", "Yes"]],
     "skills": ["count", "attribute", "object"]},
    {"prompt": "a dog left of a cat", "atom_count": 2,
     "vqa_list": [["Is the dog to the left of the cat?", "Yes"], ["Are there any dogs in the image?", "Yes"],
                  ["Are there any cats in the image?", "Yes"]],
     "skills": ["position", "object", "object"]},
]
# the judge's first-token log-probs per question; P(correct) written beside each
ANSWERS = {
    "How many cubes are in the image?": {"2": math.log(0.3), " two": math.log(0.2), "three": math.log(0.5)},  # 0.5
    "Are the cubes red?": {"Yes": math.log(0.6), " yes": math.log(0.2), "No": math.log(0.2)},  # 0.8
    "Are there any cubes in the image?": {"Yes": math.log(0.9), "No": math.log(0.1)},  # 0.9
    "Is the dog to the left of the cat?": {"No": math.log(0.75), "Maybe": math.log(0.05)},  # 0: Yes not listed
    "Are there any dogs in the image?": {"Yes": math.log(0.4), "No": math.log(0.6)},  # 0.4
    "Are there any cats in the image?": {" Yes": math.log(0.7), "No": math.log(0.3)},  # 0.7
}
SCORES = [[0.5, 0.8, 0.9], [0.0, 0.4, 0.7]]


@pytest.fixture
def records_file(tmp_path):
    path = tmp_path / "geneval2_data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return str(path)


@pytest.fixture
def server():
    chat = ChatServer({q + SUFFIX: {"top_logprobs": top} for q, top in ANSWERS.items()})
    yield chat
    chat.close()


def expected_summary():
    """The table by the paper's rules, from SCORES (hand-written above), independently of the module."""
    am = [sum(s) / len(s) for s in SCORES]
    gm = [(0.5 * 0.8 * 0.9) ** (1 / 3), 0.0]  # one atom at 0: the prompt-level score is 0
    return {"soft_tifa_am": (am[0] + am[1]) / 2, "soft_tifa_gm": (gm[0] + gm[1]) / 2,
            "skills": {"attribute": (0.8, 1), "count": (0.5, 1), "object": ((0.9 + 0.4 + 0.7) / 3, 3),
                       "position": (0.0, 1)},
            "atomicity": {"2": (gm[1], 1), "3": (gm[0], 1)}}


def check_table(summary):
    expected = expected_summary()
    assert summary["soft_tifa_am"] == pytest.approx(expected["soft_tifa_am"])
    assert summary["soft_tifa_gm"] == pytest.approx(expected["soft_tifa_gm"])
    assert {k: (pytest.approx(v["score"]), v["atoms"]) for k, v in summary["skills"].items()} == expected["skills"]
    assert {k: (pytest.approx(v["score"]), v["images"]) for k, v in summary["atomicity"].items()} \
        == expected["atomicity"]


def test_the_answer_probability_sums_its_spellings_among_the_listed_tokens():
    top = {"Yes": math.log(0.5), " yes": math.log(0.2), "No": math.log(0.25), "YES!": math.log(0.05)}
    assert answer_probability(top, "Yes") == pytest.approx(0.7)
    assert answer_probability(top, "No") == pytest.approx(0.25)
    counts = {"4": math.log(0.3), " four": math.log(0.4), "Four": math.log(0.1), "five": math.log(0.2)}
    assert answer_probability(counts, "four") == pytest.approx(0.8)  # word and digit, any case, with a space
    assert answer_probability(counts, "4") == pytest.approx(0.8)
    assert answer_probability(counts, "three") == 0.0  # not listed: below the smallest listed, counted 0
    assert answer_probability({}, "Yes") is None and answer_probability(None, "Yes") is None


def test_the_prompt_level_score_is_the_geometric_mean_and_zero_with_a_zero_atom():
    assert geometric_mean([0.5, 0.8, 0.9]) == pytest.approx(0.36 ** (1 / 3))
    assert geometric_mean([0.0, 0.9]) == 0.0


def test_soft_tifa_against_a_judge_endpoint_gives_the_hand_computed_table(records_file, server):
    protocol = get_protocol("geneval2", url=server.url, retries=0)
    records = protocol.load_records(records_file)
    protocol.check_ready()
    rows = protocol.score(torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)), records)
    for row, scores in zip(rows, SCORES):
        np.testing.assert_allclose(row["atom_scores"], scores, atol=1e-12)
    check_table(protocol.summarize(rows))
    asked = sorted(next(p["text"] for p in r["messages"][0]["content"] if p["type"] == "text") for r in server.requests)
    assert asked == sorted(q + SUFFIX for q in ANSWERS)  # every atom asked once, in GenEval 2's words
    assert all(r["max_tokens"] == 1 and r["logprobs"] and r["temperature"] == 0 for r in server.requests)


def test_evaluate_geneval2_samples_scores_prints_and_writes_the_table(tmp_path, records_file, server, capsys):
    evaluate_script = load_script("scripts/evaluate.py")
    output = tmp_path / "geneval2.json"
    summary = evaluate_script.main(["--protocol", "geneval2", "--model", "tiny", "--prompts", records_file,
                                    "--num-steps", "2", "--protocol-option", f"url={server.url}",
                                    "--protocol-option", "retries=0", "--output", str(output)])
    check_table(summary)
    assert summary["num_images"] == 2 and summary["images_per_prompt"] == 1  # GenEval 2: one image a prompt
    printed = capsys.readouterr().out
    assert "Soft-TIFA GM (prompt level)" in printed and "| position | 0.0000 | 1 |" in printed
    check_table(json.loads(output.read_text()))
    lines = [json.loads(line) for line in (tmp_path / "geneval2_images.jsonl").read_text().splitlines()]
    assert [row["prompt_index"] for row in lines] == [0, 1]


def test_a_bad_record_is_one_line_naming_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(RECORDS[0]) + "\n\n" + json.dumps({**RECORDS[1], "skills": ["object"]}) + "\n")
    with pytest.raises(GenEval2Error, match=rf"{bad}, line 3: \"skills\" is not a list of 3"):
        read_records(str(bad))
    bad.write_text("{not json\n")
    with pytest.raises(GenEval2Error, match=rf"{bad}, line 1: invalid JSON"):
        read_records(str(bad))
    with pytest.raises(GenEval2Error, match="no such file"):
        read_records(str(tmp_path / "missing.jsonl"))
    bad.write_bytes((json.dumps(RECORDS[0]) + "\n").encode() + b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(GenEval2Error, match=rf"{bad}, line 2: byte 0xe9 .* not UTF-8"):
        read_records(str(bad))


def test_bad_inputs_stop_the_command_in_one_line_before_any_model_loads(tmp_path, records_file):
    evaluate_script = load_script("scripts/evaluate.py")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**RECORDS[0], "atom_count": 0}) + "\n")
    no_model = str(tmp_path / "no_model")
    with pytest.raises(SystemExit, match=rf"{bad}, line 1: \"atom_count\" is 0"):
        evaluate_script.run(["--protocol", "geneval2", "--prompts", str(bad), "--model", no_model])
    with pytest.raises(SystemExit, match="unknown option 'detector'"):
        evaluate_script.run(["--protocol", "geneval2", "--prompts", records_file, "--protocol-option", "detector=x"])
    with pytest.raises(SystemExit, match=r"url='ftp://x' is not an http\(s\) URL.*--protocol-option url"):
        evaluate_script.run(["--protocol", "geneval2", "--prompts", records_file, "--protocol-option", "url=ftp://x"])
    with pytest.raises(SystemExit, match="--images reads GenEval's folder layout"):
        evaluate_script.run(["--protocol", "geneval2", "--images", str(tmp_path)])
    with pytest.raises(SystemExit, match="does not answer"):  # nothing listens: refused before sampling
        evaluate_script.run(["--protocol", "geneval2", "--prompts", records_file, "--model", no_model,
                             "--protocol-option", "url=http://127.0.0.1:9/v1", "--protocol-option", "retries=0"])


def test_a_judge_without_log_probs_is_a_one_line_error(records_file):
    chat = ChatServer({}, default={"content": "Yes"})  # text only: no logprobs in its answers
    try:
        protocol = get_protocol("geneval2", url=chat.url, retries=0)
        records = protocol.load_records(records_file)
        with pytest.raises(Exception, match="gave no log-probs of its first token"):
            protocol.score(torch.rand(2, 3, 8, 8), records)
    finally:
        chat.close()


def test_the_report_shows_a_checkpoints_geneval2_table(tmp_path):
    checkpoint = tmp_path / "checkpoints" / "checkpoint_5"
    checkpoint.mkdir(parents=True)
    summary = {"soft_tifa_am": 0.55, "soft_tifa_gm": 0.25, "skills": {"count": {"score": 0.5, "atoms": 1}}}
    (checkpoint / "protocol_geneval2.json").write_text(json.dumps(summary))
    html = protocol_tables_html(str(tmp_path))
    assert "Protocol geneval2" in html and "<th>count</th>" in html
    assert "<td>5</td><td>0.550</td><td>0.250</td><td>0.500</td>" in html


def test_the_in_process_judge_gives_the_exact_probability_of_the_answer_token(tiny_vlm, tmp_path):
    """In-process, P(answer) is read off the whole softmax: here "Yes" and "5" are the only forms of their answers
    that are one token of the tiny tokenizer (" Yes", "five", ... are several), so P = softmax(logits)[that token]."""
    model, processor = tiny_vlm
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({"prompt": "five cubes", "atom_count": 2, "skills": ["object", "count"],
                                "vqa_list": [["Are there cubes?", "Yes"], ["How many cubes?", "5"]]}) + "\n")
    protocol = get_protocol("geneval2", backend="transformers", model="tiny")
    protocol.judge.set_model(model, processor)
    records = protocol.load_records(str(path))
    batch = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    row = protocol.score(batch, records)[0]
    image = Image.fromarray((batch[0] * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy())
    tokenizer = processor.tokenizer
    for question, token, score in (("Are there cubes?", "Yes", row["atom_scores"][0]),
                                   ("How many cubes?", "5", row["atom_scores"][1])):
        text = f"<|im_start|>user\n<image>{question}{SUFFIX}<|im_end|>\n<|im_start|>assistant\n"
        with torch.no_grad():
            logits = model(**processor(text=[text], images=[image], return_tensors="pt")).logits[0, -1].double()
        expected = torch.softmax(logits, dim=-1)[tokenizer.convert_tokens_to_ids(token)].item()
        assert score == pytest.approx(expected, rel=1e-5)
