"""Integrations with model libraries (optional extras; ``import pagedkv`` needs none of them).

- ``pagedkv.integrations.hf``: Hugging Face transformers (extra ``hf``): ``paged_cache`` for
  ``generate()``, ``ContinuousBatcher`` (``batching.py``) for serving many requests.
"""
