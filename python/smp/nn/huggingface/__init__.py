"""Hugging Face models under tensor parallelism (SMP v1.10's
`smp.nn.huggingface`): the built-in registrations of GPT-2 and BERT and their
state-dict translations (Note [Substitution] in smp/tp_substitution.py).

Note [Optional transformers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers is an optional dependency and a heavy import: nothing here imports it at
module level. A built-in registration is made (by smp.tp_substitution's providers)
only once transformers' own module of that model is loaded, which a model of it being
built has done; the hooks that build Hugging Face's objects import them when called.
"""
from smp import tp_substitution
from smp.nn.huggingface import bert, gpt2

__all__ = ["bert", "gpt2"]

tp_substitution.add_builtin_provider(gpt2.register)
tp_substitution.add_builtin_provider(bert.register)
