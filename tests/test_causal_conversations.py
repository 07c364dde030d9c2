"""Multi-turn conversations and chat templates' turn ends, each checked against the tokenizer's own
``apply_chat_template`` (transformers' rendering, an implementation apart from ours): the shipped SmolLM2's ChatML,
and a Gemma-style template whose turn end is not the tokenizer's EOS (as for Qwen and Gemma bases)."""

from __future__ import annotations

import json

import pytest

from nebula_fl.data.instructions import decode_turns, load_records
from nebula_fl.errors import NebulaError
from nebula_fl.model.locate import resolve_model_path
from nebula_fl.tasks.causal_lm import IGNORE, CausalRecords, prompt_ids, stop_tokens, turn_end

CONVERSATION = [("system", "You are terse."), ("user", "Capital of France?"), ("assistant", "Paris."),
                ("user", "And of Italy?")]
LAST = "Rome."


@pytest.fixture(scope="module")
def smol():
    from nebula_fl.model.loading import load_tokenizer

    return load_tokenizer(resolve_model_path("smollm2"))


@pytest.fixture(scope="module")
def gemma_like():
    """MiniLM's tokenizer with a Gemma-style template: turns end with <end_of_turn>, EOS is [SEP]."""
    from nebula_fl.model.loading import load_tokenizer

    tok = load_tokenizer(resolve_model_path("minilm"))
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.eos_token = "[SEP]"
    tok.chat_template = ("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
                         "{% endfor %}{% if add_generation_prompt %}<start_of_turn>assistant\n{% endif %}")
    return tok


def _records(tok, prompts, answers, *, max_len=256):
    return CausalRecords(tok, prompts, answers, max_len=max_len, objective="instruct", template="auto",
                         exact_match_tokens=16)


def _messages(turns):
    return [{"role": r, "content": c} for r, c in turns]


def _learned_spans(row_ids, row_labels):
    spans, current = [], []
    for token, label in zip(row_ids.tolist(), row_labels.tolist(), strict=True):
        if label != IGNORE:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return [*spans, current] if current else spans


@pytest.mark.parametrize("which", ["smol", "gemma_like"])
def test_a_conversation_is_the_templates_whole_rendering_and_only_the_answers_with_their_turn_ends_are_learned(
        which, request):
    tok = request.getfixturevalue(which)
    from nebula_fl.data.instructions import encode_turns

    recs = _records(tok, [encode_turns(CONVERSATION)], [LAST])
    whole = tok.apply_chat_template(_messages([*CONVERSATION, ("assistant", LAST)]), tokenize=False).rstrip()
    reference = tok(whole, add_special_tokens=False)["input_ids"]
    assert recs.ids[0].tolist() == reference  # the template over the whole conversation, token for token
    end = tok.convert_tokens_to_ids("<|im_end|>" if which == "smol" else "<end_of_turn>")
    said = [[*tok(text, add_special_tokens=False)["input_ids"], end] for text in ("Paris.", "Rome.")]
    assert _learned_spans(recs.ids[0], recs.labels[0]) == said  # the assistant turns and their turn end, no more
    assert recs.report.conversations == 1 and recs.answers == [None]  # exact match scores single answers only


def test_the_turn_end_learned_is_the_templates_and_generation_stops_on_it(gemma_like, smol):
    end_of_turn = gemma_like.convert_tokens_to_ids("<end_of_turn>")
    assert turn_end(gemma_like, template="auto") == [end_of_turn]  # not [SEP], the tokenizer's EOS
    assert stop_tokens(gemma_like, template="auto") == [end_of_turn, gemma_like.sep_token_id]
    assert turn_end(gemma_like, template="plain") == [gemma_like.sep_token_id]
    recs = _records(gemma_like, ["Capital of France?"], ["Paris."])
    whole = gemma_like.apply_chat_template(_messages([("user", "Capital of France?"), ("assistant", "Paris.")]),
                                           tokenize=False).rstrip()
    assert recs.ids[0].tolist() == gemma_like(whole, add_special_tokens=False)["input_ids"]
    assert recs.ids[0].tolist()[: recs.prompt_lens[0]] == prompt_ids(gemma_like, "Capital of France?",
                                                                      template="auto")  # what generate feeds
    im_end = smol.convert_tokens_to_ids("<|im_end|>")
    assert turn_end(smol, template="auto") == [im_end] and stop_tokens(smol, template="auto") == [im_end]


