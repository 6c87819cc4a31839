"""kvcompact: KV-cache compression for vLLM that frees whole blocks.

Importing this package has no side effects on vLLM; the engine hooks are installed by the
``vllm.general_plugins`` entry point (:func:`kvcompact.vllm.plugin.register`) and stay passive unless kvcompact
is configured. The version is the installed distribution's (``kvcompact --version``; written in pyproject.toml).
"""
