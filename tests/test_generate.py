"""`nebula-fl generate`: a run's tuned completions against transformers' own `generate` on a model rebuilt here.

The run folders are written in-process by the server's own writers (``ServerRun._open`` writes config.json with
every option, ``RunFolder.save_checkpoint`` / ``save_adapter``, ``ServerRun._finish`` the completed summary), with
final weights made non-zero here, so a test needs no federation; one e2e test checks a real smoke federation's
folder. The reference never calls nebula-fl's model code: a Llama built from its config with the run's seed, the
adapter applied by PEFT's ``set_peft_model_state_dict`` (or the state dict loaded by torch), the plain prompt
template written out, and ``model.generate(do_sample=False)``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from nebula_fl.cli import main
from nebula_fl.config import PRESETS
from nebula_fl.storage.run_folder import ADAPTER, CONFIG, MODEL, PEFT_ADAPTER, RunFolder
from nebula_fl.tasks.causal_lm import CausalLMTask

PROMPTS = ("Which topic is this BBC News article about? Answer with one word: business, entertainment, politics, "
           "sport or tech.\n\nShares in the bank rose after profits beat forecasts.", "Name a sport.")
N = 12


def smoke_flat(**overrides) -> dict:
    """`nebula-fl run --task causal-lm --preset smoke`'s config keys."""
    return {**PRESETS["smoke"], **CausalLMTask.presets["smoke"], "task.name": "causal-lm", **overrides}


def write_run(folder: Path, **overrides) -> Path:
    """A completed causal-lm run folder written by the server's own code, its final weights seeded noise (LoRA B
    non-zero; for a full-exchange run every weight moved), so that tuning visibly changed the model."""
    from nebula_fl.components import load
    from nebula_fl.server.app import ServerRun
    from nebula_fl.server.evaluation import ServerEvaluator

    cfg = load(smoke_flat(**{"out-dir": str(folder), **overrides}))
    server = ServerRun(cfg)
    server._open()
    evaluator = ServerEvaluator(cfg)
    rng = np.random.default_rng(7)
    final = {k: (v + rng.normal(0.0, 0.5 if "lora_B" in k else 0.05, v.shape)).astype(np.float32)
             for k, v in evaluator.initial_adapter().items()}
    server.folder.save_checkpoint(round=1, adapter=final, state={"federation_id": server.federation_id})
    if evaluator.task.exchange == "full":
        server.folder.save_adapter(evaluator.whole_model(final), name=MODEL)
    else:
        server.folder.save_adapter(final, name=ADAPTER)
    server._finish("completed")
    return folder


@pytest.fixture(scope="module")
def adapter_run(tmp_path_factory) -> Path:
    return write_run(tmp_path_factory.mktemp("gen") / "adapter-run")


