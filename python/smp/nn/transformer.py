"""smp.nn's distributed transformer (SMP v1.6+): attention, the MLP ("output layer"),
the layer, the stack and the language-model head, each cut across the tp group the
way Megatron-LM cuts them: query/key/value and the MLP's first map by output features
(whole heads per rank), the attention's and the MLP's output maps by input features.
Each block gathers the group's batch once going in and sums its partial output once
going out (smp/nn/distributed.py's enter/leave); layer norms, residuals and the loss
run on the rank's own rows with replicated parameters.

Their reference implementations are SMP's appendix ("Reference Implementations for
Modules"), with two documented differences (docs/tensor_parallel.md): a pre-LN block
without post_layernorm adds its residual, and the MLP's dropout is
hidden_dropout_prob.
"""
import math

import torch
import torch.nn.functional as F

import smp._C as _C
from smp.nn.layer_norm import FusedLayerNorm
from smp.nn.distributed import (CutLinear, DistributedEmbedding, DistributedModule,
                                dropout, outermost, enter, enter_mask, leave, rows_dropout,
                                tp_group)

__all__ = []

_ACTIVATIONS = ("gelu", "gelu_new", "relu")


def _activation(name, x):
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_new":
        return F.gelu(x, approximate="tanh")
    return F.relu(x)


def _add_layernorms(block, hidden_size, eps, pre_layernorm, post_layernorm):
    """A block's `pre_layernorm` (on its input) and `layernorm` (on its output after
    the residual), as asked, replicated over the tp group."""
    block.use_pre_layernorm, block.use_post_layernorm = pre_layernorm, post_layernorm
    if pre_layernorm:
        block.pre_layernorm = FusedLayerNorm(hidden_size, eps=eps)
    if post_layernorm:
        block.layernorm = FusedLayerNorm(hidden_size, eps=eps)


def _check_layernorms(owner, pre_layernorm, post_layernorm):
    if not (pre_layernorm or post_layernorm):
        raise _C.ConfigError(f"smp.nn.{owner}: pre_layernorm=False and post_layernorm=False "
                             "(allowed: at least one of them True)")


class DistributedAttentionLayer(DistributedModule):
    """SMP's DistributedAttentionLayer: self- (or cross-) attention, the output map and
    its dropout, then the residual and layer normalization. Rank t of the tp group
    computes heads [t*h/tp, (t+1)*h/tp) for the group's whole batch.

    forward((hidden_states, attention_mask)) or, with cross_attention,
    ((hidden_states, cross_states, attention_mask)); hidden_states [N, S, H],
    attention_mask additive, broadcastable to [N, 1, S, S] (e.g. [N, 1, 1, S]) or
    None. Returns hidden_states' shape.
    """

    def __init__(self, num_attention_heads=32, attention_head_size=32, hidden_size=1024,
                 attention_dropout_prob=0.1, hidden_dropout_prob=0.1, layernorm_epsilon=1e-5,
                 initializer_range=0.02, use_normal_initialization=False,
                 cross_attention=False, causal_mask_size=None, pre_layernorm=False,
                 post_layernorm=True, scale_attention_scores=True, **_hints):
        super().__init__()
        _check_layernorms("DistributedAttentionLayer", pre_layernorm, post_layernorm)
        size, _, _ = tp_group()
        _C.tp_check_divisible("DistributedAttentionLayer num_attention_heads",
                              num_attention_heads, size)
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = attention_head_size
        self.hidden_size = hidden_size
        self.local_heads = num_attention_heads // size
        self.attention_dropout_prob = attention_dropout_prob
        self.hidden_dropout_prob = hidden_dropout_prob
        self.cross_attention = cross_attention
        self.causal_mask_size = causal_mask_size
        self.scale_attention_scores = scale_attention_scores
        inner = num_attention_heads * attention_head_size
        init = dict(use_normal_initialization=use_normal_initialization,
                    initializer_range=initializer_range)
        what = "DistributedAttentionLayer num_attention_heads * attention_head_size"
        self.query = CutLinear(hidden_size, inner, True, "column", what, **init)
        self.key = CutLinear(hidden_size, inner, True, "column", what, **init)
        self.value = CutLinear(hidden_size, inner, True, "column", what, **init)
        self.dense = CutLinear(inner, hidden_size, True, "row", what, **init)
        _add_layernorms(self, hidden_size, layernorm_epsilon, pre_layernorm, post_layernorm)

    def _heads(self, t):
        return t.reshape(t.shape[:-1] + (self.local_heads, self.attention_head_size)) \
                .permute(0, 2, 1, 3)

    def forward(self, inp):
        if self.cross_attention:
            hidden_states, cross_states, attention_mask = inp
        else:
            (hidden_states, attention_mask), cross_states = inp, None
        norm = self.pre_layernorm(hidden_states) if self.use_pre_layernorm else hidden_states
        with outermost():
            what = "DistributedAttentionLayer"
            x = enter(norm, what)
            kv = x if cross_states is None else enter(cross_states, what, False)
            mask = enter_mask(attention_mask, hidden_states.shape[0], hidden_states.shape[1],
                              kv.shape[1], x.dtype, x.device,
                              what + " (attention_mask)")
            q = self._heads(self.query(x))
            k = self._heads(self.key(kv))
            v = self._heads(self.value(kv))
            scores = torch.matmul(q, k.transpose(-1, -2))
            if self.scale_attention_scores:
                scores = scores / math.sqrt(self.attention_head_size)
            if not self.cross_attention and self.causal_mask_size is not None:
                s_q, s_k = scores.shape[-2], scores.shape[-1]
                causal = torch.ones(s_q, s_k, dtype=torch.bool, device=scores.device) \
                              .tril(s_k - s_q)
                scores = torch.where(causal, scores,
                                     torch.tensor(torch.finfo(scores.dtype).min,
                                                  dtype=scores.dtype, device=scores.device))
            if mask is not None:
                scores = scores + mask
            probs = F.softmax(scores, dim=-1)
            size, rank, _ = tp_group()
            full = (probs.shape[0], self.num_attention_heads) + tuple(probs.shape[2:])
            probs = dropout(probs, self.attention_dropout_prob, self.training, full,
                            1, rank * self.local_heads, self.local_heads)
            context = torch.matmul(probs, v).permute(0, 2, 1, 3)
            context = context.reshape(context.shape[:-2] + (-1,))
            out = self.dense.add_bias(leave(self.dense(context), what))
        out = rows_dropout(out, self.hidden_dropout_prob, self.training)
        if self.use_post_layernorm:
            return self.layernorm(out + hidden_states)
        return out + hidden_states


