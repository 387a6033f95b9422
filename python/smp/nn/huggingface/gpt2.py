"""Hugging Face GPT-2 under tensor parallelism (SMP v1.10's
`smp.nn.huggingface.gpt2`).

Built-in registrations (Note [Substitution] in smp/tp_substitution.py), made once
transformers' GPT-2 module is loaded:
- `GPT2LMHeadModel` -> `smp.nn.DistributedTransformerLMHead` (pre-LN layers and a
  final layer norm, tanh gelu, causal mask, LM head tied to the word embedding), so
  that `model.get_module().transformer.seq_layers` are the layers, as in AWS's GPT-2
  example. Called as Hugging Face's (`input_ids`, `attention_mask`, `position_ids`,
  `labels`), it returns a `CausalLMOutputWithCrossAttentions` with `loss` (with
  labels) and `logits`.
- `GPT2Block` -> `smp.nn.DistributedTransformerLayer` (inside a GPT2Model that stays
  Hugging Face's), called and returning as the block does (a tensor).
Not distributable (left as they are, with a log line): cross-attention, untied LM
head, `scale_attn_weights=False`, `scale_attn_by_inverse_layer_idx`, activations
other than gelu_new / gelu_pytorch_tanh / gelu / relu. A key/value cache is not kept.

The state-dict translations take and give *full* (unsliced) tensors:
- Hugging Face's `transformer.h.{i}.attn.c_attn` is a Conv1D ([in, out], query, key
  and value side by side along out): smp's `attention.query/key/value` are
  nn.Linear-shaped [out, in] (transposed, split); `c_proj`, `mlp.c_fc`, `mlp.c_proj`
  are transposed into `attention.dense`, `output.dense1`, `output.dense2`.
- `ln_1`, `ln_2`, `ln_f` are `attention.pre_layernorm`, `output.pre_layernorm` and
  `transformer.layernorm`; `wte`, `wpe` are `word_embedding`, `position_embedding`;
  `lm_head.weight` is the word embedding (dropped, then given back).
- The `attn.bias` / `attn.masked_bias` buffers of older transformers are dropped and,
  where the installed transformers still has them, made again from `max_seq_len`.
Keys of neither model pass through unchanged, so a round trip gives back every key
and value exactly.
"""
import functools
import re
import sys

import torch

from smp import log, nn
from smp.nn.huggingface import common
from smp.tp_substitution import Translation

__all__ = ["translate_hf_state_dict_to_smdistributed_gpt2", "translate_state_dict_to_hf_gpt2"]

# One block: Hugging Face's suffix -> smp's, for the tensors that are only renamed.
_RENAMED = {
    "ln_1.weight": "attention.pre_layernorm.weight",
    "ln_1.bias": "attention.pre_layernorm.bias",
    "ln_2.weight": "output.pre_layernorm.weight",
    "ln_2.bias": "output.pre_layernorm.bias",
    "attn.c_proj.bias": "attention.dense.bias",
    "mlp.c_fc.bias": "output.dense1.bias",
    "mlp.c_proj.bias": "output.dense2.bias",
}
# ... and those transposed (Conv1D [in, out] -> Linear [out, in]).
_TRANSPOSED = {
    "attn.c_proj.weight": "attention.dense.weight",
    "mlp.c_fc.weight": "output.dense1.weight",
    "mlp.c_proj.weight": "output.dense2.weight",
}
_QKV = ("query", "key", "value")
_DROPPED = ("attn.bias", "attn.masked_bias")
_SMP_RENAMED = {v: k for k, v in _RENAMED.items()}
_SMP_TRANSPOSED = {v: k for k, v in _TRANSPOSED.items()}
_SMP_QKV = {f"attention.{n}.{w}" for n in _QKV for w in ("weight", "bias")}

_HF_LAYER = re.compile(r"^(transformer\.h\.|h\.)?(\d+)\.(.+)$")
_SMP_LAYER = re.compile(r"^transformer\.seq_layers\.(\d+)\.(.+)$")


def _t(x):
    return x.t().contiguous()


