"""The causal-lm base's weights: fp32, real bf16, or a frozen 4-bit NormalFloat / 8-bit base through bitsandbytes
(QLoRA), and gradient checkpointing. The adapter that trains and crosses the WAN is the same fp32 LoRA whatever
the base; what cannot work is refused in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nebula_fl.config import ConfigError, RunConfig
from nebula_fl.errors import NebulaError
from nebula_fl.model.adapter import adapter_arrays
from nebula_fl.model.locate import resolve_model_path
from nebula_fl.tasks import TaskSetup, make_task

IDS = torch.tensor([[5, 900, 1200, 77, 3000, 42, 8, 19], [7, 600, 21, 99, 1000, 4, 2, 11]])


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """A small pretrained Llama folder (seeded weights, MiniLM's tokenizer), sized for bitsandbytes' 64-blocks."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("decoder") / "model"
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64, eos_token_id=102,
                         pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(resolve_model_path("minilm"))).save_pretrained(folder)
    return resolve_model_path(str(folder))


def build(path, privacy: str = "off", **options):
    cfg = RunConfig().replace({"max-seq-len": 32, "lora-target-modules": "q_proj,v_proj"})
    task = make_task("causal-lm", options)
    return task, task.build_model(TaskSetup(model=cfg.model, labels=[], seed=0, path=path, privacy_mode=privacy))


def lm_loss(model) -> torch.Tensor:
    return model(input_ids=IDS, labels=IDS).loss


def train(model, steps: int = 5) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = lm_loss(model)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def test_a_bf16_base_holds_bf16_weights_and_trains_the_same_fp32_adapter(decoder):
    _, fp32 = build(decoder)
    _, bf16 = build(decoder, **{"task.base-dtype": "bf16"})
    base = bf16.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    assert base.dtype == torch.bfloat16 and base.element_size() == 2
    lora = [p for n, p in bf16.named_parameters() if "lora_" in n]
    assert lora and all(p.dtype == torch.float32 and p.requires_grad for p in lora)
    a, b = adapter_arrays(fp32), adapter_arrays(bf16)
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    assert all(v.dtype == np.float32 for v in b.values())
    losses = train(bf16)
    assert losses[-1] < losses[0] and np.isfinite(losses).all()


def test_a_4bit_base_is_bitsandbytes_nf4_frozen_and_close_to_the_fp32_model_and_its_lora_trains(decoder):
    import bitsandbytes as bnb

    _, fp32 = build(decoder)
    _, nf4 = build(decoder, **{"task.base-dtype": "nf4"})
    q = nf4.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert isinstance(q, bnb.nn.Linear4bit) and q.weight.quant_type == "nf4" and not q.weight.requires_grad
    assert q.weight.numel() * 8 == 64 * 64 * 4  # 4 bits a weight, packed two to a byte
    assert set(adapter_arrays(nf4)) == set(adapter_arrays(fp32))
    with torch.no_grad():  # a no-op adapter: the quantised model is the fp32 one up to 4-bit rounding
        x, y = nf4(input_ids=IDS).logits.flatten(), fp32(input_ids=IDS).logits.flatten()
    assert float(torch.corrcoef(torch.stack([x, y]))[0, 1]) > 0.9
    losses = train(nf4)  # after a forward in eval mode without gradients (bitsandbytes' CPU repacking: see the task)
    assert losses[-1] < losses[0] and np.isfinite(losses).all()
    assert not any(p.requires_grad for n, p in nf4.named_parameters() if "lora_" not in n)


def test_gradient_checkpointing_gives_the_same_loss_and_adapter_gradients(decoder):
    grads = {}
    for on in (False, True):
        _, model = build(decoder, **{"task.gradient-checkpointing": on})
        assert model.base_model.model.is_gradient_checkpointing == on
        model.train()
        lm_loss(model).backward()
        grads[on] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads[True] and set(grads[True]) == set(grads[False])
    for name, grad in grads[False].items():
        torch.testing.assert_close(grads[True][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_what_cannot_work_is_refused_in_one_line(decoder):
    from nebula_fl.model.sharding import wrap

    for options, match in (({"task.base-dtype": "fp16"}, "task.base-dtype' is 'fp16'; use one of fp32, bf16, nf4, int8"),
                           ({"task.base-dtype": "bf16", "task.exchange": "full"}, "keep fp32 weights"),
                           ({"task.base-dtype": "nf4", "task.init": "scratch"}, "quantise a pretrained model"),
                           ({"task.gradient-checkpointing": "yes"}, "task.gradient-checkpointing")):
        with pytest.raises(ConfigError, match=match):
            make_task("causal-lm", options)
    with pytest.raises(NebulaError, match=r"per-example DP \(privacy.mode 'sample'\).*use fp32$"):
        build(decoder, privacy="sample", **{"task.base-dtype": "nf4"})
    _, nf4 = build(decoder, **{"task.base-dtype": "nf4"})
    with pytest.raises(NebulaError, match="cannot be sharded by FSDP here; run --parallel ddp"):
        wrap(nf4, parallel="fsdp", device=torch.device("cpu"), world=1)


def test_an_8bit_base_is_bitsandbytes_int8_and_its_lora_trains(decoder):
    import bitsandbytes as bnb

    _, int8 = build(decoder, **{"task.base-dtype": "int8"})
    v = int8.base_model.model.model.layers[1].self_attn.v_proj.base_layer
    assert isinstance(v, bnb.nn.Linear8bitLt) and v.weight.dtype == torch.int8 and not v.weight.requires_grad
    losses = train(int8)
    assert losses[-1] < losses[0] and np.isfinite(losses).all()