def test_a_conversation_too_long_keeps_its_first_whole_exchanges_and_counts_what_it_left(smol):
    from nebula_fl.data.instructions import encode_turns

    long_answer = " ".join(f"word{i}" for i in range(60))
    turns = [("user", "Tell me."), ("assistant", "Sure."), ("user", "More."), ("assistant", long_answer),
             ("user", "Last?")]
    short = _records(smol, [encode_turns(turns)], ["Yes."], max_len=60)
    spans = [smol.decode(span) for span in _learned_spans(short.ids[0], short.labels[0])]
    assert spans == ["Sure.<|im_end|>"] and short.report.turns_cut == 1 and short.report.dropped == 0
    assert "1 of 1 conversations shortened" in short.report.describe()
    dropped = _records(smol, [encode_turns([("user", long_answer)])], ["ok"], max_len=40)
    assert len(dropped) == 0 and dropped.report.dropped == 1


def test_multi_turn_files_are_read_and_malformed_ones_refused_in_one_line(tmp_path):
    path = tmp_path / "chats.jsonl"
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"},
                                  {"from": "human", "value": "bye"}, {"from": "gpt", "value": "see you"}]}
    openai = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "id": 7}
    path.write_text("\n".join(json.dumps(r) for r in (sharegpt, openai)))
    data = load_records(str(path))
    assert decode_turns(data.texts[0]) == [("user", "hi"), ("assistant", "hello"), ("user", "bye")]
    assert list(data.labels) == ["see you", "a"] and decode_turns(data.texts[1]) is None  # one exchange: a prompt
    for turns, match in (
            ([{"role": "user", "content": "q"}, {"role": "user", "content": "q2"}], "has turns user, user"),
            ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
              {"role": "user", "content": "q2"}], "from a user turn to an assistant's answer"),
            ([{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}], "turn 2 of 'messages' is empty")):
        path.write_text(json.dumps({"messages": turns}))
        with pytest.raises(NebulaError, match=match) as err:
            load_records(str(path))
        assert "line 1" in str(err.value) and "\n" not in str(err.value)


def test_parquet_files_and_datasets_folders_are_read_by_the_datasets_library_as_jsonl_would_be(tmp_path, monkeypatch):
    """Hugging Face exports (Parquet, save_to_disk) through the datasets library: the same records as the same rows
    in JSONL, columns that are None in a row ignored; without the library, one line saying what to install."""
    import sys

    import datasets

    rows = [{"instruction": "Name it.", "input": "shares fell", "output": "business", "text": "### rendered",
             "messages": None},
            {"instruction": None, "input": None, "output": None, "text": None,
             "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                          {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({k: v for k, v in r.items() if v is not None})
                                                for r in rows))
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "a.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"test": table}).save_to_disk(str(tmp_path / "no-train"))
    expected = load_records(str(tmp_path / "a.jsonl"))
    for name in ("a.parquet", "saved"):
        got = load_records(str(tmp_path / name))
        assert got.texts == expected.texts and list(got.labels) == list(expected.labels) == ["business", "ciao"]
    with pytest.raises(NebulaError, match="has splits test and no 'train'"):
        load_records(str(tmp_path / "no-train"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # a host without the library
    with pytest.raises(NebulaError, match=r"read through the datasets library, which is not installed on this host: "
                                          r"pip install 'datasets>=3'"):
        load_records(str(tmp_path / "a.parquet"))