def _block_to_smp(suffix, value):
    """[(smp suffix, tensor)] of one Hugging Face block tensor, or None (not a block
    tensor smp knows)."""
    if suffix in _RENAMED:
        return [(_RENAMED[suffix], value)]
    if suffix in _TRANSPOSED:
        return [(_TRANSPOSED[suffix], _t(value))]
    if suffix in ("attn.c_attn.weight", "attn.c_attn.bias"):
        kind = suffix.rsplit(".", 1)[1]
        parts = value.chunk(3, dim=-1)
        return [(f"attention.{n}.{kind}", _t(p) if kind == "weight" else p.clone())
                for n, p in zip(_QKV, parts)]
    if suffix in _DROPPED:
        return []
    return None


def _block_to_hf(prefix, block, out):
    """Hugging Face's tensors of one smp block (`block`: smp suffix -> tensor) into
    `out` under `prefix`; suffixes of neither pass through."""
    for suffix, value in block.items():
        if suffix in _SMP_RENAMED:
            out[prefix + _SMP_RENAMED[suffix]] = value
        elif suffix in _SMP_TRANSPOSED:
            out[prefix + _SMP_TRANSPOSED[suffix]] = _t(value)
        elif suffix not in _SMP_QKV:
            out[prefix + suffix] = value
    for kind in ("weight", "bias"):
        parts = [block.get(f"attention.{n}.{kind}") for n in _QKV]
        if all(p is None for p in parts):
            continue
        if any(p is None for p in parts):
            raise KeyError(f"smp: {prefix}attention.{{query,key,value}}.{kind}: all three "
                           "are needed to make Hugging Face's c_attn")
        out[prefix + f"attn.c_attn.{kind}"] = (torch.cat([_t(p) for p in parts], dim=1)
                                                 if kind == "weight" else torch.cat(parts))


def _block_state_to_smp(state_dict):
    """A GPT2Block's own state dict in smp's DistributedTransformerLayer names."""
    out = {}
    for k, v in state_dict.items():
        got = _block_to_smp(k, v)
        out.update(got if got is not None else [(k, v)])
    return out


def translate_hf_state_dict_to_smdistributed_gpt2(state_dict, max_seq_len=None):
    """Hugging Face GPT2LMHeadModel's full state dict in the names of smp's
    DistributedTransformerLMHead (`max_seq_len`: SMP's signature; unused this way)."""
    out = {}
    for k, v in state_dict.items():
        if k == "transformer.wte.weight":
            out["word_embedding.weight"] = v
        elif k == "transformer.wpe.weight":
            out["position_embedding.weight"] = v
        elif k.startswith("transformer.ln_f."):
            out["transformer.layernorm." + k[len("transformer.ln_f."):]] = v
        elif k == "lm_head.weight":
            continue  # tied to the word embedding
        else:
            m = _HF_LAYER.match(k)
            got = _block_to_smp(m.group(3), v) if m and m.group(1) == "transformer.h." else None
            if got is None:
                out[k] = v
            else:
                for suffix, t in got:
                    out[f"transformer.seq_layers.{m.group(2)}.{suffix}"] = t
    return out


def translate_state_dict_to_hf_gpt2(state_dict, max_seq_len=None):
    """smp's full state dict of a distributed GPT-2 in Hugging Face's names: a
    DistributedTransformerLMHead's (GPT2LMHeadModel's names), and GPT2Blocks made
    DistributedTransformerLayers inside a Hugging Face GPT-2 (`transformer.h.{i}.`
    keys in smp's layer names). `max_seq_len` (n_positions) makes the `attn.bias`
    buffers again where the installed transformers has them."""
    out = {}
    blocks = {}  # prefix -> {smp suffix: tensor}
    for k, v in state_dict.items():
        if k == "word_embedding.weight":
            out["transformer.wte.weight"] = v
            out["lm_head.weight"] = v
        elif k == "position_embedding.weight":
            out["transformer.wpe.weight"] = v
        elif k.startswith("transformer.layernorm."):
            out["transformer.ln_f." + k[len("transformer.layernorm."):]] = v
        elif _SMP_LAYER.match(k):
            m = _SMP_LAYER.match(k)
            blocks.setdefault(f"transformer.h.{m.group(1)}.", {})[m.group(2)] = v
        else:
            m = _HF_LAYER.match(k)
            if m and m.group(3) in _SMP_RENAMED.keys() | _SMP_TRANSPOSED.keys() | _SMP_QKV:
                blocks.setdefault(f"{m.group(1) or ''}{m.group(2)}.", {})[m.group(3)] = v
            else:
                out[k] = v
    for prefix, block in blocks.items():
        _block_to_hf(prefix, block, out)
        if max_seq_len is not None and _hf_has_attn_bias():
            out[prefix + "attn.bias"] = torch.tril(
                torch.ones(max_seq_len, max_seq_len, dtype=torch.bool)).view(
                    1, 1, max_seq_len, max_seq_len)
            out[prefix + "attn.masked_bias"] = torch.tensor(-1e4)
    return out


