"""vLLM's side of the seam: one adapter per row of the plugin's hook table (:data:`kvcompact.vllm.plugin.HOOKS`),
grouped by the process that runs it (:mod:`.frontend`, :mod:`.scheduler`, :mod:`.worker`). Imports run one way:
``plugin`` -> ``hooks`` -> ``startup`` -> the two sides -> the core; ``plugin`` alone patches vLLM.
"""
