"""Hugging Face BERT under tensor parallelism (SMP v1.10's `smp.nn.huggingface.bert`).

Built-in registration (Note [Substitution] in smp/tp_substitution.py), made once
transformers' BERT module is loaded: `BertLayer` -> `smp.nn.DistributedTransformerLayer`
(post-LN, erf gelu), inside a model that stays Hugging Face's (`BertModel`,
`BertForMaskedLM`, ...), called and returning as the layer does (a tensor). Not
distributable (left as it is, with a log line): cross-attention, activations other
than gelu / gelu_new / relu. A decoder BERT (`is_decoder`) keeps its causal mask.

The translations take and give *full* state dicts and rename each layer's tensors
(`<prefix>layer.{i}.` is kept, every other key passes through):
`attention.self.{query,key,value}` -> `attention.{query,key,value}`,
`attention.output.dense` -> `attention.dense`, `attention.output.LayerNorm` ->
`attention.layernorm`, `intermediate.dense` -> `output.dense1`, `output.dense` ->
`output.dense2`, `output.LayerNorm` -> `output.layernorm` (all nn.Linear: no
transposes), so a round trip gives back every key and value exactly.
"""
import re
import sys

from smp import nn
from smp.nn.huggingface import common
from smp.tp_substitution import Translation

__all__ = ["translate_hf_state_dict_to_smdistributed_bert", "translate_state_dict_to_hf_bert"]

_LAYER = {  # Hugging Face's BertLayer suffix (without .weight/.bias) -> smp's
    "attention.self.query": "attention.query",
    "attention.self.key": "attention.key",
    "attention.self.value": "attention.value",
    "attention.output.dense": "attention.dense",
    "attention.output.LayerNorm": "attention.layernorm",
    "intermediate.dense": "output.dense1",
    "output.dense": "output.dense2",
    "output.LayerNorm": "output.layernorm",
}
_TO_SMP = {f"{k}.{w}": f"{v}.{w}" for k, v in _LAYER.items() for w in ("weight", "bias")}
_TO_HF = {v: k for k, v in _TO_SMP.items()}
_KEY = re.compile(r"^(.*?)((?:^|\.)layer\.\d+\.)(.+)$")


def _translate(state_dict, table):
    out = {}
    for k, v in state_dict.items():
        m = _KEY.match(k)
        if m and m.group(3) in table:
            out[m.group(1) + m.group(2) + table[m.group(3)]] = v
        else:
            out[k] = v
    return out


def translate_hf_state_dict_to_smdistributed_bert(state_dict):
    """Hugging Face BERT's full state dict with each `layer.{i}.`'s tensors in smp's
    DistributedTransformerLayer names."""
    return _translate(state_dict, _TO_SMP)


def translate_state_dict_to_hf_bert(state_dict):
    """smp's full state dict of a BERT whose layers are distributed, in Hugging
    Face's names."""
    return _translate(state_dict, _TO_HF)


def _layer_values(module):
    """A BertLayer's own state dict in smp's names."""
    return {_TO_SMP.get(k, k): v for k, v in module.state_dict().items()}


# --- the registration ---------------------------------------------------------------

def _init_hook(config, layer_idx=None):
    dist = nn.DistributedTransformerLayer
    act = common.activation(config.hidden_act) if isinstance(config.hidden_act, str) else None
    why = []
    if act is None:
        why.append(f"hidden_act={config.hidden_act!r}")
    if getattr(config, "add_cross_attention", False):
        why.append("add_cross_attention=True")
    if config.hidden_size % config.num_attention_heads:
        why.append(f"hidden_size={config.hidden_size} is not a multiple of "
                   f"num_attention_heads={config.num_attention_heads}")
    if why:
        raise common.not_distributable("BERT with " + ", ".join(why) + " has no "
                                       "distributed equivalent")
    kw = dict(
        num_attention_heads=config.num_attention_heads,
        attention_head_size=config.hidden_size // config.num_attention_heads,
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        attention_dropout_prob=config.attention_probs_dropout_prob,
        hidden_dropout_prob=config.hidden_dropout_prob, activation=act,
        layernorm_epsilon=config.layer_norm_eps, initializer_range=config.initializer_range,
        use_normal_initialization=True,
        causal_mask_size=config.max_position_embeddings if config.is_decoder else None,
        add_cross_attention=False, pre_layernorm=False, post_layernorm=True)
    return (), {k: v for k, v in kw.items() if common.takes(dist, k)}


def _forward_hook(hidden_states, attention_mask=None, encoder_hidden_states=None,
                  encoder_attention_mask=None, cache=None, **kwargs):
    cache = kwargs.pop("past_key_values", cache)
    common.no_cache_in_use(cache, "BertLayer")
    if encoder_hidden_states is not None:
        raise NotImplementedError("smp: BertLayer is distributed (tensor parallelism) "
                                  "without cross-attention; encoder_hidden_states given")
    return ((hidden_states, common.additive_mask(attention_mask, hidden_states)),), {}


def _return_hook(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def _translations(module):
    return (Translation("bert", translate_state_dict_to_hf_bert),
            Translation("bert", translate_hf_state_dict_to_smdistributed_bert))


def register(registry, register_fn, Registration):
    """The built-in registration (smp.tp_substitution.register_builtins), unless the
    user registered BertLayer already."""
    hf = sys.modules.get("transformers.models.bert.modeling_bert")
    if hf is None or not hasattr(nn, "DistributedTransformerLayer"):
        return  # Note [Optional transformers] (smp/nn/huggingface/__init__.py)
    if hf.BertLayer not in registry:
        register_fn(Registration(
            hf.BertLayer, nn.DistributedTransformerLayer, _init_hook, _forward_hook,
            _return_hook, values=_layer_values,
            recover_args=lambda m: ((m.attention.self.config,),
                                    {"layer_idx": m.attention.self.layer_idx}),
            translations=_translations, builtin=True))