class DistributedTransformerOutputLayer(DistributedModule):
    """SMP's DistributedTransformerOutputLayer (the MLP): hidden -> intermediate
    (column cut) -> activation -> hidden (row cut), dropout, residual, layer norm."""

    def __init__(self, hidden_size=1024, intermediate_size=4096, hidden_dropout_prob=0.1,
                 activation="gelu", layernorm_epsilon=1e-5, initializer_range=0.02,
                 use_normal_initialization=False, pre_layernorm=False, post_layernorm=True,
                 fp32_residual_addition=False, **_hints):
        super().__init__()
        _check_layernorms("DistributedTransformerOutputLayer", pre_layernorm, post_layernorm)
        if activation not in _ACTIVATIONS:
            raise _C.ConfigError(f"smp.nn.DistributedTransformerOutputLayer: activation="
                                 f"{activation!r} is not allowed (allowed: "
                                 f"{', '.join(_ACTIVATIONS)})")
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.hidden_dropout_prob = hidden_dropout_prob
        self.activation = activation
        self.fp32_residual_addition = fp32_residual_addition
        init = dict(use_normal_initialization=use_normal_initialization,
                    initializer_range=initializer_range)
        what = "DistributedTransformerOutputLayer intermediate_size"
        self.dense1 = CutLinear(hidden_size, intermediate_size, True, "column", what, **init)
        self.dense2 = CutLinear(intermediate_size, hidden_size, True, "row", what, **init)
        _add_layernorms(self, hidden_size, layernorm_epsilon, pre_layernorm, post_layernorm)

    def forward(self, inp):
        norm = self.pre_layernorm(inp) if self.use_pre_layernorm else inp
        with outermost():
            what = "DistributedTransformerOutputLayer"
            x = enter(norm, what)
            h = _activation(self.activation, self.dense1(x))
            out = self.dense2.add_bias(leave(self.dense2(h), what))
        out = rows_dropout(out, self.hidden_dropout_prob, self.training)
        if self.fp32_residual_addition:
            out = (out.float() + inp.float()).to(inp.dtype)
        else:
            out = out + inp
        return self.layernorm(out) if self.use_post_layernorm else out


