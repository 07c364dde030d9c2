"""The distill task: the KD loss against hand-computed values, the student's depth, the teacher's soft labels."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from nebula_fl.components import load as load_config
from nebula_fl.config import PRESETS, ModelConfig
from nebula_fl.errors import ConfigError
from nebula_fl.tasks import TaskSetup, make_task
from nebula_fl.tasks.distill import DistillTask
from nebula_fl.tasks.kd import kd_loss

TEXTS = ["the match ended in a late goal", "shares fell as the bank cut rates", "the film won an award",
         "parliament voted on the new bill", "a new phone chip is faster", "the striker signed a new deal"]


@pytest.fixture(scope="module")
def tiny2(tmp_path_factory) -> Path:
    """A 2-layer tiny BERT (the shared fixture's recipe, one layer deeper): a student can drop one."""
    from nebula_fl.model.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-bert-2") / "model", layers=2)


def setup_for(path: Path, labels: list[str], *, seed: int = 0) -> TaskSetup:
    return TaskSetup(model=ModelConfig(model=str(path), max_seq_len=32), labels=labels, seed=seed, path=path)


def _softmax(row: list[float]) -> list[float]:
    exps = [math.exp(x) for x in row]
    return [e / sum(exps) for e in exps]


STUDENT = [[1.0, 2.0, 0.5], [0.0, 0.0, 3.0]]
TEACHER = [[2.0, 1.0, 0.0], [1.0, 0.0, 1.0]]
LABELS = [1, 2]


def hand_kd(temperature: float, alpha: float) -> float:
    """alpha T^2 mean_i sum_c p_t log(p_t / p_s) + (1 - alpha) mean_i -log softmax(s_i)[y_i], written out."""
    kl = 0.0
    for s, t in zip(STUDENT, TEACHER, strict=True):
        p_s = _softmax([x / temperature for x in s])
        p_t = _softmax([x / temperature for x in t])
        kl += sum(pt * math.log(pt / ps) for pt, ps in zip(p_t, p_s, strict=True))
    kl /= len(STUDENT)
    ce = sum(-math.log(_softmax(s)[y]) for s, y in zip(STUDENT, LABELS, strict=True)) / len(STUDENT)
    return alpha * temperature**2 * kl + (1 - alpha) * ce


@pytest.mark.parametrize(("temperature", "alpha"), [(2.0, 0.5), (1.0, 0.3), (4.0, 0.9), (3.0, 0.0)])
def test_kd_loss_matches_the_formula_by_hand(temperature, alpha):
    got = kd_loss(torch.tensor(STUDENT, dtype=torch.float64), torch.tensor(TEACHER, dtype=torch.float64), torch.tensor(LABELS), temperature=temperature,
                  alpha=alpha)
    assert got.item() == pytest.approx(hand_kd(temperature, alpha), rel=1e-6)


def test_kd_loss_pinned_value():
    # T=2, alpha=0.5, worked on paper to 4 places: KL row 1 = 0.1046, row 2 = 0.2192 (mean 0.1619);
    # CE = (0.4644 + 0.0950) / 2 = 0.2797; 0.5 * 4 * 0.1619 + 0.5 * 0.2797 = 0.4636
    got = kd_loss(torch.tensor(STUDENT, dtype=torch.float64), torch.tensor(TEACHER, dtype=torch.float64), torch.tensor(LABELS), temperature=2.0, alpha=0.5)
    assert got.item() == pytest.approx(0.4636, abs=2e-4)


def test_kd_loss_alpha_one_needs_no_labels_and_sends_no_gradient_to_the_teacher():
    student = torch.tensor(STUDENT, dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor(TEACHER, dtype=torch.float64, requires_grad=True)
    got = kd_loss(student, teacher, None, temperature=2.0, alpha=1.0)
    assert got.item() == pytest.approx(hand_kd(2.0, 1.0), rel=1e-6)
    got.backward()
    assert teacher.grad is None and student.grad is not None
    # dL/ds = T^2 * (p_s - p_t) / (T * batch) = T * (p_s - p_t) / batch
    p_s, p_t = _softmax([x / 2 for x in STUDENT[0]]), _softmax([x / 2 for x in TEACHER[0]])
    assert student.grad[0].tolist() == pytest.approx([2 * (a - b) / 2 for a, b in zip(p_s, p_t, strict=True)],
                                                     rel=1e-5)
    same = kd_loss(torch.tensor(TEACHER, dtype=torch.float64), torch.tensor(TEACHER, dtype=torch.float64), None, temperature=3.0, alpha=1.0)
    assert same.item() == pytest.approx(0.0, abs=1e-7)


def test_kd_loss_rejects_missing_inputs():
    with pytest.raises(ValueError, match="no labels"):
        kd_loss(torch.tensor(STUDENT, dtype=torch.float64), torch.tensor(TEACHER, dtype=torch.float64), None, temperature=2.0, alpha=0.5)
    with pytest.raises(ValueError, match="no teacher logits"):
        kd_loss(torch.tensor(STUDENT, dtype=torch.float64), None, torch.tensor(LABELS), temperature=2.0, alpha=0.5)
    with pytest.raises(ValueError, match="temperature"):
        kd_loss(torch.tensor(STUDENT, dtype=torch.float64), torch.tensor(TEACHER, dtype=torch.float64), None, temperature=0.0, alpha=1.0)
    with pytest.raises(ValueError, match="differ in shape"):
        kd_loss(torch.tensor(STUDENT, dtype=torch.float64), torch.tensor(TEACHER, dtype=torch.float64)[:, :2], None, temperature=2.0, alpha=1.0)
    plain = kd_loss(torch.tensor(STUDENT, dtype=torch.float64), None, torch.tensor(LABELS), temperature=2.0, alpha=0.0)
    assert plain.item() == pytest.approx(hand_kd(2.0, 0.0), rel=1e-6)


def test_under_sample_dp_the_students_frozen_a_keys_are_those_of_the_blocks_it_keeps(tiny2):
    """Frozen-A (sample-level DP's default) records which adapter keys never cross the WAN; dropping blocks must drop
    their keys from that record, or the student would expect tensors it no longer has."""
    from nebula_fl.model.frozen_a import frozen_keys

    setup = TaskSetup(model=ModelConfig(model=str(tiny2), max_seq_len=32), labels=["a", "b"], seed=0, path=tiny2,
                      privacy_mode="sample")
    teacher_keys = frozen_keys(make_task("classify").build_model(setup))
    student_keys = frozen_keys(make_task("distill", {"task.student-layers": 1}).build_model(setup))
    assert {".layer.0.", ".layer.1."} <= {k[k.index(".layer."):][:9] for k in teacher_keys}
    assert student_keys and student_keys == {k for k in teacher_keys if ".layer.0." in k}


def test_student_has_n_layers_and_fewer_parameters_than_the_teacher(tiny2):
    labels = ["a", "b", "c"]
    setup = setup_for(tiny2, labels)
    student = make_task("distill", {"task.student-layers": 1}).build_model(setup)
    teacher = make_task("classify").build_model(setup)
    encoder = student.get_base_model().encoder
    assert len(encoder.encoder.layer) == 1 and encoder.config.num_hidden_layers == 1
    assert len(teacher.get_base_model().encoder.encoder.layer) == 2
    count = lambda m, trainable=False: sum(p.numel() for p in m.parameters() if p.requires_grad or not trainable)  # noqa: E731
    assert count(student) < count(teacher)
    # only the student's adapter and head cross the WAN: LoRA on query and value of one layer, and the head
    task = make_task("distill", {"task.student-layers": 1})
    sent = task.exchanged(student)
    hidden, r = 32, 8
    assert sum(a.size for a in sent.values()) == 2 * (r * hidden + hidden * r) + (hidden * 3 + 3)
    assert not any("layer.1." in k for k in sent)
    with pytest.raises(ConfigError, match=r"'task.student-layers' is 3, but the base model has 2 layers"):
        make_task("distill", {"task.student-layers": 3}).build_model(setup)


def test_local_teacher_soft_labels_ride_on_training_batches(tiny2):
    from nebula_fl.model.teacher import train_local_teacher

    labels = ["sport", "business"]
    targets = np.array([0, 1, 1, 1, 1, 0])
    setup = setup_for(tiny2, labels, seed=5)
    task = make_task("distill", {"task.teacher": "local:4", "task.teacher-batch-size": 4})
    data = task.examples(setup=setup, tokenizer=task.tokenizer(setup), texts=TEXTS, labels=targets, train=True)
    batch = data.batch([4, 0, 2])
    assert batch["teacher_logits"].shape == (3, 2)
    assert batch["labels"].tolist() == [1, 0, 1]
    # the same seed and shard give the same teacher: its logits, rows 4, 0, 2
    again = train_local_teacher(model=setup.model, path=tiny2, labels=labels, texts=TEXTS, targets=targets, steps=4,
                                batch_size=4, lr=5e-3, seed=5)
    assert torch.allclose(batch["teacher_logits"], again.logits(TEXTS)[[4, 0, 2]], atol=1e-5)
    held_out = task.examples(setup=setup, tokenizer=task.tokenizer(setup), texts=TEXTS, labels=targets, train=False)
    assert "teacher_logits" not in held_out.batch([0, 1])
    student = task.build_model(setup)
    loss = task.loss(student, batch)
    with torch.no_grad():
        logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    expected = kd_loss(logits, batch["teacher_logits"], batch["labels"], temperature=2.0, alpha=0.5)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    metrics = task.evaluate(student, held_out, batch_size=4)
    assert {"accuracy", "macro_f1", "loss"} <= set(metrics)


def test_alpha_zero_builds_no_teacher(tiny2):
    setup = setup_for(tiny2, ["x", "y"])
    task = make_task("distill", {"task.alpha": 0.0, "task.teacher": "/nonexistent/run"})  # never opened
    data = task.examples(setup=setup, tokenizer=task.tokenizer(setup), texts=TEXTS, labels=np.zeros(6, int), train=True)
    batch = data.batch([0, 1])
    assert "teacher_logits" not in batch
    student = task.build_model(setup)
    with torch.no_grad():
        logits = student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        assert task.loss(student, batch).item() == pytest.approx(
            torch.nn.functional.cross_entropy(logits, batch["labels"]).item(), rel=1e-6)


@pytest.fixture(scope="module")
def teacher_run(tiny2, tmp_path_factory):
    """A completed classify run folder as the server writes it: config.json and the final adapter."""
    from nebula_fl.data.datasets import load_dataset
    from nebula_fl.model.adapter import adapter_arrays, load_adapter_arrays
    from nebula_fl.model.loading import build_model
    from nebula_fl.storage.run_folder import RunFolder

    flat = load_config({"model": str(tiny2), "dataset": "bbcnews", "max-examples": 100, "seed": 3,
                                "max-seq-len": 32}).to_flat()
    folder = RunFolder(tmp_path_factory.mktemp("runs") / "classify-run")
    folder.write_config({"run_config": flat, "federation_id": "abc"})
    names = load_dataset("bbcnews").label_names
    model = build_model(ModelConfig.from_flat(flat), num_labels=len(names), seed=3, path=tiny2)
    rng = np.random.default_rng(0)
    trained = {k: (v + rng.normal(0, 0.3, v.shape)).astype(np.float32) for k, v in adapter_arrays(model).items()}
    load_adapter_arrays(model, trained)
    folder.save_adapter(trained)
    return folder.path, model.eval(), list(names)


def test_run_teacher_logits_are_the_runs_classifier(tiny2, teacher_run):
    from transformers import AutoTokenizer

    path, model, names = teacher_run
    setup = setup_for(tiny2, names)
    task = make_task("distill", {"task.teacher": str(path)})
    targets = np.arange(6) % len(names)
    data = task.examples(setup=setup, tokenizer=task.tokenizer(setup), texts=TEXTS, labels=targets, train=True)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny2))
    with torch.no_grad():  # one text at a time: no padding at all
        expected = torch.cat([model(**{k: v for k, v in tokenizer(t, return_tensors="pt", truncation=True,
                                                                  max_length=32).items() if k != "token_type_ids"})
                              for t in TEXTS])
    got = data.batch(range(6))["teacher_logits"]
    assert got.shape == (6, len(names))
    assert torch.allclose(got, expected, atol=1e-5)


