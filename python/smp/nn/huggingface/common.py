"""What the GPT-2 and BERT registrations share: Hugging Face's attention masks as the
distributed layers take them, the checks of a configuration, and the registration
itself."""
import inspect

import torch

from smp.tp_substitution import NotDistributable

__all__ = []


def additive_mask(mask, hidden_states):
    """Hugging Face's 4-D mask as given to a layer, as the additive float mask the
    distributed layers add to their attention scores ([N, 1, 1 or S, S]).

    transformers 5 gives a layer None (no padding: sdpa, or eager without a mask; the
    causal part, if any, is then the layer's own `causal_mask_size`), a boolean mask
    (True: attend; sdpa) or an additive float one (0 or the dtype's minimum; eager).
    None stays None (the layers take it: nothing masked)."""
    dtype = hidden_states.dtype if hidden_states.is_floating_point() else torch.float32
    if mask is None:
        return None
    if mask.dim() == 2:  # [N, S] of 1 (keep) / 0 (pad): an unexpanded padding mask
        mask = mask[:, None, None, :].bool()
    if mask.dtype == torch.bool:
        out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return out.masked_fill_(~mask, torch.finfo(dtype).min)
    return mask.to(dtype)


def no_cache_in_use(cache, what):
    """A Hugging Face KV cache is not filled by a distributed layer: incremental
    decoding over one that holds tokens is refused."""
    length = getattr(cache, "get_seq_length", None)
    if cache is not None and length is not None and length() > 0:
        raise NotImplementedError(
            f"smp: {what} is distributed (tensor parallelism) and keeps no key/value "
            "cache; decoding with a filled cache is not supported (use_cache=False)")


def takes(cls, name):
    """Whether `cls.__init__` has a parameter `name`."""
    return name in inspect.signature(cls.__init__).parameters


def not_distributable(why):
    return NotDistributable(why)


def activation(name):
    """smp's activation name for Hugging Face's, or None."""
    return {"gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu": "gelu",
            "relu": "relu"}.get(name)
