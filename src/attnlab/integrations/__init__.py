"""attnlab inside other libraries' models.

:mod:`attnlab.integrations.transformers`: importing it registers ``attn_implementation="attnlab"``
with Hugging Face transformers (needs ``pip install 'attnlab[hf]'``).
"""