def generate(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def generate_json(capsys, folder: Path, *extra: str) -> dict:
    args = [str(folder), *[a for p in PROMPTS for a in ("--prompt", p)], "--max-new-tokens", str(N), "--json", *extra]
    code, out, err = generate(capsys, *args)
    assert code == 0, err
    return json.loads(out)


# -- the independent reference ------------------------------------------------------------------------------------
def reference_model(folder: Path):
    """The run's base model rebuilt from its config.json with transformers alone (seeded as the run was)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from nebula_fl.model.locate import resolve_model_path

    flat = json.loads((folder / CONFIG).read_text())["run_config"]
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(flat["model"])), local_files_only=True)
    assert tokenizer.eos_token_id is None and not getattr(tokenizer, "chat_template", None)  # MiniLM's: [SEP] ends
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=flat["task.hidden"],
                         num_hidden_layers=flat["task.layers"], num_attention_heads=flat["task.heads"],
                         num_key_value_heads=flat["task.heads"], intermediate_size=flat["task.intermediate"],
                         max_position_embeddings=flat["max-seq-len"], tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.sep_token_id, bos_token_id=None)
    torch.manual_seed(flat["seed"])
    return LlamaForCausalLM(config).eval(), tokenizer, flat


def reference_ids(model, tokenizer, prompt: str) -> list[int]:
    text = f"### Instruction:\n{prompt}\n\n### Response:\n"  # the plain template: MiniLM has no chat template
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N,
                             eos_token_id=tokenizer.sep_token_id, pad_token_id=tokenizer.pad_token_id)
    new = out[0, ids.shape[1]:].tolist()
    return new[: new.index(tokenizer.sep_token_id)] if tokenizer.sep_token_id in new else new


def with_adapter(model, folder: Path, flat: dict):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    peft = get_peft_model(model, LoraConfig(r=flat["lora-r"], lora_alpha=flat["lora-alpha"], lora_dropout=0.0,
                                            target_modules=flat["lora-target-modules"].split(",")))
    loaded = set_peft_model_state_dict(peft, load_file(str(folder / ADAPTER)))
    assert not loaded.unexpected_keys and not [k for k in loaded.missing_keys if "lora_" in k]
    return peft.eval()


# -- the tests ----------------------------------------------------------------------------------------------------
def test_adapter_run_base_and_tuned_match_transformers_generate(adapter_run, capsys):
    result = generate_json(capsys, adapter_run)
    model, tokenizer, flat = reference_model(adapter_run)
    base = [reference_ids(model, tokenizer, p) for p in PROMPTS]
    tuned_model = with_adapter(model, adapter_run, flat)
    tuned = [reference_ids(tuned_model, tokenizer, p) for p in PROMPTS]
    got = result["completions"]
    assert [c["prompt"] for c in got] == list(PROMPTS)
    assert [c["base"]["token_ids"] for c in got] == base
    assert [c["tuned"]["token_ids"] for c in got] == tuned
    assert [c["tuned"]["text"] for c in got] == [tokenizer.decode(t, skip_special_tokens=True) for t in tuned]
    assert base != tuned and any(c["changed"] for c in got)  # a non-zero adapter changed what the model says
    assert result["weights"] == ADAPTER and result["exchange"] == "adapter" and result["max_new_tokens"] == N
    assert all(len(c["tuned"]["token_ids"]) <= N for c in got)


def test_full_exchange_run_loads_the_whole_state_dict(tmp_path, capsys):
    from safetensors.torch import load_file

    folder = write_run(tmp_path / "full-run", **{"task.exchange": "full"})
    assert not (folder / ADAPTER).exists()
    result = generate_json(capsys, folder)
    model, tokenizer, _ = reference_model(folder)
    base = [reference_ids(model, tokenizer, p) for p in PROMPTS]
    model.load_state_dict(load_file(str(folder / MODEL)), strict=True)
    tuned = [reference_ids(model, tokenizer, p) for p in PROMPTS]
    assert [c["base"]["token_ids"] for c in result["completions"]] == base
    assert [c["tuned"]["token_ids"] for c in result["completions"]] == tuned
    assert base != tuned and result["weights"] == MODEL


def test_table_shows_prompt_base_and_tuned(adapter_run, capsys):
    code, out, err = generate(capsys, str(adapter_run), "--prompt", "Name a [bold]sport[/bold].", "--max-new-tokens",
                              "4")
    assert code == 0, err
    assert "prompt" in out and "base" in out and "tuned" in out and "[bold]sport[/bold]" in out  # no markup eaten
    assert "causal-lm on minilm, adapter exchange" in out


@pytest.fixture
def edited(adapter_run, tmp_path):
    """A copy of the completed run folder to break."""
    return Path(shutil.copytree(adapter_run, tmp_path / "copy"))


def refused(capsys, *args: str) -> str:
    code, out, err = generate(capsys, *args)
    assert code == 2, (out, err)
    assert err.startswith("nebula-fl: error: ") and err.count("\n") == 1  # one line
    return err


def test_refuses_what_is_not_a_completed_causal_lm_run(tmp_path, edited, capsys):
    assert "is not a folder" in refused(capsys, str(tmp_path / "nowhere"), "--prompt", "x")
    (tmp_path / "empty").mkdir()
    assert "not a nebula-fl run folder (no readable config.json)" in refused(capsys, str(tmp_path / "empty"),
                                                                              "--prompt", "x")
    RunFolder(tmp_path / "classify").write_config({"run_config": {"task.name": "classify", "seed": 0}})
    assert "generate needs a causal-lm run; this run trained 'classify'" in refused(
        capsys, str(tmp_path / "classify"), "--prompt", "x")

    (edited / ADAPTER).unlink()
    err = refused(capsys, str(edited), "--prompt", "x")
    assert f"has no {ADAPTER}" in err
    RunFolder(edited).update_summary(status="interrupted")
    err = refused(capsys, str(edited), "--prompt", "x")
    assert "did not complete" in err and "'interrupted'" in err and ADAPTER in err and "--resume" in err


def test_refuses_bad_prompts_and_lengths(adapter_run, capsys):
    assert "--prompt number 2 is empty" in refused(capsys, str(adapter_run), "--prompt", "a", "--prompt", "  ")
    for n in ("0", "1025", "-3"):
        assert f"--max-new-tokens is {n}; use 1 to 1024" in refused(capsys, str(adapter_run), "--prompt", "a",
                                                                    "--max-new-tokens", n)


def test_moved_base_model_needs_model_flag(edited, capsys):
    from nebula_fl.model.locate import resolve_model_path

    config = json.loads((edited / CONFIG).read_text())
    config["run_config"]["model"] = str(edited / "moved-away")
    (edited / CONFIG).write_text(json.dumps(config))
    err = refused(capsys, str(edited), "--prompt", "x")
    assert "base model" in err and "moved-away" in err and "pass --model PATH" in err
    # pointed at the model's new place, the run generates as before
    before = generate_json(capsys, edited, "--model", str(resolve_model_path("minilm")))
    config["run_config"]["model"] = "minilm"
    (edited / CONFIG).write_text(json.dumps(config))
    assert generate_json(capsys, edited) == {**before, "model": "minilm"}


def test_a_federations_folder_generates_like_transformers(causal_lm_secure_federation, capsys):
    """A real causal-lm smoke federation's folder (the shared one of tests/conftest.py: secure aggregation, client
    DP, random-k, FedAdam): generate's tuned completions are the reference's (PEFT adapter on a transformers Llama),
    token for token."""
    out = causal_lm_secure_federation.out
    assert causal_lm_secure_federation.code == 0, causal_lm_secure_federation.cli.output()[-4000:]
    result = generate_json(capsys, out)
    model, tokenizer, flat = reference_model(out)
    tuned_model = with_adapter(model, out, flat)
    tuned = [reference_ids(tuned_model, tokenizer, p) for p in PROMPTS]
    assert [c["tuned"]["token_ids"] for c in result["completions"]] == tuned
    # the run folder's PEFT adapter folder, loaded by PEFT's own loader onto a fresh base, generates the same
    from peft import PeftModel

    config = json.loads((out / PEFT_ADAPTER / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == flat["lora-r"]
    loaded = PeftModel.from_pretrained(reference_model(out)[0], str(out / PEFT_ADAPTER)).eval()
    assert [reference_ids(loaded, tokenizer, p) for p in PROMPTS] == tuned
    assert result["rounds_completed"] == 2
