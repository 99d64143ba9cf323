"""The framework-neutral part of the contract, written once.

Every rule that does not depend on the array library lives here, in layers
that import only downwards:

- ``tables.py``: the parameter key tables, dropout sites, choices, widths
  and parameter shapes (data only);
- ``arguments.py``: what one argument must be (``ArrayRules``) and the
  messages;
- ``rules/``: every public function's validation, one module per SPEC
  section (``rules.mha`` in ``rules/attention.py``), composed into ``Rules``;
- ``blocks.py`` and ``ring.py``: the block and ring schedules; ``interop.py``:
  the PyTorch key map.

``numpy_ref``, ``torch_impl`` and ``jax_impl`` each bind it to their own
array kind (``<package>/_checks.py``); a mirror's own files then hold only
math and framework glue. Private: no public name of the three packages comes
from here (the tree utilities are public: ``numpy_ref.trees``).
"""