class DistributedTransformerLayer(DistributedModule):
    """SMP's DistributedTransformerLayer: attention (then cross-attention when
    add_cross_attention), then the output layer. forward((hidden_states,
    attention_mask)) returns (hidden_states, attention_mask); with cross attention
    ((hidden_states, cross_states, attention_mask, cross_mask)) returns the 4-tuple."""

    _smp_pinned_children = False  # it only calls its blocks

    def __init__(self, num_attention_heads=32, attention_head_size=32, hidden_size=1024,
                 intermediate_size=4096, attention_dropout_prob=0.1, hidden_dropout_prob=0.1,
                 activation="gelu", layernorm_epsilon=1e-5, initializer_range=0.02,
                 use_normal_initialization=False, causal_mask_size=None,
                 add_cross_attention=False, pre_layernorm=False, post_layernorm=True,
                 **hints):
        super().__init__()
        common = dict(hidden_size=hidden_size, hidden_dropout_prob=hidden_dropout_prob,
                      layernorm_epsilon=layernorm_epsilon, initializer_range=initializer_range,
                      use_normal_initialization=use_normal_initialization,
                      pre_layernorm=pre_layernorm, post_layernorm=post_layernorm, **hints)
        attention = dict(num_attention_heads=num_attention_heads,
                         attention_head_size=attention_head_size,
                         attention_dropout_prob=attention_dropout_prob, **common)
        self.add_cross_attention = add_cross_attention
        self.attention = DistributedAttentionLayer(causal_mask_size=causal_mask_size,
                                                   **attention)
        self.output = DistributedTransformerOutputLayer(
            intermediate_size=intermediate_size, activation=activation, **common)
        if add_cross_attention:
            self.cross_attention = DistributedAttentionLayer(cross_attention=True, **attention)

    def forward(self, inp):
        if self.add_cross_attention:
            hidden_states, cross_states, attention_mask, cross_mask = inp
        else:
            hidden_states, attention_mask = inp
        with outermost():
            out = self.attention((hidden_states, attention_mask))
            if self.add_cross_attention:
                out = self.cross_attention((out, cross_states, cross_mask))
            out = self.output(out)
        if self.add_cross_attention:
            return out, cross_states, attention_mask, cross_mask
        return out, attention_mask


class DistributedTransformer(DistributedModule):
    """SMP's DistributedTransformer: `num_layers` DistributedTransformerLayers in
    `seq_layers` (an nn.Sequential). With both pre_layernorm and post_layernorm the
    layers are pre-LN and `layernorm` normalizes the stack's output (GPT-2's ln_f)."""

    _smp_pinned_children = False  # it only calls its layers and its layer norm

    def __init__(self, num_layers=12, num_attention_heads=32, attention_head_size=32,
                 hidden_size=1024, intermediate_size=4096, attention_dropout_prob=0.1,
                 hidden_dropout_prob=0.1, activation="gelu", layernorm_epsilon=1e-5,
                 initializer_range=0.02, use_normal_initialization=False,
                 causal_mask_size=None, add_cross_attention=False, pre_layernorm=False,
                 post_layernorm=True, **hints):
        super().__init__()
        _check_layernorms("DistributedTransformer", pre_layernorm, post_layernorm)
        self.num_layers = num_layers
        self.final_layernorm = pre_layernorm and post_layernorm
        layer = dict(num_attention_heads=num_attention_heads,
                     attention_head_size=attention_head_size, hidden_size=hidden_size,
                     intermediate_size=intermediate_size,
                     attention_dropout_prob=attention_dropout_prob,
                     hidden_dropout_prob=hidden_dropout_prob, activation=activation,
                     layernorm_epsilon=layernorm_epsilon, initializer_range=initializer_range,
                     use_normal_initialization=use_normal_initialization,
                     causal_mask_size=causal_mask_size,
                     add_cross_attention=add_cross_attention, pre_layernorm=pre_layernorm,
                     post_layernorm=post_layernorm and not pre_layernorm, **hints)
        self.seq_layers = torch.nn.Sequential(
            *[DistributedTransformerLayer(**layer) for _ in range(num_layers)])
        if self.final_layernorm:
            self.layernorm = FusedLayerNorm(hidden_size, eps=layernorm_epsilon)

    def forward(self, inp):
        with outermost():
            out = self.seq_layers(inp)
        if not self.final_layernorm:
            return out
        return (self.layernorm(out[0]),) + tuple(out[1:])


