"""Tiny Hugging Face `transformers` models (GPT-2, BERT, T5 from configs, no weights) and
one training job over them, shared by tests/python/test_hf_models.py's rank scripts and
its one-process reference. The configs are tiny (2 layers, hidden 64, vocabulary 256) so
that the suite stays fast; dropout is 0 so that a pipelined run and the plain model in
one process compute the same function (their random streams differ by design)."""
import hashlib
import json

import torch

__all__ = ["KINDS", "build", "batch", "train", "blocks", "record_dtypes"]

KINDS = ("gpt2", "bert", "t5")
VOCAB, SEQ, BATCH = 256, 16, 8


def _config(kind):
    import transformers as tf
    if kind == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2,
                             n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if kind == "bert":
        return tf.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, intermediate_size=128,
                             max_position_embeddings=64, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0)
    if kind == "t5":
        return tf.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                           num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                           decoder_start_token_id=0, pad_token_id=0)
    raise ValueError(f"unknown model kind {kind!r}: one of {KINDS}")


def build(kind):
    """The model of `kind` from its tiny config (call under the seed and context the
    run wants)."""
    import transformers as tf
    cls = {"gpt2": tf.GPT2LMHeadModel, "bert": tf.BertForMaskedLM,
           "t5": tf.T5ForConditionalGeneration}[kind]
    return cls(_config(kind))


def blocks(kind, module):
    """The model's transformer blocks (what a user checkpoints)."""
    if kind == "gpt2":
        return list(module.transformer.h)
    if kind == "bert":
        return list(module.bert.encoder.layer)
    return list(module.encoder.block) + list(module.decoder.block)


def batch(kind, step, rows=BATCH):
    """Step `step`'s inputs as keyword arguments: token ids, an attention mask with
    padding at the end of some rows, and labels (every token counts in the loss, so a
    microbatch's mean loss has the weight of its rows)."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(1, VOCAB, (rows, SEQ), generator=g)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (rows,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    labels = torch.randint(1, VOCAB, (rows, SEQ), generator=g) if kind == "t5" else ids.clone()
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def digest(state):
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def train(step_fn, optimizer, kind, steps, dp_size=1, lo=0, rows=BATCH):
    """`steps` optimizer steps on the global batch of `dp_size` replicas; `step_fn(batch)
    -> mean loss (float)` runs forward and backward on rows [lo, lo + rows) of it.
    Returns the losses."""
    losses = []
    for step in range(steps):
        full = batch(kind, step, BATCH * dp_size)
        mine = {k: v[lo:lo + rows] for k, v in full.items()}
        optimizer.zero_grad()
        losses.append(step_fn(mine))
        optimizer.step()
    return losses


def plain_run(kind, steps, dp_size=1, lr=0.5):
    """The reference: the plain model in one process, the whole global batch at once."""
    torch.manual_seed(0)
    model = build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step_fn(b):
        loss = model(**b).loss
        loss.backward()
        return loss.item()
    return train(step_fn, opt, kind, steps, dp_size, 0, BATCH * dp_size), {k: v.detach().clone()
                                              for k, v in model.state_dict().items()}


def _dtypes(value, out):
    if isinstance(value, torch.Tensor):
        out.append(str(value.dtype).replace("torch.", ""))
    elif isinstance(value, (tuple, list)):
        for v in value:
            _dtypes(v, out)
    elif isinstance(value, dict):  # a ModelOutput too
        for v in value.values():
            _dtypes(v, out)
    return out


def record_dtypes(module, phase=lambda: "run"):
    """Records, for every module of `module` that runs, the dtypes of its output's
    tensors: {phase(): {module name: [the distinct "bfloat16,float32" lists of its calls]}}
    (a forward hook on each; under smp it runs where the module runs)."""
    table = {}

    def hook(name):
        def record(_module, _args, out):
            calls = table.setdefault(phase(), {}).setdefault(name, [])
            sig = ",".join(_dtypes(out, []))
            if sig not in calls:
                calls.append(sig)
        return record
    for name, m in module.named_modules():
        m.register_forward_hook(hook(name))
    return table


def dumps(obj):
    return json.dumps(obj)