def test_teacher_with_other_labels_is_rejected(tiny2, teacher_run):
    path, _, names = teacher_run
    task = make_task("distill", {"task.teacher": str(path)})
    for federation in (list(reversed(names)), [*names[:-1], "weather"]):
        setup = setup_for(tiny2, federation)
        with pytest.raises(ConfigError, match=r"'task.teacher': the teacher .* predicts labels .* but the federation"):
            task.examples(setup=setup, tokenizer=task.tokenizer(setup), texts=TEXTS, labels=np.zeros(6, int), train=True)


def test_run_folder_that_is_no_teacher_is_rejected(tiny2, tmp_path):
    setup = setup_for(tiny2, ["a"])
    cases = {tmp_path / "missing": "not a folder here", tmp_path / "empty": "not a nebula-fl run folder",
             tmp_path / "mlm": "is a 'mlm' run", tmp_path / "unfinished": "holds no adapter.safetensors"}
    (tmp_path / "empty").mkdir()
    for name, flat in (("mlm", {"task.name": "mlm"}), ("unfinished", {})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"run_config": flat}))
    for folder, message in cases.items():
        task = make_task("distill", {"task.teacher": str(folder)})
        with pytest.raises(ConfigError, match=message):
            task.examples(setup=setup, tokenizer=task.tokenizer(setup), texts=TEXTS, labels=np.zeros(6, int), train=True)


