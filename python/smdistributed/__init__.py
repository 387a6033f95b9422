"""Compatibility shim: SMP v1 scripts import smdistributed.modelparallel.torch."""