@functools.lru_cache(maxsize=None)
def _hf_has_attn_bias():
    """Whether the installed transformers' GPT2Attention has the `bias` buffer (before
    transformers 4.4x it held the causal mask; 5.x has none)."""
    try:  # Note [Optional transformers] (smp/nn/huggingface/__init__.py)
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    except ImportError:
        return False
    attn = GPT2Attention(GPT2Config(n_embd=4, n_head=1, n_positions=2))
    return "bias" in dict(attn.named_buffers())


# --- the registrations --------------------------------------------------------------

def _layer_kwargs(config, dist):
    """DistributedTransformerLayer's arguments for a GPT-2 config (raises
    NotDistributable where smp's layer computes something else)."""
    act = common.activation(config.activation_function)
    why = []
    if act is None:
        why.append(f"activation_function={config.activation_function!r}")
    if getattr(config, "add_cross_attention", False):
        why.append("add_cross_attention=True")
    if not getattr(config, "scale_attn_weights", True):
        why.append("scale_attn_weights=False")
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        why.append("scale_attn_by_inverse_layer_idx=True")
    if config.n_embd % config.n_head:
        why.append(f"n_embd={config.n_embd} is not a multiple of n_head={config.n_head}")
    if why:
        raise common.not_distributable("GPT-2 with " + ", ".join(why) + " has no "
                                       "distributed equivalent")
    return dict(
        num_attention_heads=config.n_head, attention_head_size=config.n_embd // config.n_head,
        hidden_size=config.n_embd,
        intermediate_size=config.n_inner if config.n_inner is not None else 4 * config.n_embd,
        attention_dropout_prob=config.attn_pdrop, hidden_dropout_prob=config.resid_pdrop,
        activation=act, layernorm_epsilon=config.layer_norm_epsilon,
        initializer_range=config.initializer_range, use_normal_initialization=True,
        causal_mask_size=config.n_positions, add_cross_attention=False,
        pre_layernorm=True, post_layernorm=False)


def _lm_head_init_hook(config, *args, **kwargs):
    dist = nn.DistributedTransformerLMHead
    if not getattr(config, "tie_word_embeddings", True):
        raise common.not_distributable("its LM head is not tied to the word embedding "
                                       "(tie_word_embeddings=False)")
    kw = _layer_kwargs(config, dist)
    kw.update(num_layers=config.n_layer, vocab_size=config.vocab_size,
              num_positions=config.n_positions, num_token_types=0, add_lm_head=True,
              post_layernorm=True)
    if config.embd_pdrop != config.resid_pdrop:
        if common.takes(dist, "embedding_dropout_prob"):
            kw["embedding_dropout_prob"] = config.embd_pdrop
        else:
            raise common.not_distributable(
                f"embd_pdrop={config.embd_pdrop} differs from resid_pdrop="
                f"{config.resid_pdrop} (smp's LM head drops both alike)")
    return (), {k: v for k, v in kw.items() if common.takes(dist, k)}


