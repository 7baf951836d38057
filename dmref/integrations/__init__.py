"""dmref inside other libraries' model code.

- :mod:`dmref.integrations.transformers`: dmref's attention as a Hugging Face transformers
  attention backend (``attn_implementation="dmref:delta_matching"``); needs the extra
  ``pip install "dmref[transformers]"``.

Importing this package imports none of those libraries; each submodule imports its own.
"""