@pytest.mark.parametrize(("key", "value"), [
    ("task.teacher", "local:0"), ("task.teacher", "local:x"), ("task.teacher", ""), ("task.teacher", 3),
    ("task.temperature", 0.0), ("task.temperature", float("nan")), ("task.alpha", 1.5), ("task.alpha", -0.1),
    ("task.student-layers", 0), ("task.student-layers", 2.5), ("task.teacher-lr", 0.0),
    ("task.teacher-batch-size", 0),
])
def test_bad_options_name_the_key(key, value):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        DistillTask(options={key: value})
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config({"task.name": "distill", key: value})


def test_unknown_option_and_presets():
    with pytest.raises(ConfigError, match=r"did you mean 'task\.temperature'"):
        load_config({"task.name": "distill", "task.temprature": 2.0})
    for name, keys in DistillTask.presets.items():
        cfg = load_config({**PRESETS[name], **keys, "task.name": "distill"})
        assert cfg.task_options["task.teacher"].startswith("local:")
    smoke = load_config({**PRESETS["smoke"], **DistillTask.presets["smoke"], "task.name": "distill"})
    assert smoke.task_options["task.student-layers"] == 1 and smoke.federation.num_server_rounds == 2
    with pytest.raises(ConfigError, match=r"'privacy\.mode'"):
        load_config({"task.name": "distill", "privacy.mode": "sample", "privacy.noise-multiplier": 1.0})
