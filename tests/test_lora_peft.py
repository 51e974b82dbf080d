"""pockjax LoRA against Hugging Face PEFT: the same losses over 20 AdamW steps (live, torch on CPU).

A tiny random LLaMA is saved with :func:`pockjax.models.llama.save_hf_checkpoint`
and loaded by ``transformers.LlamaForCausalLM``; both sides get rank-8 adapters
(alpha 16) on q/k/v/o with the same values (``lora_A.weight = A^T``,
``lora_B.weight = B^T``), train them with AdamW (torch's defaults: betas
(0.9, 0.999), eps 1e-8, weight decay 0.01) on the same 20 batches, and must
report the same loss at every step.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import pockjax
from pockjax.adapters import LoraTensor
from pockjax.models import llama
from pockjax.train.steps import answer_train_step

RANK, ALPHA, LR, STEPS = 8, 16, 1e-2, 20
BATCH, SEQ, WINDOW = 4, 16, 4
PROJ = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}


def _batches(cfg, rng):
    """STEPS batches of next-token rows whose loss positions all lie in the answer window.

    Tokens come from a skewed (Zipf-like) distribution over the vocabulary, so
    adapters on attention alone can lower the loss on fresh batches.
    """
    p = 1.0 / np.arange(1, cfg.vocab) ** 1.2
    p /= p.sum()
    out = []
    for _ in range(STEPS):
        tokens = 1 + rng.choice(cfg.vocab - 1, size=(BATCH, SEQ + 1), p=p)
        start = rng.integers(2, SEQ - WINDOW + 1, size=BATCH)  # the window never reaches the end
        n = rng.integers(2, WINDOW + 1, size=BATCH)  # 2..WINDOW answer positions per row
        mask = np.zeros((BATCH, SEQ), np.float32)
        for i in range(BATCH):
            mask[i, start[i]:start[i] + n[i]] = 1.0
        out.append({"tokens": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32),
                    "loss_mask": mask, "loss_start": start.astype(np.int32)})
    return out


def test_lora_matches_peft_over_20_adamw_steps(tmp_path):
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = llama.LlamaConfig.tiny(rope_theta=1000.0)
    model = llama.Llama(cfg, rngs=nnx.Rngs(0))
    graphdef, params = llama.split(model)
    rng = np.random.default_rng(0)

    # -- pockjax: adapters with known nonzero A and B ---------------------------------
    scheme = pockjax.UpdateScheme({"layers.*.attn.w[qkvo].kernel": pockjax.lora(RANK, alpha=ALPHA)})
    p = pockjax.add_adapters(params, scheme)
    init = {}
    for i in range(cfg.n_layers):
        for name in PROJ:
            t = p["layers"][i]["attn"][name]["kernel"]
            assert isinstance(t, LoraTensor) and t.scale == ALPHA / RANK
            m, n = t.shape
            a = rng.uniform(-1, 1, (m, RANK)).astype(np.float32) / np.sqrt(m)
            b = (0.02 * rng.standard_normal((RANK, n))).astype(np.float32)
            init[i, name] = (a, b)
            p["layers"][i]["attn"][name]["kernel"] = LoraTensor(t.base, jnp.asarray(a), jnp.asarray(b),
                                                                scale=t.scale)
    tx = optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
    step = pockjax.compile(answer_train_step(graphdef, tx, window=WINDOW), scheme=scheme)
    state = pockjax.init_opt_state(tx, p, scheme)

    # -- PEFT: the same weights and adapter values -------------------------------------
    llama.save_hf_checkpoint(model, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none",
                             target_modules=list(PROJ.values()))
    tuned = peft.get_peft_model(hf, config)
    layers = tuned.base_model.model.model.layers
    with torch.no_grad():
        for (i, name), (a, b) in init.items():
            proj = getattr(layers[i].self_attn, PROJ[name])
            assert proj.scaling["default"] == ALPHA / RANK
            proj.lora_A["default"].weight.copy_(torch.from_numpy(a.T.copy()))
            proj.lora_B["default"].weight.copy_(torch.from_numpy(b.T.copy()))
    trainable = [q for q in tuned.parameters() if q.requires_grad]
    assert len(trainable) == 2 * len(init)  # only the adapters train
    opt = torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)

    jax_losses, torch_losses = [], []
    for batch in _batches(cfg, rng):
        p, state, loss = step(p, state, {k: jnp.asarray(v) for k, v in batch.items()})
        jax_losses.append(float(loss))

        logits = tuned(input_ids=torch.from_numpy(batch["tokens"]).long()).logits
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.from_numpy(batch["targets"]).long()
                                                .flatten(), reduction="none")
        mask = torch.from_numpy(batch["loss_mask"]).flatten()
        tloss = (nll * mask).sum() / mask.sum()
        opt.zero_grad()
        tloss.backward()
        opt.step()
        torch_losses.append(tloss.item())

    np.testing.assert_allclose(jax_losses, torch_losses, rtol=1e-3)
    assert jax_losses[-1] < jax_losses[0] - 0.05, jax_losses  # it trained: the comparison is not vacuous
    for (i, name), (a0, b0) in init.items():
        t = p["layers"][i]["attn"][name]["kernel"]
        proj = getattr(layers[i].self_attn, PROJ[name])
        a_ref = proj.lora_A["default"].weight.detach().numpy().T
        b_ref = proj.lora_B["default"].weight.detach().numpy().T
        np.testing.assert_allclose(np.asarray(t.lora_a), a_ref, rtol=1e-3, atol=1e-5)
        np.testing.assert_allclose(np.asarray(t.lora_b), b_ref, rtol=1e-3, atol=1e-5)
        assert np.abs(b_ref - b0).max() > 1e-2  # both factors moved
        assert np.abs(a_ref - a0).max() > 1e-2
        np.testing.assert_array_equal(np.asarray(t.base), np.asarray(params["layers"][i]["attn"][name]["kernel"]))
