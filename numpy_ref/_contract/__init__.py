"""The framework-neutral part of the contract, written once.

Every rule that does not depend on the array library lives here: input
validation and its messages, the parameter key tables, the PyTorch key map
for interop, and the tree utilities. ``numpy_ref``, ``torch_impl`` and
``jax_impl`` each bind it to their own array kind; a mirror's own files then
hold only math and framework glue. Private: no public name of the three
packages comes from here.
"""
