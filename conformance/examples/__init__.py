"""Example adapters shipped with the suite (importable from an installed package).

``python -m conformance --backend conformance.examples.my_attention_backend:MyBackend``
certifies an independent scaled dot-product attention; start your own adapter
from that file.
"""