def _lm_head_forward_hook(input_ids=None, cache=None, attention_mask=None,
                          token_type_ids=None, position_ids=None, inputs_embeds=None,
                          encoder_hidden_states=None, encoder_attention_mask=None,
                          labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    cache = kwargs.pop("past_key_values", cache)
    common.no_cache_in_use(cache, "GPT2LMHeadModel")
    unsupported = [n for n, v in (("inputs_embeds", inputs_embeds),
                                  ("encoder_hidden_states", encoder_hidden_states),
                                  ("token_type_ids", token_type_ids)) if v is not None]
    if logits_to_keep not in (0, None):
        unsupported.append("logits_to_keep")
    if unsupported:
        raise NotImplementedError(f"smp: GPT2LMHeadModel is distributed (tensor "
                                  f"parallelism); {unsupported} are not supported")
    if input_ids is None:
        raise ValueError("smp: the distributed GPT2LMHeadModel needs input_ids")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError("smp: the distributed GPT2LMHeadModel takes a 2-D "
                                  "attention_mask ([batch, sequence] of 1 and 0)")
    if attention_mask is not None:  # Hugging Face's 1 keeps a token, SMP's 1 masks it
        attention_mask = 1 - attention_mask.long()
    return ((input_ids, attention_mask, None, position_ids, labels),), {}


def _lm_head_return_hook(output):
    # Note [Optional transformers] (smp/nn/huggingface/__init__.py)
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions
    if isinstance(output, (tuple, list)):
        loss, logits = output[0], output[1]
    else:
        loss, logits = None, output
    return CausalLMOutputWithCrossAttentions(loss=loss, logits=logits)


def _block_init_hook(config, layer_idx=None):
    dist = nn.DistributedTransformerLayer
    kw = _layer_kwargs(config, dist)
    return (), {k: v for k, v in kw.items() if common.takes(dist, k)}


def _block_forward_hook(hidden_states, cache=None, attention_mask=None,
                        encoder_hidden_states=None, encoder_attention_mask=None,
                        use_cache=False, **kwargs):
    cache = kwargs.pop("past_key_values", cache)
    common.no_cache_in_use(cache, "GPT2Block")
    if encoder_hidden_states is not None:
        raise NotImplementedError("smp: GPT2Block is distributed (tensor parallelism) "
                                  "without cross-attention; encoder_hidden_states given")
    return ((hidden_states, common.additive_mask(attention_mask, hidden_states)),), {}


def _block_return_hook(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def _lm_head_values(module):
    """The model's weights by smp's names; None where Hugging Face's initialization
    never ran (a tied config whose head is not tied: `init_weights`, which ties, was
    skipped, as AWS's GPT-2 example does expecting SMP to initialize the distributed
    model): the distributed module then keeps its own, SMP's N(0, initializer_range)."""
    if (getattr(module.config, "tie_word_embeddings", True)
            and module.lm_head.weight is not module.transformer.wte.weight):
        log.get_logger().info("smp: tensor parallelism: %s was not initialized by Hugging "
                              "Face (its head is not tied); smp initializes it",
                              type(module).__name__)
        return None
    return translate_hf_state_dict_to_smdistributed_gpt2(module.state_dict(),
                                                         module.config.n_positions)


def _block_values(module):
    return _block_state_to_smp(module.state_dict())


def _translations(module):
    n = _config_of(module).n_positions
    return (Translation("gpt2", translate_state_dict_to_hf_gpt2, max_seq_len=n),
            Translation("gpt2", translate_hf_state_dict_to_smdistributed_gpt2, max_seq_len=n))


def _config_of(module):
    return module.config if hasattr(module, "config") else module.attn.config


def register(registry, register_fn, Registration):
    """The built-in registrations (smp.tp_substitution.register_builtins), each unless
    the user registered its class already, once transformers' GPT-2 module is loaded."""
    hf = sys.modules.get("transformers.models.gpt2.modeling_gpt2")
    if hf is None or not hasattr(nn, "DistributedTransformerLayer"):
        return  # Note [Optional transformers] (smp/nn/huggingface/__init__.py)
    if hf.GPT2LMHeadModel not in registry:
        register_fn(Registration(
            hf.GPT2LMHeadModel, nn.DistributedTransformerLMHead, _lm_head_init_hook,
            _lm_head_forward_hook, _lm_head_return_hook, values=_lm_head_values,
            recover_args=lambda m: ((m.config,), {}), translations=_translations,
            builtin=True))
    if hf.GPT2Block not in registry:
        register_fn(Registration(
            hf.GPT2Block, nn.DistributedTransformerLayer, _block_init_hook,
            _block_forward_hook, _block_return_hook, values=_block_values,
            recover_args=lambda m: ((m.attn.config,), {"layer_idx": m.attn.layer_idx}),
            translations=_translations, builtin=True))