class DistributedTransformerLMHead(DistributedModule):
    """SMP's DistributedTransformerLMHead: word and position (and token-type)
    embeddings, their sum dropped out (embedding_dropout_prob, smp's addition; None:
    hidden_dropout_prob), a DistributedTransformer,
    and with add_lm_head a bias-free LM head tied to the word embedding.

    forward((input_ids, attention_mask, token_type_ids, position_ids, labels)):
    input_ids [N, S]; attention_mask a 0-1 [N, S] where 1 marks a masked position
    (SMP's convention; None: none masked); token_type_ids / position_ids None for the
    defaults. Returns the logits [N, S, vocab_size], or (loss, logits) with labels:
    the mean cross entropy of each next token (labels shifted by one, -100 ignored),
    as Hugging Face's causal LM heads compute it. Without add_lm_head: the hidden
    states.
    """

    # It computes with its embeddings' slices directly; the stack may be split.
    _smp_pinned_children = ("word_embedding", "position_embedding", "token_type_embedding")

    def __init__(self, num_layers=12, num_attention_heads=32, attention_head_size=32,
                 hidden_size=1024, intermediate_size=4096, vocab_size=30522,
                 num_positions=1024, attention_dropout_prob=0.1, hidden_dropout_prob=0.1,
                 activation="gelu", layernorm_epsilon=1e-5, num_token_types=0,
                 causal_mask_size=None, add_cross_attention=False, add_lm_head=True,
                 initializer_range=0.02, use_normal_initialization=False,
                 pre_layernorm=False, post_layernorm=True, embedding_dropout_prob=None,
                 **hints):
        super().__init__()
        if add_cross_attention:
            raise _C.ConfigError("smp.nn.DistributedTransformerLMHead: add_cross_attention="
                                 "True is not supported (allowed: False)")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.hidden_dropout_prob = hidden_dropout_prob
        # smp's addition: the embeddings' own dropout (GPT-2's embd_pdrop); None: SMP's
        # hidden_dropout_prob.
        self.embedding_dropout_prob = (hidden_dropout_prob if embedding_dropout_prob is None
                                       else embedding_dropout_prob)
        self.add_lm_head = add_lm_head
        emb = dict(initializer_range=initializer_range, _skip_allgather=True,
                   _skip_scatter_and_merge=True)
        self.word_embedding = DistributedEmbedding(vocab_size, hidden_size, **emb)
        self.position_embedding = DistributedEmbedding(num_positions, hidden_size, **emb)
        if num_token_types > 0:
            self.token_type_embedding = DistributedEmbedding(num_token_types, hidden_size,
                                                             **emb)
        self.num_token_types = num_token_types
        self.transformer = DistributedTransformer(
            num_layers=num_layers, num_attention_heads=num_attention_heads,
            attention_head_size=attention_head_size, hidden_size=hidden_size,
            intermediate_size=intermediate_size, attention_dropout_prob=attention_dropout_prob,
            hidden_dropout_prob=hidden_dropout_prob, activation=activation,
            layernorm_epsilon=layernorm_epsilon, initializer_range=initializer_range,
            use_normal_initialization=use_normal_initialization,
            causal_mask_size=causal_mask_size, pre_layernorm=pre_layernorm,
            post_layernorm=post_layernorm, **hints)

    def forward(self, inputs):
        input_ids, attention_mask, token_type_ids, position_ids, labels = inputs
        with outermost():
            return self._forward(input_ids, attention_mask, token_type_ids, position_ids,
                                 labels)

    def _forward(self, input_ids, attention_mask, token_type_ids, position_ids, labels):
        n, s = input_ids.shape[0], input_ids.shape[1]
        what = "DistributedTransformerLMHead embeddings"
        ids = enter(input_ids, what)
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0)
        elif position_ids.shape[0] == n:
            position_ids = enter(position_ids, what, False)
        part = self.word_embedding.local(ids) + self.position_embedding.local(position_ids)
        if self.num_token_types > 0 and token_type_ids is not None:
            part = part + self.token_type_embedding.local(enter(token_type_ids, what, False))
        hidden = self.word_embedding.merge(part, what)
        hidden = rows_dropout(hidden, self.embedding_dropout_prob, self.training)
        mask = None
        if attention_mask is not None:
            finfo = torch.finfo(hidden.dtype)
            mask = attention_mask[:, None, None, :].to(hidden.dtype) * finfo.min
        hidden = self.transformer((hidden, mask))[0]
        if not self.add_lm_head:
            return hidden
        logits = self._lm_head(hidden)
        if labels is None:
            return logits
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous().to(shift_logits.device)
        loss = F.cross_entropy(shift_logits.view(-1, shift_logits.shape[-1]).float(),
                               shift_labels.view(-1), ignore_index=-100)
        return loss, logits

    def _lm_head(self, hidden):
        """Logits of the tied head: each rank multiplies its features of the hidden
        states by its columns of the word embedding; the summands are summed."""
        what = "DistributedTransformerLMHead lm_head"
        x = enter(hidden, what)
        _, start, length = self.word_embedding.slice
        return leave(F.linear(x.narrow(-1, start, length), self.word_embedding.weight), what)
