"""Reference implementations of smp.nn's distributed modules, in one process: SMP's
appendix ("Reference Implementations for Modules", smd_model_parallel_pytorch_tensor_
parallel.rst) written out, with the two differences docs/tensor_parallel.md names (a
pre-LN block without post_layernorm adds its residual; the MLP's dropout is
hidden_dropout_prob). Their weights are drawn by the same torch calls in the same
order as the distributed modules draw their full weights."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def act(name, x):
    return {"gelu": F.gelu, "relu": F.relu,
            "gelu_new": lambda t: F.gelu(t, approximate="tanh")}[name](x)


class Attention(nn.Module):
    def __init__(self, num_attention_heads, attention_head_size, hidden_size,
                 attention_dropout_prob, hidden_dropout_prob, layernorm_epsilon=1e-5,
                 cross_attention=False, causal_mask_size=None, pre_layernorm=False,
                 post_layernorm=True, **_):
        super().__init__()
        self.h, self.d = num_attention_heads, attention_head_size
        inner = self.h * self.d
        self.query = nn.Linear(hidden_size, inner)
        self.key = nn.Linear(hidden_size, inner)
        self.value = nn.Linear(hidden_size, inner)
        self.dense = nn.Linear(inner, hidden_size)
        self.dropout1 = nn.Dropout(attention_dropout_prob)
        self.dropout2 = nn.Dropout(hidden_dropout_prob)
        self.cross, self.causal = cross_attention, causal_mask_size
        self.pre, self.post = pre_layernorm, post_layernorm
        if pre_layernorm:
            self.pre_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
        if post_layernorm:
            self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)

    def _t(self, x):
        return x.reshape(x.shape[:-1] + (self.h, self.d)).permute(0, 2, 1, 3)

    def forward(self, inp):
        if self.cross:
            hidden, cross, mask = inp
        else:
            hidden, mask = inp
        norm = self.pre_layernorm(hidden) if self.pre else hidden
        kv = cross if self.cross else norm
        q, k, v = self._t(self.query(norm)), self._t(self.key(kv)), self._t(self.value(kv))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.d)
        if not self.cross and self.causal is not None:
            s_q, s_k = scores.shape[-2:]
            keep = torch.ones(s_q, s_k, dtype=torch.bool).tril(s_k - s_q)
            scores = torch.where(keep, scores, torch.tensor(torch.finfo(scores.dtype).min))
        if mask is not None:
            scores = scores + mask
        probs = self.dropout1(F.softmax(scores, dim=-1))
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3)
        out = self.dropout2(self.dense(ctx.reshape(ctx.shape[:-2] + (-1,))))
        return self.layernorm(out + hidden) if self.post else out + hidden


class Output(nn.Module):
    def __init__(self, hidden_size, intermediate_size, hidden_dropout_prob, activation="gelu",
                 layernorm_epsilon=1e-5, pre_layernorm=False, post_layernorm=True, **_):
        super().__init__()
        self.dense1 = nn.Linear(hidden_size, intermediate_size)
        self.dense2 = nn.Linear(intermediate_size, hidden_size)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.activation, self.pre, self.post = activation, pre_layernorm, post_layernorm
        if pre_layernorm:
            self.pre_layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)
        if post_layernorm:
            self.layernorm = nn.LayerNorm(hidden_size, eps=layernorm_epsilon)

    def forward(self, inp):
        norm = self.pre_layernorm(inp) if self.pre else inp
        out = self.dropout(self.dense2(act(self.activation, self.dense1(norm))))
        return self.layernorm(inp + out) if self.post else inp + out


class Layer(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.attention = Attention(**kw)
        self.output = Output(**kw)

    def forward(self, inp):
        hidden, mask = inp
        return self.output(self.attention((hidden, mask))), mask


class Transformer(nn.Module):
    def __init__(self, num_layers, pre_layernorm=False, post_layernorm=True, **kw):
        super().__init__()
        final = pre_layernorm and post_layernorm
        self.seq_layers = nn.Sequential(*[
            Layer(pre_layernorm=pre_layernorm, post_layernorm=post_layernorm and not final, **kw)
            for _ in range(num_layers)])
        self.final = final
        if final:
            self.layernorm = nn.LayerNorm(kw["hidden_size"], eps=kw.get("layernorm_epsilon", 1e-5))

    def forward(self, inp):
        out = self.seq_layers(inp)
        return (self.layernorm(out[0]),) + tuple(out[1:]) if self.final else out


def embedding(num, dim, initializer_range=0.02):
    w = torch.empty(num, dim)
    w.normal_(mean=0.0, std=initializer_range)
    return nn.Embedding(num, dim, _weight=w)


class LMHead(nn.Module):
    def __init__(self, vocab_size, num_positions, hidden_dropout_prob, initializer_range=0.02,
                 **kw):
        super().__init__()
        h = kw["hidden_size"]
        self.word_embedding = embedding(vocab_size, h, initializer_range)
        self.position_embedding = embedding(num_positions, h, initializer_range)
        self.dropout = nn.Dropout(hidden_dropout_prob)
        self.transformer = Transformer(hidden_dropout_prob=hidden_dropout_prob, **kw)

    def forward(self, inputs):
        ids, mask, _, _, labels = inputs
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        hidden = self.dropout(self.word_embedding(ids) + self.position_embedding(pos))
        add = None if mask is None else mask[:, None, None, :].float() * torch.finfo(torch.float).min
        hidden = self.transformer((hidden, add))[0]
        logits = F.linear(hidden, self.word_embedding.weight)
        loss = F.cross_entropy(logits[..., :-1, :].reshape(-1, logits.shape[-1]),
                               labels[..., 1:].reshape(-1))
        return loss, logits


def one_job(cases):
    """A rank script running each (script, argument list) of `cases` in turn, with
    smp.shutdown() between: one rank start-up for several cases (each case sets its own
    seeds and calls smp.init itself; they share __main__'s globals, as smp.step and
    remote calls look functions up there). A case that exits (sys.exit) ends the job, so a
    refused case goes last. Each case's output lines follow a "CASE <i>" line."""
    return ("import sys as _sys\nimport smp as _smp\n"
            f"_CASES = {[(body, list(argv)) for body, argv in cases]!r}\n"
            "for _i, (_body, _argv) in enumerate(_CASES):\n"
            "    print('CASE', _i, flush=True)\n"
            "    _sys.argv = _sys.argv[:1] + _argv\n"
            "    exec(compile(_body, '<case %d>' % _i, 'exec'), _sys.modules['__main__'].__dict__)\n"
            "    _smp.shutdown()\n")


def case_outputs(stdout, tag):
    """The JSON that each case of a one_job script printed after `tag`, in case order
    (None for a case that printed none)."""
    import json
    outs = []
    for line in stdout.splitlines():
        if line.startswith("CASE "):
            outs.append(None)
        elif outs and outs[-1] is None and tag + " " in line:
            outs[-1] = json.loads(line.split(tag + " ", 1)[1])
    return outs
